// MlaLayer on the CPU: the production algorithm (fused front end, absorbed decode over the
// latent cache, MHA prefill with chunked context and LSE merge, gate, o_proj) in fp32 with
// OpenBLAS GEMMs, rounding to the activation dtype exactly where docs/SEMANTICS.md says.
//
// Buffers: every intermediate is a per-call std::vector<float> holding values already
// rounded to act where the semantics round; nothing is cached between calls, so forward()
// is const and may run concurrently on one layer.
//
// fp8 block-quantized projections (MlaWeights::fp8) run as W8A8: their fp32 weight is
// dequantized once here (float(code) * scale), and each GEMM input row is quantized per 128
// inputs (quantize_activation_fp8) right before the sgemm. The absorbed decode weights come
// from the 16-bit kv_b_proj, which for an fp8 kv_b is its bf16 dequantized copy: decode runs
// them without activation quantization, while the prefill kv_b GEMMs are W8A8.
#include "kmla/layer.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "cpu/kernels.hpp"
#include "cpu/parallel.hpp"
#include "kmla/error.hpp"
#include "kmla/numeric.hpp"

namespace kmla {

namespace {

// Prefill keys and values of one head group are materialised per call: kv_b output (256)
// plus the assembled key (192) per token and head. Heads are processed in groups so that
// this stays under ~256 MB however long the prefill or context chunk is.
constexpr int64_t kPrefillKvBudgetFloats = int64_t(1) << 26;

// Rows per task of the elementwise loops (each row is hundreds to thousands of values).
constexpr int64_t kRowGrain = 16;

int head_group(int64_t tokens, int heads) {
  const int64_t per_head = std::max<int64_t>(1, tokens) * (kKvBOut + kQkHeadDim);
  return int(std::clamp<int64_t>(kPrefillKvBudgetFloats / per_head, 1, heads));
}

// The fp32 weight of projection `name`: float(code) * scale when it is fp8, else the 16-bit
// tensor's values.
std::vector<float> projection_f32(const MlaWeights& w, const char* name, const HostTensor& t) {
  const auto it = w.fp8.find(name);
  return it == w.fp8.end() ? cpu::weight_f32(t) : cpu::fp8_weight_f32(it->second);
}

// RMSNorm in fp32: x * (1 / sqrt(mean(x^2) + eps)) * w, one rounding to act.
void rms_norm_rows(float* x, int64_t rows, int64_t stride, int64_t n, const float* w, float eps,
                   DType act) {
  for (int64_t t = 0; t < rows; ++t) {
    float* r = x + t * stride;
    float ss = 0.0f;
    for (int64_t i = 0; i < n; ++i) ss += r[i] * r[i];
    const float inv = 1.0f / std::sqrt(ss / float(n) + eps);
    for (int64_t i = 0; i < n; ++i) r[i] = cpu::round_value(r[i] * inv * w[i], act);
  }
}

}  // namespace

struct MlaLayer::Impl {
  MlaConfig cfg;
  MlaWeights weights;
  LayerOptions options;
  std::shared_ptr<const RopeTable> rope;
  int heads = 0;
  int threads = 1;
  int64_t q_width = 0;      // H * 192
  int64_t attn_width = 0;   // H * 128
  int64_t kv_offset = 0;    // column of kv_c in the front-end output
  int64_t front_width = 0;  // columns of the front-end output

  // fp32 copies of the weights (bf16/f16 values are exact in fp32), [out, in] unless noted.
  std::vector<float> w_front;  // q-LoRA: [q_a_proj; kv_a_proj_with_mqa]; else [q_proj; kv_a]
  std::vector<float> w_q_b;    // [H*192, q_lora] (q-LoRA only)
  std::vector<float> q_norm;   // [q_lora]
  std::vector<float> kv_norm;  // [512]
  std::vector<float> w_kv_b;   // [H*256, 512]
  std::vector<float> w_uk_t;   // [H, 128, 512]
  std::vector<float> w_uv;     // [H, 512, 128]
  std::vector<float> w_g;      // [H*128, hidden] (gate only)
  std::vector<float> w_o;      // [hidden, H*128]
  // Which projections are W8A8 (fp8 block weights: the input rows are quantized).
  bool fp8_q_first = false;  // q_a_proj or q_proj (the first part of w_front)
  bool fp8_kv_a = false, fp8_q_b = false, fp8_kv_b = false, fp8_g = false, fp8_o = false;

