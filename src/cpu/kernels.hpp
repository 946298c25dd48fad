// The CPU backend's fp32 building blocks, shared by the public stages (stages.cpp) and the
// layer (layer.cpp). Everything here works on plain fp32 buffers; the 16-bit and fp8
// tensors of the API are converted at the edges. "Rounded to act" means an fp32 buffer
// whose values are exactly representable in the activation dtype.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "kmla/batch.hpp"
#include "kmla/cache.hpp"
#include "kmla/config.hpp"
#include "kmla/rope.hpp"
#include "kmla/tensor.hpp"
#include "kmla/weights.hpp"

namespace kmla::cpu {

// An fp32 scratch buffer left uninitialised, for buffers every use overwrites in full: the
// pages are then first touched by the (parallel) kernel that fills them instead of by a
// serial zero fill, which costs as much as the elementwise work itself on large prefills.
struct Scratch {
  std::unique_ptr<float[]> ptr;
  Scratch() = default;
  explicit Scratch(int64_t n) : ptr(new float[size_t(std::max<int64_t>(n, 1))]) {}
  float* data() const { return ptr.get(); }
};

// ---- GEMM (gemm.cpp): row-major OpenBLAS sgemm, fp32 accumulate ---------------------
// The CPU backend owns its threads: OpenBLAS is switched to one thread (process-wide,
// once, on the first GEMM) and every sgemm runs inside the calling thread. Left threaded,
// OpenBLAS's pool spins against our workers whenever sgemm is called from them (measured:
// decode attention 10x slower on 2 cores). Large GEMMs are instead split into slabs of
// output columns (or rows) across `threads` of our own workers.
//
// C[M, N] = alpha * A[M, K] * B[N, K]^T + beta * C
void gemm_nt(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc, float alpha = 1.0f, float beta = 0.0f,
             int threads = 1);
// C[M, N] = alpha * A[M, K] * B[K, N] + beta * C
void gemm_nn(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc, float alpha = 1.0f, float beta = 0.0f,
             int threads = 1);

// ---- conversions (gemm.cpp) -----------------------------------------------------------
// Reads n values of type `dtype` (f32, bf16, f16, or e4m3 times `e4m3_scale`) as fp32.
void load_f32(const void* src, DType dtype, int64_t n, float* dst, float e4m3_scale = 1.0f);
// Writes n fp32 values as `dtype` (f32, bf16 or f16; RNE).
void store_f32(const float* src, int64_t n, DType dtype, void* dst);
// Rounds in place to `dtype` (bf16 or f16); f32 leaves the values alone.
void round_to(float* x, int64_t n, DType dtype);
float round_value(float x, DType dtype);
// The fp8 prefill mode's unscaled cast: e4m3(clamp(x, +-448)) read back as fp32.
void e4m3_roundtrip(float* x, int64_t n);
// A 16-bit weight tensor as a dense fp32 copy (bf16/f16 values are exact in fp32).
std::vector<float> weight_f32(const HostTensor& w);
// An fp8 block weight as a dense fp32 copy: float(code) * scale, one fp32 product each.
std::vector<float> fp8_weight_f32(const Fp8BlockWeight& w);
// The W8A8 activation quantization (quantize_activation_fp8, per 128 inputs) of `rows`
// rows of n values at row stride `stride`, into a dense [rows, n] buffer.
void quantize_rows_fp8(const float* x, int64_t rows, int64_t stride, int64_t n, float* out, int threads);

// ---- attention (attention.cpp) -------------------------------------------------------
// Absorbed MQA over the paged latent cache for the decode rows of md.
// q [Td, H, 576] fp32 (already dequantized), out [Td, H, 512] fp32 (unrounded),
// lse [Td, H] natural log. A row with no keys gets zeros and -inf.
void decode_attention_f32(const float* q, int heads, const LatentCache& cache,
                          const BatchMetadata& md, float scale, float* out, float* lse,
                          int threads);

// One operand of prefill attention: head h of row t lives at ptr + t*row_stride + h*head_stride.
struct Strided {
  const float* ptr = nullptr;
  int64_t row_stride = 0;
  int64_t head_stride = 0;
};

// Variable-length attention, qk head 192 and v head 128, for `heads` heads. Sequence s has
// queries [cu_q[s], cu_q[s+1]) and keys [cu_k[s], cu_k[s+1]); causal is bottom-right
// aligned. out (unrounded fp32) and lse follow the same strided addressing.
struct PrefillProblem {
  Strided q, k, v;
  float* out = nullptr;
  int64_t out_row_stride = 0, out_head_stride = 0;
  float* lse = nullptr;
  int64_t lse_row_stride = 0;  // lse[t * lse_row_stride + h]
  int heads = 0;
  const std::vector<int64_t>* cu_q = nullptr;
  const std::vector<int64_t>* cu_k = nullptr;
  bool causal = true;
  float scale = 1.0f;
};
void prefill_attention_f32(const PrefillProblem& p, int threads);

// LSE merge of two partial results [rows, H, D] with LSEs [rows, H]. Rows >=
// rows_with_prefix copy the suffix. The output is rounded to `round` (f32: not rounded).
// out may alias prefix or suffix; out_lse may be null or alias either LSE.
void merge_attn_f32(const float* prefix, const float* prefix_lse, const float* suffix,
                    const float* suffix_lse, int64_t rows, int64_t rows_with_prefix, int heads,
                    int dim, float* out, float* out_lse, DType round);

// ---- cache writes and validation (stages.cpp) -----------------------------------------
// Checks a batch's metadata against itself and the cache: array sizes, lengths, request
// classes, block tables of every request, context chunks. Slots are checked separately.
void validate_metadata(const BatchMetadata& md, const LatentCache& cache);
// Every slot of tokens [0, n) is negative (skip) or inside the cache.
void validate_slots(const int64_t* slots, int64_t n, const LatentCache& cache);

// Writes rows [kv (512) | k_pe (64)] for every token with slot >= 0. k_pe must already be
// rotated and rounded as the cache format wants. Slots must have been validated.
void write_cache_rows(const float* kv, int64_t kv_stride, const float* k_pe, int64_t pe_stride,
                      const int64_t* slots, int64_t n, const LatentCache& cache, int threads);

}  // namespace kmla::cpu
