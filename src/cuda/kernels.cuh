// The elementwise and data-movement kernels of the CUDA backend: RMSNorm, RoPE, cache
// insert in every format, the decode query, the context gather, the gate, the LSE merge,
// the fp8 prefill cast and padding. Each follows docs/SEMANTICS.md (the CPU backend in
// src/cpu is the executable statement of it) to the bit where the CPU is exact fp32.
// All take an explicit stream, never allocate or synchronize, and check the launch.
#pragma once

#include "cuda/common.cuh"

namespace kmla::cuda {

// ---- RMSNorm ------------------------------------------------------------------------
// In place on rows [0, rows): x[t * stride + i], i < n, with weight w[n] (act):
// y = x * (1 / sqrt(mean(x^2) + eps)) * w in fp32, one rounding to act. Two segments (q_c and
// kv_c of the fused front end) in one launch; a segment with n == 0 is skipped.
struct NormSegment {
  void* x = nullptr;
  int64_t stride = 0;
  int n = 0;
  const void* weight = nullptr;
};
struct CacheInsertParams;
// With `insert`, segment a must be the 512-wide latent at insert->kv (same stride, rows and
// act): its normalised rows are then also encoded into the cache as cache_insert(*insert)
// does, in the same launch when the row is on the vector path (else as a second launch).
void rms_norm(const NormSegment& a, const NormSegment& b, int64_t rows, float eps, DType act,
              cudaStream_t stream, const CacheInsertParams* insert = nullptr);

// ---- RoPE -----------------------------------------------------------------------------
// Interleaved pairs (x[2i], x[2i+1]) rotated in fp32 by row positions[t] of the fp32 table
// (table[p * 64 + i] = cos_i, table[p * 64 + 32 + i] = sin_i):
//   x'[2i] = x[2i] cos_i - x[2i+1] sin_i;  x'[2i+1] = x[2i+1] cos_i + x[2i] sin_i.
// For rows t < rows:
//  * q rope parts in place: q[t * q_stride + h * 192 + 128 + j], h < heads, rounded to act;
//    for t < q_f32_rows also the unrounded rotation to q_f32[(t * heads + h) * 64 + j].
//  * k_pe[t * k_stride + j] (not modified) -> k_act[t * 64 + j] rounded to act and, when
//    k_f32 != nullptr, the unrounded rotation to k_f32[t * 64 + j].
// A position outside [0, table_rows) raises kErrBadPosition and rotates by row 0.
struct RopeParams {
  const float* table = nullptr;
  int64_t table_rows = 0;
  const int64_t* positions = nullptr;
  int64_t rows = 0;
  void* q = nullptr;
  int64_t q_stride = 0;
  int heads = 0;
  float* q_f32 = nullptr;
  int64_t q_f32_rows = 0;
  const void* k_pe = nullptr;
  int64_t k_stride = 0;
  void* k_act = nullptr;
  float* k_f32 = nullptr;
  DType act = DType::bf16;
  int* error_flag = nullptr;
};
void rope(const RopeParams& p, cudaStream_t stream);

// ---- cache insert -----------------------------------------------------------------------
// For rows t < rows with slot = slots[t] >= 0, encodes the 576 values
// [kv[t * kv_stride + i] (act, i < 512) | rope[t * rope_stride + j] (act, or fp32 when
// rope_f32; j < 64)] into the cache row of `slot`, exactly as RowCodec::encode does (bf16 /
// fp16: RNE; fp8: e4m3_scaled_clamped(x, 1 / k_scale); fp8_ds_mla: 4 tile scales by the
// cache's rule, codes e4m3(x / scale), rope bf16). A slot >= cache.num_slots() raises
// kErrBadSlot and writes nothing for that row.
struct CacheInsertParams {
  const void* kv = nullptr;
  int64_t kv_stride = 0;
  const void* rope = nullptr;
  int64_t rope_stride = 0;
  bool rope_f32 = false;
  DType act = DType::bf16;
  const int64_t* slots = nullptr;
  int64_t rows = 0;
  CacheRef cache;
  int* error_flag = nullptr;
};
void cache_insert(const CacheInsertParams& p, cudaStream_t stream);

// ---- decode query ---------------------------------------------------------------------
// mqa [rows, heads, 576] (act) already holds ql_nope in its first 512 columns. Writes the
// rope part: from q_rope_f32[(t * heads + h) * 64 + j] when given (plain fp8 with RoPE), else
// from q[t * q_stride + h * 192 + 128 + j] (act). When q8 != nullptr (plain fp8 cache) also
// writes q8 [rows, heads, 576] = e4m3_scaled_clamped(x, 1 / q_scale) of the whole row.
struct DecodeQueryParams {
  void* mqa = nullptr;
  int64_t rows = 0;
  int heads = 0;
  const void* q = nullptr;
  int64_t q_stride = 0;
  const float* q_rope_f32 = nullptr;
  uint8_t* q8 = nullptr;
  float q_scale = 1.0f;
  DType act = DType::bf16;
};
void decode_query(const DecodeQueryParams& p, cudaStream_t stream);

// ---- context gather ---------------------------------------------------------------------
// One context chunk: for j < num_requests, rows [cu_len[j], cu_len[j+1]) of out [*, 576] (act)
// get the cache rows of positions start + (r - cu_len[j]) of request first_request + j,
// through batch.block_tables, dequantized (RowCodec::decode: fp8 * k_scale; fp8_ds_mla kv part
// bf16(code * tile_scale)) and rounded to act. cu_len is a device int32 array. A block id
// outside the cache raises kErrBadBlockId and gives a zero row.
struct GatherParams {
  CacheRef cache;
  DeviceBatch batch;
  int first_request = 0;
  const int32_t* cu_len = nullptr;
  int num_requests = 0;
  int64_t start = 0;
  int64_t total_rows = 0;  // cu_len[num_requests], known on the host
  void* out = nullptr;
  DType act = DType::bf16;
  int* error_flag = nullptr;
};
void gather_context(const GatherParams& p, cudaStream_t stream);

// ---- gate -------------------------------------------------------------------------------
// attn[t * width + i] = act(attn * (1 / (1 + exp(-g)))) for t < rows, with g (act) at
// g[t * g_stride + i]; fp32 math (expf). With `num_tokens` (a device scalar), rows
// t >= *num_tokens are set to +0 instead, so that a projection of them is zero.
void gate(void* attn, const void* g, int64_t g_stride, int64_t rows, int64_t width, DType act,
          cudaStream_t stream, const int32_t* num_tokens = nullptr);

// ---- merge ------------------------------------------------------------------------------
// LSE merge of two partial results [rows, heads, dim] (act) with LSEs [rows, heads] (fp32)
// as cpu::merge_attn_f32 does it (+-inf LSE counts as empty; both empty gives the prefix and
// -inf); rows >= rows_with_prefix copy the suffix. out may alias prefix or suffix; out_lse may
// be nullptr or alias either LSE. The output is rounded to act.
struct MergeParams {
  const void* prefix = nullptr;
  const float* prefix_lse = nullptr;
  const void* suffix = nullptr;
  const float* suffix_lse = nullptr;
  int64_t rows = 0, rows_with_prefix = 0;
  int heads = 0, dim = 0;
  void* out = nullptr;
  float* out_lse = nullptr;
  DType act = DType::bf16;
};
void merge_states(const MergeParams& p, cudaStream_t stream);

// ---- small helpers ------------------------------------------------------------------------
// The fp8 prefill mode's unscaled cast in place: x = act(e4m3_sat(clamp(x, +-448))) for
// `width` values of each of `rows` rows at row stride `stride` (elements).
void e4m3_roundtrip(void* x, int64_t rows, int64_t width, int64_t stride, DType act,
                    cudaStream_t stream);
// Zeroes rows [*num_tokens, num_rows) of a [num_rows, row_bytes] buffer (num_tokens is a
// device scalar, so a captured graph zeroes the padding of whatever batch it replays).
void zero_padding_rows(void* x, int64_t num_rows, int64_t row_bytes, const int32_t* num_tokens,
                       cudaStream_t stream);

}  // namespace kmla::cuda
