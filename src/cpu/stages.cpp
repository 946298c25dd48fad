// The public stages (include/kmla/stages.hpp) on host tensors, plus the metadata and slot
// checks the layer shares. Every stage validates all of its inputs before it writes
// anything, then converts to fp32, runs the kernel and converts back at the edge.
#include "kmla/stages.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "cpu/kernels.hpp"
#include "cpu/parallel.hpp"
#include "kmla/error.hpp"

namespace kmla {

namespace cpu {

bool is_float_act(DType t) { return t == DType::bf16 || t == DType::f16 || t == DType::f32; }

void check_host_cache(const LatentCache& cache, const char* what) {
  KMLA_CHECK(cache.device() == Device::cpu, what, " is on ", device_name(cache.device()),
             "; the CPU backend needs a host cache");
  KMLA_CHECK(cache.base() != nullptr, what, " has no memory");
}


// cu must be [0, ..., total], non-decreasing, with num_seqs + 1 entries.
void check_cu(const std::vector<int64_t>& cu, const char* what, int64_t total) {
  KMLA_CHECK(!cu.empty(), what, " is empty; it needs num_sequences + 1 entries");
  KMLA_CHECK(cu.front() == 0, what, "[0] is ", cu.front(), ", expected 0");
  for (size_t i = 1; i < cu.size(); ++i)
    KMLA_CHECK(cu[i] >= cu[i - 1], what, " decreases at entry ", i, ": ", cu[i - 1], " -> ", cu[i]);
  KMLA_CHECK(cu.back() == total, what, " ends at ", cu.back(), " but the tensor has ", total,
             " rows");
}

void validate_metadata(const BatchMetadata& md, const LatentCache& cache) {
  check_host_cache(cache, "the latent cache");
  validate_batch(md, cache.geometry());
}

void validate_slots(const int64_t* slots, int64_t n, const LatentCache& cache) {
  const int64_t num_slots = cache.geometry().num_slots();
  for (int64_t t = 0; t < n; ++t)
    KMLA_CHECK(slots[t] < num_slots, "slot ", slots[t], " of token ", t,
               " is outside the cache's slots [0, ", num_slots, ")");
}

void write_cache_rows(const float* kv, int64_t kv_stride, const float* k_pe, int64_t pe_stride,
                      const int64_t* slots, int64_t n, const LatentCache& cache, int threads) {
  // Tokens are independent unless two of them share a slot; then the later one must win, as
  // it does in order, so such a batch is written serially.
  std::vector<int64_t> used;
  used.reserve(size_t(n));
  for (int64_t t = 0; t < n; ++t)
    if (slots[t] >= 0) used.push_back(slots[t]);
  std::sort(used.begin(), used.end());
  const bool distinct = std::adjacent_find(used.begin(), used.end()) == used.end();
  // Encoding a row is cheap: split into runs of tokens so each task does real work.
  constexpr int64_t kTokensPerTask = 64;
  const int64_t tasks = (n + kTokensPerTask - 1) / kTokensPerTask;
  parallel_for(tasks, distinct ? threads : 1, [&](int64_t task, int) {
    float row[kLatentDim];
    for (int64_t t = task * kTokensPerTask; t < std::min(n, (task + 1) * kTokensPerTask); ++t) {
      if (slots[t] < 0) continue;
      std::memcpy(row, kv + t * kv_stride, kKvLoraRank * sizeof(float));
      std::memcpy(row + kKvLoraRank, k_pe + t * pe_stride, kRopeDim * sizeof(float));
      cache.write_row(slots[t], row);
    }
  });
}

}  // namespace cpu

// ---- public stages ----------------------------------------------------------------------

namespace {

using cpu::is_float_act;

// Loads k_pe [n rows at `stride`] and applies RoPE as the cache wants it: rotated in fp32,
// rounded to the input dtype except on the plain fp8 cache (quantized from fp32 directly).
void rotate_for_cache(float* k_pe, int64_t n, int64_t stride, const int64_t* positions,
                      const RopeTable* rope, CacheFormat format, DType input) {
  if (rope == nullptr) return;
  for (int64_t t = 0; t < n; ++t) {
    float* x = k_pe + t * stride;
    rope->rotate(x, positions[t]);
    if (format != CacheFormat::fp8) cpu::round_to(x, kRopeDim, input);
  }
}

void check_positions(const TensorView& positions, int64_t n, const RopeTable& rope) {
  check_tensor(positions, "positions", DType::i64, {n});
  const auto* pos = positions.as<const int64_t>();
  for (int64_t t = 0; t < n; ++t)
    KMLA_CHECK(pos[t] >= 0 && pos[t] < rope.rows(), "position ", pos[t], " of token ", t,
               " is outside the RoPE table's ", rope.rows(), " rows");
}

}  // namespace

void cache_insert(const TensorView& kv_c_normed, const TensorView& k_pe,
                  const TensorView& positions, const RopeTable* rope,
                  const TensorView& slot_mapping, LatentCache& cache) {
  const DType dt = kv_c_normed.dtype;
  KMLA_CHECK(is_float_act(dt), "kv_c_normed must be bf16, f16 or f32, got ", dtype_name(dt));
  check_tensor(kv_c_normed, "kv_c_normed", dt, {-1, kKvLoraRank});
  const int64_t T = kv_c_normed.dim(0);
  check_tensor(k_pe, "k_pe", dt, {T, kRopeDim});
  check_tensor(slot_mapping, "slot_mapping", DType::i64, {T});
  if (rope) check_positions(positions, T, *rope);
  cpu::check_host_cache(cache, "the latent cache");
  const auto* slots = slot_mapping.as<const int64_t>();
  cpu::validate_slots(slots, T, cache);

  std::vector<float> kv(size_t(T) * kKvLoraRank), pe(size_t(T) * kRopeDim);
  cpu::load_f32(kv_c_normed.data, dt, T * kKvLoraRank, kv.data());
  cpu::load_f32(k_pe.data, dt, T * kRopeDim, pe.data());
  rotate_for_cache(pe.data(), T, kRopeDim, rope ? positions.as<const int64_t>() : nullptr, rope,
                   cache.format(), dt);
  cpu::write_cache_rows(kv.data(), kKvLoraRank, pe.data(), kRopeDim, slots, T, cache,
                        cpu::resolve_threads(0));
}

void cache_insert_layers(const TensorView& kv_c_normed, const TensorView& k_pe,
                         const TensorView& positions, const RopeTable* rope,
                         const TensorView& slot_mapping, const std::vector<LatentCache*>& caches) {
  const DType dt = kv_c_normed.dtype;
  KMLA_CHECK(is_float_act(dt), "kv_c_normed must be bf16, f16 or f32, got ", dtype_name(dt));
  const int64_t L = int64_t(caches.size());
  KMLA_CHECK(L >= 1, "cache_insert_layers needs at least one cache");
  check_tensor(kv_c_normed, "kv_c_normed", dt, {-1, L, kKvLoraRank});
  const int64_t T = kv_c_normed.dim(0);
  check_tensor(k_pe, "k_pe", dt, {T, L, kRopeDim});
  check_tensor(slot_mapping, "slot_mapping", DType::i64, {T});
  if (rope) check_positions(positions, T, *rope);
  const auto* slots = slot_mapping.as<const int64_t>();
  for (int64_t l = 0; l < L; ++l) {
    KMLA_CHECK(caches[size_t(l)] != nullptr, "cache of layer ", l, " is null");
    cpu::check_host_cache(*caches[size_t(l)], "a layer's latent cache");
    KMLA_CHECK(caches[size_t(l)]->block_size() == caches[0]->block_size(), "cache of layer ", l,
               " has block size ", caches[size_t(l)]->block_size(), ", layer 0 has ",
               caches[0]->block_size());
    cpu::validate_slots(slots, T, *caches[size_t(l)]);
  }

  std::vector<float> kv(size_t(T * L) * kKvLoraRank), pe(size_t(T * L) * kRopeDim), pe_l;
  cpu::load_f32(kv_c_normed.data, dt, T * L * kKvLoraRank, kv.data());
  cpu::load_f32(k_pe.data, dt, T * L * kRopeDim, pe.data());
  const int threads = cpu::resolve_threads(0);
  for (int64_t l = 0; l < L; ++l) {
    LatentCache& cache = *caches[size_t(l)];
    pe_l.assign(pe.begin(), pe.end());  // each layer's format decides its own rounding
    rotate_for_cache(pe_l.data() + l * kRopeDim, T, L * kRopeDim,
                     rope ? positions.as<const int64_t>() : nullptr, rope, cache.format(), dt);
    cpu::write_cache_rows(kv.data() + l * kKvLoraRank, L * kKvLoraRank, pe_l.data() + l * kRopeDim,
                          L * kRopeDim, slots, T, cache, threads);
  }
}

void decode_attention(const TensorView& q, float q_scale, const LatentCache& cache,
                      const BatchMetadata& md, double softmax_scale, const TensorView& out,
                      const TensorView& lse) {
  cpu::validate_metadata(md, cache);
  const int64_t Td = md.num_decode_tokens;
  KMLA_CHECK(is_float_act(q.dtype) || q.dtype == DType::e4m3,
             "decode query must be bf16, f16, f32 or e4m3, got ", dtype_name(q.dtype));
  check_tensor(q, "decode query", q.dtype, {Td, -1, kLatentDim});
  const int64_t H = q.dim(1);
  KMLA_CHECK(H >= 1, "decode query has no heads");
  if (q.dtype == DType::e4m3)
    KMLA_CHECK(std::isfinite(q_scale) && q_scale > 0, "q_scale must be finite and positive, got ",
               q_scale);
  KMLA_CHECK(is_float_act(out.dtype), "decode output must be bf16, f16 or f32, got ",
             dtype_name(out.dtype));
  check_tensor(out, "decode output", out.dtype, {Td, H, kKvLoraRank});
  check_tensor(lse, "decode lse", DType::f32, {Td, H});
  KMLA_CHECK(std::isfinite(softmax_scale), "softmax scale must be finite, got ", softmax_scale);

  std::vector<float> qf(size_t(Td * H) * kLatentDim), of(size_t(Td * H) * kKvLoraRank);
  cpu::load_f32(q.data, q.dtype, Td * H * kLatentDim, qf.data(), q_scale);
  cpu::decode_attention_f32(qf.data(), int(H), cache, md, float(softmax_scale), of.data(),
                            lse.as<float>(), cpu::resolve_threads(0));
  cpu::store_f32(of.data(), Td * H * kKvLoraRank, out.dtype, out.data);
}

void prefill_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                       const std::vector<int64_t>& cu_q, const std::vector<int64_t>& cu_k,
                       bool causal, double softmax_scale, const TensorView& out,
                       const TensorView& lse) {
  const DType dt = q.dtype;
  KMLA_CHECK(is_float_act(dt) || dt == DType::e4m3,
             "prefill q must be bf16, f16, f32 or e4m3, got ", dtype_name(dt));
  check_tensor(q, "prefill q", dt, {-1, -1, kQkHeadDim});
  const int64_t Tq = q.dim(0), H = q.dim(1);
  KMLA_CHECK(H >= 1, "prefill q has no heads");
  check_tensor(k, "prefill k", dt, {-1, H, kQkHeadDim});
  const int64_t Tk = k.dim(0);
  check_tensor(v, "prefill v", dt, {Tk, H, kVDim});
  KMLA_CHECK(is_float_act(out.dtype), "prefill output must be bf16, f16 or f32, got ",
             dtype_name(out.dtype));
  check_tensor(out, "prefill output", out.dtype, {Tq, H, kVDim});
  check_tensor(lse, "prefill lse", DType::f32, {Tq, H});
  cpu::check_cu(cu_q, "cu_q", Tq);
  cpu::check_cu(cu_k, "cu_k", Tk);
  KMLA_CHECK(cu_q.size() == cu_k.size(), "cu_q has ", cu_q.size(), " entries, cu_k has ",
             cu_k.size(), "; both need num_sequences + 1");
  KMLA_CHECK(std::isfinite(softmax_scale), "softmax scale must be finite, got ", softmax_scale);

  std::vector<float> qf(size_t(q.numel())), kf(size_t(k.numel())), vf(size_t(v.numel()));
  std::vector<float> of(size_t(out.numel()));
  cpu::load_f32(q.data, dt, q.numel(), qf.data());
  cpu::load_f32(k.data, dt, k.numel(), kf.data());
  cpu::load_f32(v.data, dt, v.numel(), vf.data());
  cpu::PrefillProblem p;
  p.q = {qf.data(), H * kQkHeadDim, kQkHeadDim};
  p.k = {kf.data(), H * kQkHeadDim, kQkHeadDim};
  p.v = {vf.data(), H * kVDim, kVDim};
  p.out = of.data();
  p.out_row_stride = H * kVDim;
  p.out_head_stride = kVDim;
  p.lse = lse.as<float>();
  p.lse_row_stride = H;
  p.heads = int(H);
  p.cu_q = &cu_q;
  p.cu_k = &cu_k;
  p.causal = causal;
  p.scale = float(softmax_scale);
  cpu::prefill_attention_f32(p, cpu::resolve_threads(0));
  cpu::store_f32(of.data(), out.numel(), out.dtype, out.data);
}

