// The fp64 oracle: the layer as docs/SEMANTICS.md defines it, in plain scalar fp64 loops.
//
// Choices made here (all of them well inside the tolerance the oracle itself defines):
//  * Seed rounding converts the double to float, then rounds to the activation dtype. The
//    seed rounds fp32 accumulators the same way; this differs from rounding the double
//    directly only when the float lands exactly on a bf16/fp16 tie.
//  * Every token attends in the un-absorbed MHA form: per key latent L and head h,
//    k_nope = r(W_UK_h L[:512]) and v = r(W_UV_h L[:512]). That is what makes the oracle an
//    independent check of the absorbed decode. The one exception is the decode query on a
//    plain fp8 cache, which is the absorbed, fp8-quantized query the seed feeds its kernel
//    (the quantization cannot be expressed in the MHA form); its values keep the MHA form, so
//    the seed's rounding of the attended latent is not reproduced.
//  * One softmax over all keys of a token: no context chunks and no LSE merge, so the
//    production merge is checked rather than copied.
//  * Prefill queries and new-token keys use the act-rounded rotated rope values on every
//    cache format; only the cache row and the decode query of a plain fp8 cache take the
//    unrounded rotation (they are quantized straight from it).
//  * fp8 block-quantized projections (MlaWeights::fp8) run as W8A8 in both modes: the GEMM
//    input row is quantized per 128 inputs (in fp64; x / s goes through float on its way to
//    e4m3) and multiplied by the exactly dequantized weight float(code) * scale. The one
//    exception is kv_b_proj for decode tokens, see step 4.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kmla/error.hpp"
#include "kmla/numeric.hpp"
#include "kmla/reference.hpp"

namespace kmla::reference {

namespace {

// A row-major fp64 matrix.
struct Mat {
  int64_t rows = 0, cols = 0;
  std::vector<double> v;

  Mat() = default;
  Mat(int64_t r, int64_t c) : rows(r), cols(c), v(size_t(r * c), 0.0) {}
  double* row(int64_t i) { return v.data() + i * cols; }
  const double* row(int64_t i) const { return v.data() + i * cols; }
};

double act_to_double(uint16_t x, DType t) {
  return t == DType::bf16 ? bf16_to_float(x) : fp16_to_float(x);
}

// Rounds to the activation dtype through float (see the note at the top).
double round_act(double x, DType t) {
  const float f = float(x);
  return t == DType::bf16 ? round_bf16(f) : round_fp16(f);
}

// The rounding hook r(x): identity in exact mode, the activation dtype in seed mode.
struct Rounder {
  DType act = DType::bf16;
  bool seed = false;

