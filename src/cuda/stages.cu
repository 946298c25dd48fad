// The public stages on device tensors: thin checks over the kernels in kernels.cu.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "cuda/attention.cuh"
#include "cuda/common.cuh"
#include "cuda/kernels.cuh"
#include "kmla/cuda.hpp"

namespace kmla::cuda {

// The rotated rope part: act-rounded [T, 64] (what the rope kernel always writes) and, for the
// plain fp8 cache, the unrounded fp32 rotation [T, 64] after it.
size_t cache_insert_workspace_bytes(int64_t tokens) {
  return size_t(tokens) * kRopeDim * (sizeof(float) + sizeof(uint16_t));
}

void cache_insert(const TensorView& kv_c_normed, const TensorView& k_pe, const TensorView& positions,
                  const float* rope_table_device, int64_t rope_rows, const TensorView& slot_mapping,
                  LatentCache& cache, void* workspace, int* error_flag, Stream stream) {
  const DType act = kv_c_normed.dtype;
  KMLA_CHECK(act == DType::bf16 || act == DType::f16, "kv_c_normed must be bf16 or f16, got ", dtype_name(act));
  check_tensor(kv_c_normed, "kv_c_normed", act, {-1, kKvLoraRank}, Device::cuda);
  const int64_t T = kv_c_normed.dim(0);
  check_tensor(k_pe, "k_pe", act, {T, kRopeDim}, Device::cuda);
  check_tensor(slot_mapping, "slot_mapping", DType::i64, {T}, Device::cuda);
  const CacheRef cref = cache_ref(cache);
  if (T == 0) return;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  CacheInsertParams ci;
  ci.kv = kv_c_normed.data;
  ci.kv_stride = kKvLoraRank;
  ci.rope = k_pe.data;
  ci.rope_stride = kRopeDim;
  ci.act = act;
  if (rope_table_device) {
    // Rotate into the workspace: fp32 for the plain fp8 cache (the seed's writer encodes the
    // unrounded rotation), act-rounded otherwise.
    check_tensor(positions, "positions", DType::i64, {T}, Device::cuda);
    KMLA_CHECK(workspace, "cache_insert with RoPE needs cache_insert_workspace_bytes(", T, ") of workspace");
    const bool f32 = cache.format() == CacheFormat::fp8;
    RopeParams rp;
    rp.table = rope_table_device;
    rp.table_rows = rope_rows;
    rp.positions = positions.as<const int64_t>();
    rp.rows = T;
    rp.k_pe = k_pe.data;
    rp.k_stride = kRopeDim;
    auto* f32_part = reinterpret_cast<float*>(static_cast<std::byte*>(workspace) + T * kRopeDim * 2);
    rp.k_act = workspace;
    rp.k_f32 = f32 ? f32_part : nullptr;
    rp.act = act;
    rp.error_flag = error_flag;
    rope(rp, s);
    ci.rope = f32 ? static_cast<void*>(f32_part) : workspace;
    ci.rope_f32 = f32;
  }
  ci.slots = slot_mapping.as<const int64_t>();
  ci.rows = T;
  ci.cache = cref;
  ci.error_flag = error_flag;
  cache_insert(ci, s);
}

void merge_attn_states(const TensorView& prefix_out, const TensorView& prefix_lse,
                       const TensorView& suffix_out, const TensorView& suffix_lse,
                       int64_t rows_with_prefix, const TensorView& out, const TensorView& out_lse,
                       Stream stream) {
  const DType act = prefix_out.dtype;
  KMLA_CHECK(act == DType::bf16 || act == DType::f16, "prefix_out must be bf16 or f16, got ", dtype_name(act));
  check_tensor(prefix_out, "prefix_out", act, {-1, -1, -1}, Device::cuda);
  const int64_t rows = prefix_out.dim(0), H = prefix_out.dim(1), D = prefix_out.dim(2);
  check_tensor(prefix_lse, "prefix_lse", DType::f32, {rows, H}, Device::cuda);
  check_tensor(suffix_out, "suffix_out", act, {rows, H, D}, Device::cuda);
  check_tensor(suffix_lse, "suffix_lse", DType::f32, {rows, H}, Device::cuda);
  check_tensor(out, "out", act, {rows, H, D}, Device::cuda);
  if (out_lse.data) check_tensor(out_lse, "out_lse", DType::f32, {rows, H}, Device::cuda);
  KMLA_CHECK(rows_with_prefix >= 0 && rows_with_prefix <= rows, "rows_with_prefix ", rows_with_prefix,
             " is outside [0, ", rows, "]");
  MergeParams mp;
  mp.prefix = prefix_out.data;
  mp.prefix_lse = prefix_lse.as<const float>();
  mp.suffix = suffix_out.data;
  mp.suffix_lse = suffix_lse.as<const float>();
  mp.rows = rows;
  mp.rows_with_prefix = rows_with_prefix;
  mp.heads = int(H);
  mp.dim = int(D);
  mp.out = out.data;
  mp.out_lse = out_lse.data ? out_lse.as<float>() : nullptr;
  mp.act = act;
  merge_states(mp, reinterpret_cast<cudaStream_t>(stream));
}

void prefill_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                       const TensorView& cu_q, const TensorView& cu_k, int max_q_len, bool causal,
                       double softmax_scale, const TensorView& out, const TensorView& lse,
                       Stream stream) {
  const DType act = q.dtype;
  KMLA_CHECK(act == DType::bf16 || act == DType::f16, "prefill q must be bf16 or f16 on CUDA, got ",
             dtype_name(act));
  check_tensor(q, "prefill q", act, {-1, -1, kQkHeadDim}, Device::cuda);
  const int64_t Tq = q.dim(0), H = q.dim(1);
  check_tensor(k, "prefill k", act, {-1, H, kQkHeadDim}, Device::cuda);
  check_tensor(v, "prefill v", act, {k.dim(0), H, kVDim}, Device::cuda);
  check_tensor(out, "prefill output", act, {Tq, H, kVDim}, Device::cuda);
  check_tensor(lse, "prefill lse", DType::f32, {Tq, H}, Device::cuda);
  check_tensor(cu_q, "cu_q", DType::i32, {-1}, Device::cuda);
  check_tensor(cu_k, "cu_k", DType::i32, {cu_q.dim(0)}, Device::cuda);
  KMLA_CHECK(cu_q.dim(0) >= 1, "cu_q needs at least one entry");
  KMLA_CHECK(max_q_len >= 0, "max_q_len must be >= 0, got ", max_q_len);
  KMLA_CHECK(std::isfinite(softmax_scale), "softmax scale must be finite, got ", softmax_scale);
  const size_t as = dtype_size(act);
  PrefillParams p;
  p.q = {q.data, H * kQkHeadDim, kQkHeadDim};
  p.k_nope = {k.data, H * kQkHeadDim, kQkHeadDim};
  p.k_rope = {static_cast<const std::byte*>(k.data) + kNopeDim * as, H * kQkHeadDim, kQkHeadDim};
  p.v = {v.data, H * kVDim, kVDim};
  p.out = out.data;
  p.out_row_stride = H * kVDim;
  p.out_head_stride = kVDim;
  p.lse = lse.as<float>();
  p.lse_row_stride = H;
  p.heads = int(H);
  p.cu_q = cu_q.as<const int32_t>();
  p.cu_k = cu_k.as<const int32_t>();
  p.num_seqs = int(cu_q.dim(0) - 1);
  p.max_q_len = max_q_len;
  p.total_q = Tq;  // every sequence's rows lie in q's Tq rows
  p.causal = causal;
  p.softmax_scale = float(softmax_scale);
  p.act = act;
  prefill_attention(p, reinterpret_cast<cudaStream_t>(stream));
}