  Impl(const MlaConfig& c, MlaWeights w, LayerOptions o, std::shared_ptr<const RopeTable> r);
  void forward(const TensorView& positions, const TensorView& hidden, const BatchMetadata* md,
               LatentCache& cache, const TensorView& out) const;
  void validate_call(const TensorView& positions, int64_t rows, const BatchMetadata& md,
                     const LatentCache& cache) const;
  // Prefill attention of `nq` query rows (qp: [*, H, 192] from row 0) against keys built
  // from latents (kv_c rows at `latent`, stride `latent_stride`) and rope keys (`k_rope`,
  // stride `rope_stride`), per head group. out/lse: [*, H*128] / [*, H] fp32, rounded to act.
  void prefill_heads(const float* qp, int64_t num_keys, const float* latent, int64_t latent_stride,
                     const float* k_rope, int64_t rope_stride, const std::vector<int64_t>& cu_q,
                     const std::vector<int64_t>& cu_k, bool causal, int64_t nq, float* out,
                     float* lse) const;
};

MlaLayer::Impl::Impl(const MlaConfig& c, MlaWeights w, LayerOptions o,
                     std::shared_ptr<const RopeTable> r)
    : cfg(c), weights(std::move(w)), options(std::move(o)), rope(std::move(r)) {
  const DType act = options.activation;
  KMLA_CHECK(act == DType::bf16 || act == DType::f16,
             "the activation dtype must be bf16 or f16, got ", dtype_name(act));
  weights.validate(cfg);
  KMLA_CHECK(weights.dtype() == act, "weights are ", dtype_name(weights.dtype()),
             " but the activation dtype is ", dtype_name(act));
  KMLA_CHECK(options.num_threads >= 0, "num_threads must be >= 0 (0 = all hardware threads), got ",
             options.num_threads);
  KMLA_CHECK(cfg.tp_size == 1 || options.partial_output || options.all_reduce,
             "tensor-parallel world size ", cfg.tp_size,
             " needs LayerOptions::partial_output or an all_reduce callback");
  if (cfg.use_rope) {
    if (!rope) rope = RopeTable::build(cfg);
    KMLA_CHECK(rope->type() == cfg.rope.type, "RoPE table is of type ",
               rope_type_name(rope->type()), ", config '", cfg.name, "' uses ",
               rope_type_name(cfg.rope.type));
  } else {
    KMLA_CHECK(!rope, "a RoPE table was given but config '", cfg.name, "' has use_rope = false");
  }

  heads = cfg.local_heads();
  threads = cpu::resolve_threads(options.num_threads);
  q_width = int64_t(heads) * kQkHeadDim;
  attn_width = int64_t(heads) * kVDim;
  const char* q_first_name = cfg.q_lora_rank ? "q_a_proj" : "q_proj";
  const HostTensor& q_first = cfg.q_lora_rank ? weights.q_a_proj : weights.q_proj;
  auto is_fp8 = [&](const char* name) { return weights.fp8.count(name) != 0; };
  fp8_q_first = is_fp8(q_first_name);
  fp8_kv_a = is_fp8("kv_a_proj_with_mqa");
  fp8_q_b = is_fp8("q_b_proj");
  fp8_kv_b = is_fp8("kv_b_proj");
  fp8_g = is_fp8("g_proj");
  fp8_o = is_fp8("o_proj");
  kv_offset = q_first.dim(0);
  front_width = kv_offset + kLatentDim;
  w_front = projection_f32(weights, q_first_name, q_first);
  const std::vector<float> kv_a = projection_f32(weights, "kv_a_proj_with_mqa", weights.kv_a_proj_with_mqa);
  w_front.insert(w_front.end(), kv_a.begin(), kv_a.end());
  if (cfg.q_lora_rank) {
    w_q_b = projection_f32(weights, "q_b_proj", weights.q_b_proj);
    q_norm = cpu::weight_f32(weights.q_a_layernorm);
  }
  kv_norm = cpu::weight_f32(weights.kv_a_layernorm);
  w_kv_b = projection_f32(weights, "kv_b_proj", weights.kv_b_proj);
  const AbsorbedWeights absorbed = absorb_kv_b(weights.kv_b_proj, heads);  // 16-bit (copy)
  w_uk_t = cpu::weight_f32(absorbed.w_uk_t);
  w_uv = cpu::weight_f32(absorbed.w_uv);
  if (cfg.use_output_gate) w_g = projection_f32(weights, "g_proj", weights.g_proj);
  w_o = projection_f32(weights, "o_proj", weights.o_proj);
}

void MlaLayer::Impl::validate_call(const TensorView& positions, int64_t rows,
                                   const BatchMetadata& md, const LatentCache& cache) const {
  check_tensor(positions, "positions", DType::i64, {rows});
  KMLA_CHECK(md.num_rows == rows, "metadata has ", md.num_rows, " rows, hidden_states has ", rows);
  cpu::validate_metadata(md, cache);
  cpu::validate_slots(md.slot_mapping.data(), md.num_tokens, cache);
  KMLA_CHECK(cache.format() != CacheFormat::fp8 || cache.k_scale() == weights.k_scale, "the fp8 cache's k_scale ",
             cache.k_scale(), " differs from the layer's k_scale ", weights.k_scale,
             " (set both from the checkpoint's k_scale)");
  if (!md.causal_decode)
    KMLA_CHECK(cfg.non_causal_multi_token_decode,
               "metadata asks for non-causal multi-token decode "
               "but config '",
               cfg.name, "' does not set non_causal_multi_token_decode");
  if (cfg.non_causal_multi_token_decode)
    KMLA_CHECK(!md.causal_decode, "config '", cfg.name,
               "' sets non_causal_multi_token_decode but "
               "the metadata was planned causal (plan it with BatchOptions::non_causal_decode)");
  if (cfg.use_rope) {
    const auto* pos = positions.as<const int64_t>();
    for (int64_t t = 0; t < md.num_tokens; ++t)
      KMLA_CHECK(pos[t] >= 0 && pos[t] < rope->rows(), "position ", pos[t], " of row ", t,
                 " is outside the RoPE table's ", rope->rows(), " rows");
  }
}

void MlaLayer::Impl::prefill_heads(const float* qp, int64_t num_keys, const float* latent,
                                   int64_t latent_stride, const float* k_rope, int64_t rope_stride,
                                   const std::vector<int64_t>& cu_q,
                                   const std::vector<int64_t>& cu_k, bool causal, int64_t nq,
                                   float* out, float* lse) const {
  const DType act = options.activation;
  const bool fp8 = options.fp8_prefill;
  const int64_t Tk = num_keys;
  cpu::Scratch latent8;  // W8A8 kv_b: the latents quantized per 128
  if (fp8_kv_b) {
    latent8 = cpu::Scratch(Tk * kKvLoraRank);
    cpu::quantize_rows_fp8(latent, Tk, latent_stride, kKvLoraRank, latent8.data(), threads);
    latent = latent8.data();
    latent_stride = kKvLoraRank;
  }
  const int group = head_group(Tk, heads);
  const cpu::Scratch kv(Tk * group * kKvBOut), k(Tk * group * kQkHeadDim);
  for (int h0 = 0; h0 < heads; h0 += group) {
    const int hg = std::min(group, heads - h0);
    const int64_t kv_width = int64_t(hg) * kKvBOut, k_width = int64_t(hg) * kQkHeadDim;
    // kv = latent @ kv_b^T for this head group: per head [k_nope 128 | v 128], rounded.
    cpu::gemm_nt(Tk, kv_width, kKvLoraRank, latent, latent_stride,
                 w_kv_b.data() + int64_t(h0) * kKvBOut * kKvLoraRank, kKvLoraRank, kv.data(),
                 kv_width, 1.0f, 0.0f, threads);
    // k = [k_nope | k_pe shared by all heads]; the fp8 mode casts q, k and v unscaled.
    cpu::parallel_ranges(Tk, kRowGrain, threads, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        float* kv_row = kv.data() + t * kv_width;
        cpu::round_to(kv_row, kv_width, act);
        if (fp8) cpu::e4m3_roundtrip(kv_row, kv_width);
        for (int h = 0; h < hg; ++h) {
          float* dst = k.data() + t * k_width + int64_t(h) * kQkHeadDim;
          std::memcpy(dst, kv_row + int64_t(h) * kKvBOut, kNopeDim * sizeof(float));
          std::memcpy(dst + kNopeDim, k_rope + t * rope_stride, kRopeDim * sizeof(float));
          if (fp8) cpu::e4m3_roundtrip(dst + kNopeDim, kRopeDim);
        }
      }
    });
    cpu::PrefillProblem p;
    p.q = {qp + int64_t(h0) * kQkHeadDim, q_width, kQkHeadDim};
    p.k = {k.data(), k_width, kQkHeadDim};
    p.v = {kv.data() + kNopeDim, kv_width, kKvBOut};
    p.out = out + int64_t(h0) * kVDim;
    p.out_row_stride = attn_width;
    p.out_head_stride = kVDim;
    p.lse = lse + h0;
    p.lse_row_stride = heads;
    p.heads = hg;
    p.cu_q = &cu_q;
    p.cu_k = &cu_k;
    p.causal = causal;
    p.scale = float(cfg.softmax_scale());
    cpu::prefill_attention_f32(p, threads);
  }
  cpu::parallel_ranges(nq, kRowGrain, threads, [&](int64_t t0, int64_t t1) {
    cpu::round_to(out + t0 * attn_width, (t1 - t0) * attn_width, act);
  });
}