  double operator()(double x) const { return seed ? round_act(x, act) : x; }
  void apply(double* x, int64_t n) const {
    if (seed)
      for (int64_t i = 0; i < n; ++i) x[i] = round_act(x[i], act);
  }
};

// The fp8 prefill mode's unscaled cast to e4m3 and back.
double e4m3_roundtrip(double x) { return e4m3_to_float(e4m3_scaled_clamped(float(x), 1.0f)); }

// The fp8 block weight of projection `name`, or null when it is 16-bit.
const Fp8BlockWeight* fp8_of(const MlaWeights& w, const char* name) {
  const auto it = w.fp8.find(name);
  return it == w.fp8.end() ? nullptr : &it->second;
}

// Rows [r0, r0 + n) of a weight [rows, cols] as fp64: [n, cols], or [cols, n] transposed.
// The values are those of the 16-bit tensor `t`, or with `f` given, exactly
// float(code) * scale of the fp8 block weight.
Mat load_rows(const HostTensor& t, const Fp8BlockWeight* f, int64_t r0, int64_t n, bool transpose) {
  const int64_t cols = t.dim(1);
  Mat m = transpose ? Mat(cols, n) : Mat(n, cols);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t e = (r0 + i) * cols + j;
      const double x = f ? double(e4m3_to_float(f->codes.data<uint8_t>()[e])) * double(f->scale(r0 + i, j))
                         : act_to_double(t.data<uint16_t>()[e], t.dtype());
      if (transpose)
        m.row(j)[i] = x;
      else
        m.row(i)[j] = x;
    }
  return m;
}

// The W8A8 activation quantization of one row of n inputs: per 128, s = max(amax, 1e-10) / 448
// and x -> e4m3_sat(x / s) * s.
void quantize_activation(const double* x, int64_t n, double* out) {
  for (int64_t g = 0; g < n; g += Fp8BlockWeight::kBlock) {
    const int64_t end = std::min<int64_t>(n, g + Fp8BlockWeight::kBlock);
    double amax = 0;
    for (int64_t i = g; i < end; ++i) amax = std::max(amax, std::fabs(x[i]));
    const double s = std::max(amax, 1e-10) / kFp8Max;
    for (int64_t i = g; i < end; ++i) out[i] = double(e4m3_to_float(float_to_e4m3_sat(float(x[i] / s)))) * s;
  }
}

std::vector<double> load_vector(const HostTensor& t) {
  std::vector<double> v(size_t(t.numel()));
  const auto* p = t.data<uint16_t>();
  for (size_t i = 0; i < v.size(); ++i) v[i] = act_to_double(p[i], t.dtype());
  return v;
}

// An R x C block of c = a · bt, accumulated in locals (registers) over all of k.
template <int R, int C>
void matmul_block(const double* a, int64_t lda, const Mat& bt, int64_t j0, double* c, int64_t ldc) {
  double acc[R][C] = {};
  for (int64_t p = 0; p < bt.rows; ++p) {
    const double* b = bt.row(p) + j0;
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const double s = a[i * lda + p];
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) acc[i][j] += s * b[j];
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) c[i * ldc + j0 + j] = acc[i][j];
}

// c[m, n] = a[m, k] · bt[k, n], where a has row stride lda and c is dense. Every element is
// a plain sum over k in order; the blocking only keeps partial sums in registers.
void matmul(const double* a, int64_t lda, int64_t m, const Mat& bt, double* c) {
  constexpr int kR = 4, kC = 8;
  const int64_t n = bt.cols;
  for (int64_t i0 = 0; i0 < m; i0 += kR) {
    const double* ai = a + i0 * lda;
    double* ci = c + i0 * n;
    for (int64_t j0 = 0; j0 < n; j0 += kC) {
      if (i0 + kR <= m && j0 + kC <= n) {
        matmul_block<kR, kC>(ai, lda, bt, j0, ci, n);
        continue;
      }
      for (int64_t i = i0; i < std::min(m, i0 + kR); ++i)
        for (int64_t j = j0; j < std::min(n, j0 + kC); ++j) {
          double s = 0;
          for (int64_t p = 0; p < bt.rows; ++p) s += a[i * lda + p] * bt.row(p)[j];
          c[i * n + j] = s;
        }
    }
  }
}

// y[m, out] = x[m, in] · W^T for the projection `name` whose 16-bit tensor is t (x has row
// stride lda). An fp8 projection is W8A8: each row of x quantized, times the exact weight.
void project(const double* x, int64_t lda, int64_t m, const MlaWeights& w, const char* name,
             const HostTensor& t, double* y) {
  const Fp8BlockWeight* f = fp8_of(w, name);
  const Mat wt = load_rows(t, f, 0, t.dim(0), true);
  if (f == nullptr) return matmul(x, lda, m, wt, y);
  const int64_t k = t.dim(1);
  Mat xq(m, k);
  for (int64_t i = 0; i < m; ++i) quantize_activation(x + i * lda, k, xq.row(i));
  matmul(xq.v.data(), k, m, wt, y);
}