void merge_attn_states(const TensorView& prefix_out, const TensorView& prefix_lse,
                       const TensorView& suffix_out, const TensorView& suffix_lse,
                       int64_t rows_with_prefix, const TensorView& out, const TensorView& out_lse) {
  const DType dt = suffix_out.dtype;
  KMLA_CHECK(is_float_act(dt), "merge inputs must be bf16, f16 or f32, got ", dtype_name(dt));
  check_tensor(suffix_out, "suffix output", dt, {-1, -1, -1});
  const int64_t T = suffix_out.dim(0), H = suffix_out.dim(1), D = suffix_out.dim(2);
  check_tensor(suffix_lse, "suffix lse", DType::f32, {T, H});
  check_tensor(out, "merged output", dt, {T, H, D});
  if (out_lse.data != nullptr) check_tensor(out_lse, "merged lse", DType::f32, {T, H});
  KMLA_CHECK(rows_with_prefix >= 0 && rows_with_prefix <= T, "rows_with_prefix ", rows_with_prefix,
             " is outside [0, ", T, "]");
  // The prefix only needs its first rows_with_prefix rows.
  check_tensor(prefix_out, "prefix output", dt, {-1, H, D});
  const int64_t P = prefix_out.dim(0);
  KMLA_CHECK(P >= rows_with_prefix, "prefix output has ", P, " rows, rows_with_prefix is ",
             rows_with_prefix);
  check_tensor(prefix_lse, "prefix lse", DType::f32, {P, H});

  const int64_t n = T * H * D, np = rows_with_prefix * H * D;
  std::vector<float> pf(static_cast<size_t>(np)), sf(static_cast<size_t>(n)),
      of(static_cast<size_t>(n));
  std::vector<float> plse(prefix_lse.as<const float>(),
                          prefix_lse.as<const float>() + rows_with_prefix * H);
  std::vector<float> olse(size_t(T * H));
  cpu::load_f32(prefix_out.data, dt, np, pf.data());
  cpu::load_f32(suffix_out.data, dt, n, sf.data());
  cpu::merge_attn_f32(pf.data(), plse.data(), sf.data(), suffix_lse.as<const float>(), T,
                      rows_with_prefix, int(H), int(D), of.data(), olse.data(), DType::f32);
  cpu::store_f32(of.data(), n, dt, out.data);
  if (out_lse.data != nullptr) std::memcpy(out_lse.data, olse.data(), olse.size() * sizeof(float));
}

}  // namespace kmla