void MlaLayer::Impl::forward(const TensorView& positions, const TensorView& hidden,
                             const BatchMetadata* md, LatentCache& cache,
                             const TensorView& out) const {
  const DType act = options.activation;
  const int64_t hs = cfg.hidden_size;
  check_tensor(hidden, "hidden_states", act, {-1, hs});
  const int64_t rows = hidden.dim(0);
  check_tensor(out, "out", act, {rows, hs});
  const bool reduce = cfg.tp_size > 1 && !options.partial_output;
  if (md == nullptr) {  // memory-profiling run: zeros, no cache access
    if (out.numel() > 0) std::memset(out.data, 0, out.bytes());
    if (reduce) options.all_reduce(out);
    return;
  }
  validate_call(positions, rows, *md, cache);
  // ---- nothing below throws on bad input; the cache is written in step 3 -------------

  const int H = heads;
  const int64_t T = md->num_tokens;
  const int64_t Td = md->num_decode_tokens;
  const int64_t Tp = T - Td;
  const bool plain_fp8 = cache.format() == CacheFormat::fp8;
  const auto* pos = positions.as<const int64_t>();
  const size_t act_size = dtype_size(act);
  // Elementwise work runs over ranges of rows on all threads.
  auto rows_parallel = [&](int64_t n, auto&& fn) {
    cpu::parallel_ranges(n, kRowGrain, threads, fn);
  };

  // ---- 1. front end ----------------------------------------------------------------
  const cpu::Scratch x(T * hs);  // hidden states as fp32
  rows_parallel(T, [&](int64_t t0, int64_t t1) {
    cpu::load_f32(static_cast<const std::byte*>(hidden.data) + t0 * hs * act_size, act,
                  (t1 - t0) * hs, x.data() + t0 * hs);
  });
  cpu::Scratch x8;  // the hidden states quantized per 128, for W8A8 projections of hidden
  if (fp8_q_first || fp8_kv_a || fp8_g) {
    x8 = cpu::Scratch(T * hs);
    cpu::quantize_rows_fp8(x.data(), T, hs, hs, x8.data(), threads);
  }
  const cpu::Scratch front(T * front_width);  // [q_c or q | kv_c | k_pe]
  {
    // One GEMM when both parts take the same input; a mixed front end is two.
    const float* q_in = fp8_q_first ? x8.data() : x.data();
    const float* kv_in = fp8_kv_a ? x8.data() : x.data();
    if (q_in == kv_in) {
      cpu::gemm_nt(T, front_width, hs, q_in, hs, w_front.data(), hs, front.data(), front_width,
                   1.0f, 0.0f, threads);
    } else {
      cpu::gemm_nt(T, kv_offset, hs, q_in, hs, w_front.data(), hs, front.data(), front_width, 1.0f,
                   0.0f, threads);
      cpu::gemm_nt(T, kLatentDim, hs, kv_in, hs, w_front.data() + kv_offset * hs, hs,
                   front.data() + kv_offset, front_width, 1.0f, 0.0f, threads);
    }
  }
  const float eps = float(cfg.rms_norm_eps);
  float* kv_c = front.data() + kv_offset;  // [T, 512] at stride front_width, normed below
  float* k_pe = kv_c + kKvLoraRank;        // [T, 64] at stride front_width, un-rotated
  rows_parallel(T, [&](int64_t t0, int64_t t1) {
    cpu::round_to(front.data() + t0 * front_width, (t1 - t0) * front_width, act);
    rms_norm_rows(kv_c + t0 * front_width, t1 - t0, front_width, kKvLoraRank, kv_norm.data(), eps,
                  act);
    if (cfg.q_lora_rank)
      rms_norm_rows(front.data() + t0 * front_width, t1 - t0, front_width, *cfg.q_lora_rank,
                    q_norm.data(), eps, act);
  });
  cpu::Scratch q_lora_out;
  float* q = front.data();  // [T, H*192] at stride q_stride
  int64_t q_stride = front_width;
  if (cfg.q_lora_rank) {
    const int64_t ql = *cfg.q_lora_rank;
    q_lora_out = cpu::Scratch(T * q_width);
    const float* q_c = front.data();
    int64_t q_c_stride = front_width;
    cpu::Scratch q_c8;
    if (fp8_q_b) {
      q_c8 = cpu::Scratch(T * ql);
      cpu::quantize_rows_fp8(q_c, T, q_c_stride, ql, q_c8.data(), threads);
      q_c = q_c8.data();
      q_c_stride = ql;
    }
    cpu::gemm_nt(T, q_width, ql, q_c, q_c_stride, w_q_b.data(), ql, q_lora_out.data(), q_width,
                 1.0f, 0.0f, threads);
    rows_parallel(T, [&](int64_t t0, int64_t t1) {
      cpu::round_to(q_lora_out.data() + t0 * q_width, (t1 - t0) * q_width, act);
    });
    q = q_lora_out.data();
    q_stride = q_width;
  }

  // ---- 2. RoPE: fp32 rotation of the act values ------------------------------------
  // k_rope_act: what prefill attention uses; k_rope_cache: what the cache writer encodes
  // (unrounded on the plain fp8 cache). q's rope part is rounded in place; the decode
  // rows keep the unrounded rotation for the plain fp8 query.
  const bool keep_fp32_rope = cfg.use_rope && plain_fp8;
  std::vector<float> k_rope_act(size_t(T) * kRopeDim);
  std::vector<float> k_rope_cache(keep_fp32_rope ? size_t(T) * kRopeDim : 0);
  std::vector<float> q_rope_fp32(keep_fp32_rope ? size_t(Td) * H * kRopeDim : 0);  // [Td, H, 64]
  rows_parallel(T, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* kr = k_rope_act.data() + t * kRopeDim;
      std::memcpy(kr, k_pe + t * front_width, kRopeDim * sizeof(float));
      if (!cfg.use_rope) continue;
      for (int h = 0; h < H; ++h) {
        float* qr = q + t * q_stride + int64_t(h) * kQkHeadDim + kNopeDim;
        rope->rotate(qr, pos[t]);
        if (keep_fp32_rope && t < Td)
          std::memcpy(q_rope_fp32.data() + (t * H + h) * kRopeDim, qr, kRopeDim * sizeof(float));
        cpu::round_to(qr, kRopeDim, act);
      }
      rope->rotate(kr, pos[t]);
      if (keep_fp32_rope)
        std::memcpy(k_rope_cache.data() + t * kRopeDim, kr, kRopeDim * sizeof(float));
      cpu::round_to(kr, kRopeDim, act);
    }
  });
  const float* k_rope_for_cache = keep_fp32_rope ? k_rope_cache.data() : k_rope_act.data();

  // ---- 3. cache write: real rows with a slot ----------------------------------------
  cpu::write_cache_rows(kv_c, front_width, k_rope_for_cache, kRopeDim, md->slot_mapping.data(), T,
                        cache, threads);

  // Every row of attn is written: decode rows by W_UV, prefill rows by attention.
  const cpu::Scratch attn(T * attn_width);  // [T, H*128]
  const float scale = float(cfg.softmax_scale());

  // ---- 4. decode rows: absorbed MQA over the cache -----------------------------------
  if (Td > 0) {
    const cpu::Scratch mqa(Td * H * kLatentDim);         // [Td, H, 576] = [ql_nope | rope(q_pe)]
    cpu::parallel_for(H, threads, [&](int64_t h, int) {  // ql_nope = q_nope @ W_UK_T[h]
      cpu::gemm_nn(Td, kKvLoraRank, kNopeDim, q + h * kQkHeadDim, q_stride,
                   w_uk_t.data() + h * kNopeDim * kKvLoraRank, kKvLoraRank,
                   mqa.data() + h * kLatentDim, int64_t(H) * kLatentDim);
    });
    const float q_scale = weights.q_scale, q_scale_inv = 1.0f / weights.q_scale;
    rows_parallel(Td, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int h = 0; h < H; ++h) {
          float* row = mqa.data() + (t * H + h) * kLatentDim;
          cpu::round_to(row, kKvLoraRank, act);
          const float* rope_src = keep_fp32_rope
                                      ? q_rope_fp32.data() + (t * H + h) * kRopeDim
                                      : q + t * q_stride + int64_t(h) * kQkHeadDim + kNopeDim;
          std::memcpy(row + kKvLoraRank, rope_src, kRopeDim * sizeof(float));
          if (plain_fp8)  // the fp8 query: e4m3(clamp(x / q_scale)), read back times q_scale
            for (int i = 0; i < kLatentDim; ++i)
              row[i] = e4m3_to_float(e4m3_scaled_clamped(row[i], q_scale_inv)) * q_scale;
        }
    });
    const cpu::Scratch latent(Td * H * kKvLoraRank);
    std::vector<float> lse(size_t(Td) * H);
    cpu::decode_attention_f32(mqa.data(), H, cache, *md, scale, latent.data(), lse.data(), threads);
    rows_parallel(Td, [&](int64_t t0, int64_t t1) {
      cpu::round_to(latent.data() + t0 * H * kKvLoraRank, (t1 - t0) * H * kKvLoraRank, act);
    });
    cpu::parallel_for(H, threads, [&](int64_t h, int) {  // out = latent @ W_UV[h]
      cpu::gemm_nn(Td, kVDim, kKvLoraRank, latent.data() + h * kKvLoraRank,
                   int64_t(H) * kKvLoraRank, w_uv.data() + h * kKvLoraRank * kVDim, kVDim,
                   attn.data() + h * kVDim, attn_width);
    });
    rows_parallel(Td, [&](int64_t t0, int64_t t1) {
      cpu::round_to(attn.data() + t0 * attn_width, (t1 - t0) * attn_width, act);
    });
  }

  // ---- 5. prefill rows: MHA over new tokens, then the cached context ------------------
  if (Tp > 0) {
    const int nd = md->num_decodes, R = md->num_requests;
    const cpu::Scratch qp(Tp * q_width);  // [Tp, H, 192]
    rows_parallel(Tp, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        std::memcpy(qp.data() + t * q_width, q + (Td + t) * q_stride,
                    size_t(q_width) * sizeof(float));
        if (options.fp8_prefill) cpu::e4m3_roundtrip(qp.data() + t * q_width, q_width);
      }
    });

    // New tokens, causal within each request: the suffix of the final merge.
    std::vector<int64_t> cu_new(size_t(R - nd) + 1);
    for (int r = nd; r <= R; ++r) cu_new[size_t(r - nd)] = md->query_start[size_t(r)] - Td;
    float* new_out = attn.data() + Td * attn_width;
    std::vector<float> new_lse(size_t(Tp) * H);
    prefill_heads(qp.data(), Tp, kv_c + Td * front_width, front_width,
                  k_rope_act.data() + Td * kRopeDim, kRopeDim, cu_new, cu_new, true, Tp, new_out,
                  new_lse.data());

    // Cached context, chunk by chunk, merged left to right into the prefix.
    const int nc = md->num_context_prefills;
    const int64_t Tc = md->prefill_tokens_with_context;
    if (nc > 0 && Tc > 0) {
      std::vector<int64_t> cu_ctx(size_t(nc) + 1);
      for (int j = 0; j <= nc; ++j) cu_ctx[size_t(j)] = md->query_start[size_t(nd + j)] - Td;
      std::vector<float> ctx_out(size_t(Tc * attn_width)), ctx_lse(size_t(Tc) * H);
      std::vector<float> chunk_out(size_t(Tc * attn_width)), chunk_lse(size_t(Tc) * H);
      std::vector<float> gathered;
      bool have_prefix = false;
      const RowCodec codec = cache.codec();
      for (const ContextChunk& ch : md->context_chunks) {
        const int64_t Tk = ch.total();
        if (Tk == 0) continue;
        // Gather and dequantize to act (the seed's workspace is an act tensor).
        gathered.resize(size_t(Tk) * kLatentDim);
        rows_parallel(Tk, [&](int64_t r0, int64_t r1) {
          // Request j of row r: cu_len[j] <= r < cu_len[j + 1].
          int64_t j =
              std::upper_bound(ch.cu_len.begin(), ch.cu_len.end(), r0) - ch.cu_len.begin() - 1;
          for (int64_t r = r0; r < r1; ++r) {
            while (r >= ch.cu_len[size_t(j) + 1]) ++j;
            float* row = gathered.data() + r * kLatentDim;
            const int64_t p = ch.start + (r - ch.cu_len[size_t(j)]);
            codec.decode(cache.slot_ptr(md->slot_of(nd + int(j), p)), row);
            cpu::round_to(row, kLatentDim, act);
          }
        });
        prefill_heads(qp.data(), Tk, gathered.data(), kLatentDim, gathered.data() + kKvLoraRank,
                      kLatentDim, cu_ctx, ch.cu_len, false, Tc, chunk_out.data(), chunk_lse.data());
        if (!have_prefix) {
          ctx_out.swap(chunk_out);
          ctx_lse.swap(chunk_lse);
          have_prefix = true;
        } else {
          cpu::merge_attn_f32(ctx_out.data(), ctx_lse.data(), chunk_out.data(), chunk_lse.data(),
                              Tc, Tc, H, kVDim, ctx_out.data(), ctx_lse.data(), act);
        }
      }
      if (have_prefix)  // final = merge(prefix = context, suffix = new tokens)
        cpu::merge_attn_f32(ctx_out.data(), ctx_lse.data(), new_out, new_lse.data(), Tp, Tc, H,
                            kVDim, new_out, nullptr, act);
    }
  }

  // ---- 6. gate and o_proj ---------------------------------------------------------
  if (cfg.use_output_gate) {
    const cpu::Scratch g(T * attn_width);
    cpu::gemm_nt(T, attn_width, hs, fp8_g ? x8.data() : x.data(), hs, w_g.data(), hs, g.data(),
                 attn_width, 1.0f, 0.0f, threads);
    rows_parallel(T, [&](int64_t t0, int64_t t1) {
      for (int64_t i = t0 * attn_width; i < t1 * attn_width; ++i) {
        const float gate = cpu::round_value(g.data()[i], act);
        attn.data()[i] = cpu::round_value(attn.data()[i] * (1.0f / (1.0f + std::exp(-gate))), act);
      }
    });
  }
  cpu::Scratch attn8;  // W8A8 o_proj: the gated attention output quantized per 128
  if (fp8_o) {
    attn8 = cpu::Scratch(T * attn_width);
    cpu::quantize_rows_fp8(attn.data(), T, attn_width, attn_width, attn8.data(), threads);
  }
  const cpu::Scratch y(T * hs);
  cpu::gemm_nt(T, hs, attn_width, fp8_o ? attn8.data() : attn.data(), attn_width, w_o.data(),
               attn_width, y.data(), hs, 1.0f, 0.0f, threads);
  rows_parallel(T, [&](int64_t t0, int64_t t1) {
    cpu::store_f32(y.data() + t0 * hs, (t1 - t0) * hs, act,
                   static_cast<std::byte*>(out.data) + t0 * hs * act_size);
  });
  if (rows > T)  // padding rows
    std::memset(static_cast<std::byte*>(out.data) + T * hs * act_size, 0,
                size_t((rows - T) * hs) * act_size);
  if (reduce) options.all_reduce(out);
}

// ---- MlaLayer ---------------------------------------------------------------------------

MlaLayer::MlaLayer(const MlaConfig& cfg, MlaWeights weights, LayerOptions options,
                   std::shared_ptr<const RopeTable> rope)
    : impl_(std::make_unique<Impl>(cfg, std::move(weights), std::move(options), std::move(rope))) {}
MlaLayer::~MlaLayer() = default;
MlaLayer::MlaLayer(MlaLayer&&) noexcept = default;
MlaLayer& MlaLayer::operator=(MlaLayer&&) noexcept = default;

const MlaConfig& MlaLayer::config() const { return impl_->cfg; }
const MlaWeights& MlaLayer::weights() const { return impl_->weights; }
const LayerOptions& MlaLayer::options() const { return impl_->options; }
const std::shared_ptr<const RopeTable>& MlaLayer::rope() const { return impl_->rope; }

void MlaLayer::forward(const TensorView& positions, const TensorView& hidden,
                       const BatchMetadata* md, LatentCache& cache, const TensorView& out) const {
  impl_->forward(positions, hidden, md, cache, out);
}

}  // namespace kmla