// ---- decode attention ------------------------------------------------------------------------

struct DecodeAttention::Impl {
  CacheGeometry geo;
  int requests = 0, heads = 0, max_blocks = 0;
  bool causal = true;
  int64_t rows = 0;  // decode tokens
  DecodePlan plan;
  std::vector<std::byte> image;  // block tables | seq lens | query lens | query starts | walk
  size_t off_seq = 0, off_qlen = 0, off_qstart = 0, off_walk = 0, off_work = 0, total = 0;
  int walk_key_tile = 0;  // decode_walk_table's answer (0: no table)
};

DecodeAttention::DecodeAttention(const BatchMetadata& md, const LatentCache& cache, int heads,
                                 bool portable, bool batch_invariant)
    : impl_(std::make_unique<Impl>()) {
  validate_batch(md, cache.geometry());
  KMLA_CHECK(heads >= 1 && heads <= 128, "decode attention heads must be in [1, 128], got ", heads);
  Impl& d = *impl_;
  d.geo = cache.geometry();
  d.requests = md.num_decodes;
  d.heads = heads;
  d.max_blocks = std::max(md.max_blocks_per_request, 1);
  d.rows = md.num_decode_tokens;
  d.causal = md.causal_decode;
  int64_t max_seq = 0;
  for (int r = 0; r < d.requests; ++r) {
    KMLA_CHECK(md.seq_lens[size_t(r)] <= INT32_MAX, "sequence length ", md.seq_lens[size_t(r)],
               " of request ", r, " does not fit the CUDA backend's int32 lengths");
    max_seq = std::max(max_seq, md.seq_lens[size_t(r)]);
  }
  if (d.requests > 0)
    d.plan = plan_decode(d.requests, heads, std::max(1, md.max_decode_query_len), max_seq, portable,
                         batch_invariant, d.geo.format);
  auto align = [](size_t x) { return (x + 255) & ~size_t(255); };
  const size_t R = size_t(d.requests);
  d.off_seq = align(R * size_t(d.max_blocks) * 4);
  d.off_qlen = d.off_seq + align(R * 4);
  d.off_qstart = d.off_qlen + align(R * 4);
  d.off_walk = d.off_qstart + align((R + 1) * 4);
  d.off_work = d.off_walk + align(decode_walk_table_bytes(d.plan, d.requests));
  d.total = d.off_work + d.plan.workspace_bytes;
  d.image.assign(d.off_work, std::byte{0});
  auto put = [&](size_t off, size_t i, int32_t v) { std::memcpy(d.image.data() + off + i * 4, &v, 4); };
  for (size_t r = 0; r < R; ++r) {
    for (int b = 0; b < d.max_blocks; ++b)
      put(0, r * size_t(d.max_blocks) + size_t(b),
          b < md.max_blocks_per_request ? md.block_table(int(r))[b] : -1);
    put(d.off_seq, r, int32_t(md.seq_lens[r]));
    put(d.off_qlen, r, md.query_lens[r]);
  }
  for (size_t r = 0; r <= R; ++r) put(d.off_qstart, r, int32_t(md.query_start[r]));
  d.walk_key_tile = decode_walk_table(d.plan, heads, d.causal, d.geo.format, d.requests,
                                      reinterpret_cast<const int32_t*>(d.image.data() + d.off_seq),
                                      reinterpret_cast<const int32_t*>(d.image.data() + d.off_qlen),
                                      d.image.data() + d.off_walk);
}