double dot(const double* a, const double* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// x * rsqrt(mean(x^2) + eps) * w, then r.
void rms_norm(double* x, int64_t n, const std::vector<double>& w, double eps, const Rounder& r) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const double inv = 1.0 / std::sqrt(ss / double(n) + eps);
  for (int64_t i = 0; i < n; ++i) x[i] = r(x[i] * inv * w[i]);
}

// Interleaved-pair rotation of 64 values in fp64 with one fp32 table row.
void rotate(double* x, const float* row) {
  constexpr int kHalf = kRopeDim / 2;
  for (int i = 0; i < kHalf; ++i) {
    const double c = row[i], s = row[kHalf + i];
    const double a = x[2 * i], b = x[2 * i + 1];
    x[2 * i] = a * c - b * s;
    x[2 * i + 1] = a * s + b * c;
  }
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

void validate_metadata(const BatchMetadata& md, const LatentCache& cache, int64_t rows) {
  KMLA_CHECK(md.num_rows == rows, "metadata has ", md.num_rows, " rows, hidden has ", rows);
  validate_batch(md, cache.geometry());
  KMLA_CHECK(md.slot_mapping.size() == size_t(md.num_rows), "metadata slot mapping has ",
             md.slot_mapping.size(), " entries for ", md.num_rows, " rows");
  for (int64_t t = 0; t < md.num_tokens; ++t) {
    const int64_t slot = md.slot_mapping[t];
    KMLA_CHECK(slot == -1 || (slot >= 0 && slot < cache.geometry().num_slots()), "metadata slot ",
               slot, " of row ", t, " is outside the cache's slots");
  }
}

// The keys one request's tokens attend over, projected per head.
struct Keys {
  int64_t count = 0;
  Mat latent;               // [count, 576]
  std::vector<Mat> k_nope;  // per head [count, 128] (empty when not needed)
  std::vector<Mat> v;       // per head [count, 128]
};

}  // namespace