DecodeAttention::~DecodeAttention() = default;
DecodeAttention::DecodeAttention(DecodeAttention&&) noexcept = default;
DecodeAttention& DecodeAttention::operator=(DecodeAttention&&) noexcept = default;

size_t DecodeAttention::workspace_bytes() const { return impl_->total; }

void DecodeAttention::upload(void* workspace, Stream stream) const {
  if (!impl_->image.empty())
    KMLA_CUDA_CHECK(cudaMemcpyAsync(workspace, impl_->image.data(), impl_->image.size(),
                                    cudaMemcpyHostToDevice, reinterpret_cast<cudaStream_t>(stream)));
}

void DecodeAttention::run(const TensorView& q, float q_scale, const LatentCache& cache,
                          double softmax_scale, const TensorView& out, const TensorView& lse,
                          void* workspace, int* error_flag, Stream stream) const {
  const Impl& d = *impl_;
  const DType act = out.dtype;
  KMLA_CHECK(act == DType::bf16 || act == DType::f16, "decode output must be bf16 or f16 on CUDA, got ",
             dtype_name(act));
  const bool q8 = q.dtype == DType::e4m3;
  KMLA_CHECK(q8 || q.dtype == act, "decode query is ", dtype_name(q.dtype), ", expected ", dtype_name(act),
             " or e4m3");
  check_tensor(q, "decode query", q.dtype, {d.rows, d.heads, kLatentDim}, Device::cuda);
  check_tensor(out, "decode output", act, {d.rows, d.heads, kKvLoraRank}, Device::cuda);
  check_tensor(lse, "decode lse", DType::f32, {d.rows, d.heads}, Device::cuda);
  if (q8) KMLA_CHECK(std::isfinite(q_scale) && q_scale > 0, "q_scale must be finite and positive, got ", q_scale);
  KMLA_CHECK(std::isfinite(softmax_scale), "softmax scale must be finite, got ", softmax_scale);
  const CacheGeometry& g = cache.geometry();
  KMLA_CHECK(g.format == d.geo.format && g.block_size == d.geo.block_size && g.num_blocks == d.geo.num_blocks,
             "the cache differs from the one decode attention was planned for");
  if (d.requests == 0) return;
  KMLA_CHECK(workspace, "decode attention needs a workspace of ", d.total, " bytes");
  auto* ws = static_cast<std::byte*>(workspace);
  DecodeParams p;
  p.q = q.data;
  p.q_fp8 = q8;
  p.q_scale = q8 ? q_scale : 1.0f;
  p.cache = cache_ref(cache);
  p.batch.block_tables = reinterpret_cast<const int32_t*>(ws);
  p.batch.seq_lens = reinterpret_cast<const int32_t*>(ws + d.off_seq);
  p.batch.query_lens = reinterpret_cast<const int32_t*>(ws + d.off_qlen);
  p.batch.query_start = reinterpret_cast<const int32_t*>(ws + d.off_qstart);
  p.batch.num_requests = d.requests;
  p.batch.max_blocks = d.max_blocks;
  p.batch.num_rows = d.rows;
  p.heads = d.heads;
  p.causal = d.causal;
  p.softmax_scale = float(softmax_scale);
  p.act = act;
  p.out = out.data;
  p.lse = lse.as<float>();
  p.error_flag = error_flag;
  if (d.walk_key_tile > 0) {
    p.walk_table = ws + d.off_walk;
    p.walk_key_tile = d.walk_key_tile;
  }
  decode_attention(p, d.plan, ws + d.off_work, reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace kmla::cuda