Result forward(const MlaConfig& cfg, const MlaWeights& w, const RopeTable* rope,
               const TensorView& positions, const TensorView& hidden, const BatchMetadata* md,
               LatentCache& cache, const Options& options) {
  // ---- validation: everything is checked before the cache is touched -------------------
  const DType act = options.activation;
  KMLA_CHECK(act == DType::bf16 || act == DType::f16,
             "the activation dtype must be bf16 or f16, got ", dtype_name(act));
  w.validate(cfg);
  KMLA_CHECK(w.dtype() == act, "weights are ", dtype_name(w.dtype()), ", the activation dtype is ",
             dtype_name(act));
  check_tensor(hidden, "hidden", act, {-1, cfg.hidden_size});
  const int64_t rows = hidden.dim(0);
  check_tensor(positions, "positions", DType::i64, {rows});

  const int H = cfg.local_heads();
  const int64_t hs = cfg.hidden_size;
  const int64_t attn_width = int64_t(H) * kVDim;
  Result res;
  res.out.assign(size_t(rows * hs), 0.0);
  res.attn_out.assign(size_t(rows * attn_width), 0.0);
  if (md == nullptr) return res;

  KMLA_CHECK(cache.device() == Device::cpu && cache.base() != nullptr,
             "the oracle needs an allocated host cache");
  validate_metadata(*md, cache, rows);
  KMLA_CHECK(cache.format() != CacheFormat::fp8 || cache.k_scale() == w.k_scale, "the fp8 cache's k_scale ",
             cache.k_scale(), " differs from the layer's k_scale ", w.k_scale);
  const int64_t T = md->num_tokens;
  const auto* pos = positions.as<const int64_t>();
  if (cfg.use_rope) {  // padding rows' positions are never used, so not checked
    KMLA_CHECK(rope != nullptr, "config '", cfg.name, "' uses RoPE but no table was given");
    for (int64_t t = 0; t < T; ++t)
      KMLA_CHECK(pos[t] >= 0 && pos[t] < rope->rows(), "position ", pos[t], " of row ", t,
                 " is outside the RoPE table's ", rope->rows(), " rows");
  }

  const Rounder r{act, options.rounding == Rounding::seed};
  const bool fp8_cache = cache.format() == CacheFormat::fp8;
  const int64_t q_width = int64_t(H) * kQkHeadDim;

  // ---- step 1: front end, per real token ------------------------------------------------
  Mat h(T, hs);
  {
    const auto* src = hidden.as<const uint16_t>();
    for (int64_t i = 0; i < T * hs; ++i) h.v[size_t(i)] = act_to_double(src[i], act);
  }
  Mat q(T, q_width);      // per head [q_nope 128 | q_pe 64]; q_pe rotated, unrounded
  Mat kv(T, kLatentDim);  // [kv_c_normed 512 | k_pe 64]; k_pe rotated, unrounded
  project(h.v.data(), hs, T, w, "kv_a_proj_with_mqa", w.kv_a_proj_with_mqa, kv.v.data());
  r.apply(kv.v.data(), T * kLatentDim);
  const std::vector<double> kv_norm = load_vector(w.kv_a_layernorm);
  for (int64_t t = 0; t < T; ++t) rms_norm(kv.row(t), kKvLoraRank, kv_norm, cfg.rms_norm_eps, r);
  if (cfg.q_lora_rank) {
    const int64_t ql = *cfg.q_lora_rank;
    Mat q_c(T, ql);
    project(h.v.data(), hs, T, w, "q_a_proj", w.q_a_proj, q_c.v.data());
    r.apply(q_c.v.data(), T * ql);
    const std::vector<double> q_norm = load_vector(w.q_a_layernorm);
    for (int64_t t = 0; t < T; ++t) rms_norm(q_c.row(t), ql, q_norm, cfg.rms_norm_eps, r);
    project(q_c.v.data(), ql, T, w, "q_b_proj", w.q_b_proj, q.v.data());
  } else {
    project(h.v.data(), hs, T, w, "q_proj", w.q_proj, q.v.data());
  }
  r.apply(q.v.data(), T * q_width);

  // ---- step 2: RoPE (unrounded here; each use rounds as its path does) -------------------
  if (cfg.use_rope) {
    for (int64_t t = 0; t < T; ++t) {
      const float* row = rope->row(pos[t]);
      for (int hd = 0; hd < H; ++hd) rotate(q.row(t) + hd * kQkHeadDim + kNopeDim, row);
      rotate(kv.row(t) + kKvLoraRank, row);
    }
  }

  // ---- step 3: cache write --------------------------------------------------------------
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = md->slot_mapping[t];
    if (slot < 0) continue;
    float row[kLatentDim];
    for (int i = 0; i < kLatentDim; ++i) {
      const double x = kv.row(t)[i];
      row[i] = float(i >= kKvLoraRank && !fp8_cache ? r(x) : x);
    }
    cache.write_row(slot, row);
  }

  // ---- step 4: attention, request by request ---------------------------------------------
  // kv_b_proj per head: rows [h*256, h*256+128) are W_UK_h, the next 128 rows W_UV_h.
  // With an fp8 kv_b_proj the recipe gives the two paths different weights: prefill keys and
  // values are W8A8 (the latent quantized per 128, times the exactly dequantized weight),
  // while decode runs the absorbed W_UK_T / W_UV, built from the bf16 dequantized copy (the
  // 16-bit tensor) and applied to the unquantized latent. Decode keys here are that copy
  // times the latent, in the MHA form.
  struct KvB {
    std::vector<Mat> uk_t, uv_t;  // per head [512, 128]: the key and value projections
  };
  auto split_kv_b = [&](const Fp8BlockWeight* f) {
    KvB k{std::vector<Mat>(H), std::vector<Mat>(H)};
    for (int hd = 0; hd < H; ++hd) {
      const int64_t r0 = int64_t(hd) * kKvBOut;
      k.uk_t[hd] = load_rows(w.kv_b_proj, f, r0, kNopeDim, true);
      k.uv_t[hd] = load_rows(w.kv_b_proj, f, r0 + kNopeDim, kVDim, true);
    }
    return k;
  };
  const Fp8BlockWeight* kv_b8 = fp8_of(w, "kv_b_proj");
  const KvB kv_b_16 = split_kv_b(nullptr);
  const KvB kv_b_w8 = kv_b8 ? split_kv_b(kv_b8) : KvB{};
  std::vector<Mat> w_uk(H);  // [128, 512]: the absorbed query (plain fp8 only)
  if (fp8_cache)
    for (int hd = 0; hd < H; ++hd) w_uk[hd] = load_rows(w.kv_b_proj, nullptr, int64_t(hd) * kKvBOut, kNopeDim, false);
  const double scale = cfg.softmax_scale();
  const double q_scale = w.q_scale;
  const float q_scale_inv = 1.0f / w.q_scale;  // fp32 reciprocal, as the seed's writer
  Mat attn(T, attn_width);

  for (int req = 0; req < md->num_requests; ++req) {
    const int64_t q0 = md->query_start[req];
    const int32_t qlen = md->query_lens[req];
    if (qlen == 0) continue;
    const bool decode = md->kind(req) == RequestKind::decode;
    const bool absorbed_fp8 = decode && fp8_cache;
    const bool fp8_qkv = !decode && options.fp8_prefill;

    // Keys: decodes read [0, seq_len) back from the cache; prefills read their context from
    // the cache (rounded to act: the gather writes an act workspace) and append their own new
    // tokens' unquantized latents.
    Keys keys;
    const int64_t ctx = md->context_lens[req];
    keys.count = decode ? md->seq_lens[req] : ctx + qlen;
    keys.latent = Mat(keys.count, kLatentDim);
    const int64_t cached = decode ? keys.count : ctx;
    for (int64_t j = 0; j < cached; ++j) {
      float row[kLatentDim];
      cache.read_row(md->slot_of(req, j), row);
      for (int i = 0; i < kLatentDim; ++i)
        keys.latent.row(j)[i] = decode ? double(row[i]) : round_act(row[i], act);
    }
    for (int64_t j = cached; j < keys.count; ++j) {
      const double* src = kv.row(q0 + (j - ctx));
      double* dst = keys.latent.row(j);
      for (int i = 0; i < kLatentDim; ++i) dst[i] = i < kKvLoraRank ? src[i] : r(src[i]);
    }
    // The kv_b input: the latent [:512] (row stride 576), or its quantized copy for W8A8.
    const bool w8a8_kv_b = kv_b8 != nullptr && !decode;
    const KvB& kv_b = w8a8_kv_b ? kv_b_w8 : kv_b_16;
    Mat latent_q;
    if (w8a8_kv_b) {
      latent_q = Mat(keys.count, kKvLoraRank);
      for (int64_t j = 0; j < keys.count; ++j) quantize_activation(keys.latent.row(j), kKvLoraRank, latent_q.row(j));
    }
    const double* kv_b_in = w8a8_kv_b ? latent_q.v.data() : keys.latent.v.data();
    const int64_t kv_b_ld = w8a8_kv_b ? kKvLoraRank : kLatentDim;
    keys.v.resize(H);
    if (!absorbed_fp8) keys.k_nope.resize(H);
    for (int hd = 0; hd < H; ++hd) {
      keys.v[hd] = Mat(keys.count, kVDim);
      matmul(kv_b_in, kv_b_ld, keys.count, kv_b.uv_t[hd], keys.v[hd].v.data());
      r.apply(keys.v[hd].v.data(), keys.count * kVDim);
      if (!absorbed_fp8) {
        keys.k_nope[hd] = Mat(keys.count, kNopeDim);
        matmul(kv_b_in, kv_b_ld, keys.count, kv_b.uk_t[hd], keys.k_nope[hd].v.data());
        r.apply(keys.k_nope[hd].v.data(), keys.count * kNopeDim);
      }
      if (fp8_qkv) {
        for (double& x : keys.v[hd].v) x = e4m3_roundtrip(x);
        for (double& x : keys.k_nope[hd].v) x = e4m3_roundtrip(x);
      }
    }
    // The rope part of the keys, as the score uses it (shared by all heads).
    Mat k_pe(keys.count, kRopeDim);
    for (int64_t j = 0; j < keys.count; ++j)
      for (int i = 0; i < kRopeDim; ++i) {
        const double x = keys.latent.row(j)[kKvLoraRank + i];
        k_pe.row(j)[i] = fp8_qkv ? e4m3_roundtrip(x) : x;
      }

    std::vector<double> score(size_t(keys.count));
    for (int32_t i = 0; i < qlen; ++i) {
      const int64_t t = q0 + i;
      const int64_t visible =
          std::min(keys.count, decode ? md->decode_key_count(req, i) : ctx + i + 1);
      for (int hd = 0; hd < H; ++hd) {
        const double* qh = q.row(t) + hd * kQkHeadDim;
        double* o = attn.row(t) + hd * kVDim;
        if (visible <= 0) continue;  // no keys: zeros
        if (absorbed_fp8) {
          // [ql_nope | rope(q_pe)], quantized with q_scale, scored against the dequantized rows.
          double query[kLatentDim];
          matmul(qh, kNopeDim, 1, w_uk[hd], query);
          r.apply(query, kKvLoraRank);
          for (int d = 0; d < kRopeDim; ++d) query[kKvLoraRank + d] = qh[kNopeDim + d];
          for (double& x : query)
            x = double(e4m3_to_float(e4m3_scaled_clamped(float(x), q_scale_inv))) * q_scale;
          for (int64_t j = 0; j < visible; ++j)
            score[j] = scale * dot(query, keys.latent.row(j), kLatentDim);
        } else {
          double qn[kNopeDim], qp[kRopeDim];
          for (int d = 0; d < kNopeDim; ++d) qn[d] = fp8_qkv ? e4m3_roundtrip(qh[d]) : qh[d];
          for (int d = 0; d < kRopeDim; ++d) {
            const double x = r(qh[kNopeDim + d]);
            qp[d] = fp8_qkv ? e4m3_roundtrip(x) : x;
          }
          for (int64_t j = 0; j < visible; ++j)
            score[j] = scale *
                       (dot(qn, keys.k_nope[hd].row(j), kNopeDim) + dot(qp, k_pe.row(j), kRopeDim));
        }
        // Softmax in fp64, then the weighted sum of the values.
        const double m = *std::max_element(score.begin(), score.begin() + visible);
        double denom = 0;
        for (int64_t j = 0; j < visible; ++j) {
          score[j] = std::exp(score[j] - m);
          denom += score[j];
        }
        for (int d = 0; d < kVDim; ++d) {
          double acc = 0;
          for (int64_t j = 0; j < visible; ++j) acc += score[j] * keys.v[hd].row(j)[d];
          o[d] = r(acc / denom);
        }
      }
    }
  }

  // ---- step 5: gate and o_proj ---------------------------------------------------------
  for (int64_t t = 0; t < T; ++t)
    std::copy(attn.row(t), attn.row(t) + attn_width, res.attn_out.begin() + t * attn_width);
  if (cfg.use_output_gate) {
    Mat g(T, attn_width);
    project(h.v.data(), hs, T, w, "g_proj", w.g_proj, g.v.data());
    for (int64_t i = 0; i < T * attn_width; ++i)
      attn.v[size_t(i)] = r(attn.v[size_t(i)] * sigmoid(r(g.v[size_t(i)])));
  }
  project(attn.v.data(), attn_width, T, w, "o_proj", w.o_proj, res.out.data());
  r.apply(res.out.data(), T * hs);
  return res;
}

}  // namespace kmla::reference
