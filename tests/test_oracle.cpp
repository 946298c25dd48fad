// Tests of the fp64 oracle. Every expected value is computed here by a separate route: the
// front end with plain dot products, and attention in the absorbed form ((q_nope W_UK) . L,
// values W_UV (sum p L)), while the oracle projects every key (un-absorbed MHA form). In exact
// mode both are the same mathematics, so they agree to fp64 round-off.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#include "kmla/batch.hpp"
#include "kmla/cache.hpp"
#include "kmla/config.hpp"
#include "kmla/error.hpp"
#include "kmla/numeric.hpp"
#include "kmla/reference.hpp"
#include "kmla/rope.hpp"
#include "kmla/weights.hpp"

namespace kmla {
namespace {

using reference::Options;
using reference::Result;
using reference::Rounding;
using Row = std::vector<double>;

MlaConfig small_config(int heads, std::optional<int> q_lora, bool gate, int hidden = 64) {
  MlaConfig c;
  c.name = "oracle-test";
  c.hidden_size = hidden;
  c.num_heads = heads;
  c.q_lora_rank = q_lora;
  c.use_output_gate = gate;
  c.max_position_embeddings = 4096;
  c.validate();
  return c;
}

double act_value(uint16_t x, DType t) {
  return t == DType::bf16 ? bf16_to_float(x) : fp16_to_float(x);
}
uint16_t to_act(float x, DType t) { return t == DType::bf16 ? float_to_bf16(x) : float_to_fp16(x); }

double at(const HostTensor& m, int64_t i, int64_t j) {
  return act_value(m.data<uint16_t>()[i * m.dim(1) + j], m.dtype());
}
double at(const HostTensor& v, int64_t i) { return act_value(v.data<uint16_t>()[i], v.dtype()); }

// Deterministic multiples of 1/64 in [-scale, scale]: exact in bf16 and fp16 for scale <= 2.
struct Lcg {
  uint64_t s;
  double next(double scale = 1.0) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const int k = int((s >> 33) % 129) - 64;  // [-64, 64]
    return scale * k / 64.0;
  }
};

std::vector<uint16_t> make_hidden(int64_t rows, int64_t hidden, uint64_t seed, DType t) {
  Lcg g{seed};
  std::vector<uint16_t> h(size_t(rows * hidden));
  for (auto& x : h) x = to_act(float(g.next()), t);
  return h;
}

Row hidden_row(const std::vector<uint16_t>& h, int64_t row, int64_t hidden, DType t) {
  Row r(static_cast<size_t>(hidden));
  for (int64_t j = 0; j < hidden; ++j) r[j] = act_value(h[size_t(row * hidden + j)], t);
  return r;
}

// A cache row of multiples of 1/32 in [-2, 2] (exact in bf16 and fp16).
std::vector<float> random_latent(uint64_t seed) {
  Lcg g{seed};
  std::vector<float> r(kLatentDim);
  for (auto& x : r) x = float(g.next(2.0));
  return r;
}

Row read_cache_row(const LatentCache& c, int64_t slot) {
  float f[kLatentDim];
  c.read_row(slot, f);
  return Row(f, f + kLatentDim);
}

std::vector<std::byte> cache_bytes(const LatentCache& c) {
  const size_t n = size_t(c.geometry().block_stride) * size_t(c.num_blocks());
  return std::vector<std::byte>(c.base(), c.base() + n);
}

// ---- the hand route, exact mode -----------------------------------------------------------
Row project(const HostTensor& m, const Row& x) {
  Row y(size_t(m.dim(0)), 0.0);
  for (int64_t i = 0; i < m.dim(0); ++i)
    for (int64_t j = 0; j < m.dim(1); ++j) y[i] += at(m, i, j) * x[j];
  return y;
}

Row rms_norm(const Row& x, const HostTensor& w, double eps) {
  double ms = 0;
  for (double v : x) ms += v * v / double(x.size());
  Row y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] / std::sqrt(ms + eps) * at(w, int64_t(i));
  return y;
}

struct HandToken {
  Row q;       // [H*192] per head [q_nope | q_pe]
  Row latent;  // [576] [kv_c_normed | k_pe], no RoPE
  Row gate;    // [H*128] sigmoid(g), empty without the gate
};

HandToken hand_token(const MlaConfig& cfg, const MlaWeights& w, const Row& h) {
  HandToken t;
  const Row kv = project(w.kv_a_proj_with_mqa, h);
  t.latent =
      rms_norm(Row(kv.begin(), kv.begin() + kKvLoraRank), w.kv_a_layernorm, cfg.rms_norm_eps);
  t.latent.insert(t.latent.end(), kv.begin() + kKvLoraRank, kv.end());
  if (cfg.q_lora_rank)
    t.q = project(w.q_b_proj, rms_norm(project(w.q_a_proj, h), w.q_a_layernorm, cfg.rms_norm_eps));
  else
    t.q = project(w.q_proj, h);
  if (cfg.use_output_gate) {
    t.gate = project(w.g_proj, h);
    for (double& g : t.gate) g = 1.0 / (1.0 + std::exp(-g));
  }
  return t;
}

// W_UV_h . x for a 512-latent x.
Row up_value(const MlaWeights& w, int head, const double* x) {
  Row v(kVDim, 0.0);
  for (int d = 0; d < kVDim; ++d)
    for (int l = 0; l < kKvLoraRank; ++l)
      v[d] += at(w.kv_b_proj, head * kKvBOut + kNopeDim + d, l) * x[l];
  return v;
}

// Softmax of scores, then W_UV_h (sum_j p_j L_j[:512]): the absorbed route to the output.
Row absorbed_output(const MlaWeights& w, int head, const Row& scores,
                    const std::vector<Row>& keys) {
  const double m = *std::max_element(scores.begin(), scores.end());
  double z = 0;
  for (double s : scores) z += std::exp(s - m);
  Row latent(kKvLoraRank, 0.0);
  for (size_t j = 0; j < keys.size(); ++j)
    for (int l = 0; l < kKvLoraRank; ++l) latent[l] += std::exp(scores[j] - m) / z * keys[j][l];
  return up_value(w, head, latent.data());
}

// One head of exact attention over 576-latent keys, absorbed: q_nope is folded into W_UK.
Row hand_head_attention(const MlaWeights& w, int head, const double* q_head,
                        const std::vector<Row>& keys, double scale) {
  Row ql(kKvLoraRank, 0.0);
  for (int p = 0; p < kNopeDim; ++p)
    for (int l = 0; l < kKvLoraRank; ++l)
      ql[l] += q_head[p] * at(w.kv_b_proj, head * kKvBOut + p, l);
  Row scores;
  for (const Row& k : keys) {
    double s = 0;
    for (int l = 0; l < kKvLoraRank; ++l) s += ql[l] * k[l];
    for (int d = 0; d < kRopeDim; ++d) s += q_head[kNopeDim + d] * k[kKvLoraRank + d];
    scores.push_back(scale * s);
  }
  return absorbed_output(w, head, scores, keys);
}

// All heads of one token over one key list.
Row hand_attention(const MlaConfig& cfg, const MlaWeights& w, const HandToken& t,
                   const std::vector<Row>& keys) {
  Row o;
  for (int h = 0; h < cfg.local_heads(); ++h) {
    const Row oh =
        hand_head_attention(w, h, t.q.data() + h * kQkHeadDim, keys, cfg.softmax_scale());
    o.insert(o.end(), oh.begin(), oh.end());
  }
  return o;
}

// o_proj(gate (.) attn).
Row hand_out(const MlaConfig& cfg, const MlaWeights& w, const HandToken& t, Row attn) {
  if (cfg.use_output_gate)
    for (size_t i = 0; i < attn.size(); ++i) attn[i] *= t.gate[i];
  return project(w.o_proj, attn);
}

Row row_of(const std::vector<double>& m, int64_t row, int64_t width) {
  return Row(m.begin() + row * width, m.begin() + (row + 1) * width);
}

double max_abs(const Row& a) {
  double m = 0;
  for (double x : a) m = std::max(m, std::fabs(x));
  return m;
}

// max |a - b| / max |b|.
double rel_diff(const Row& a, const Row& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) d = std::max(d, std::fabs(a[i] - b[i]));
  return d / std::max(max_abs(b), 1e-300);
}

bool all_finite(const std::vector<double>& v) {
  return std::all_of(v.begin(), v.end(), [](double x) { return std::isfinite(x); });
}

Result run(const MlaConfig& cfg, const MlaWeights& w, const BatchMetadata* md,
           std::vector<uint16_t>& hidden, std::vector<int64_t> positions, LatentCache& cache,
           Options opt = {}, const RopeTable* rope = nullptr) {
  const int64_t rows = int64_t(positions.size());
  const TensorView pos(positions.data(), DType::i64, {rows});
  const TensorView h(hidden.data(), opt.activation, {rows, cfg.hidden_size});
  return reference::forward(cfg, w, rope, pos, h, md, cache, opt);
}

Result run(const MlaConfig& cfg, const MlaWeights& w, const BatchMetadata& md,
           std::vector<uint16_t>& hidden, LatentCache& cache, Options opt = {},
           const RopeTable* rope = nullptr) {
  return run(cfg, w, &md, hidden, md.positions, cache, opt, rope);
}

std::vector<int32_t> iota_blocks(int n, int first = 0) {
  std::vector<int32_t> b(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) b[i] = first + i;
  return b;
}

constexpr double kTight = 1e-10;

// ---- 1. one key: the output is that key's value ----------------------------------------------

TEST(Oracle, SingleKeyFreshPrefillOutputsGatedValueOfItsOwnLatent) {
  const MlaConfig cfg = small_config(2, 32, /*gate=*/true);
  const MlaWeights w = MlaWeights::random(cfg, 11);
  LatentCache cache = LatentCache::allocate(CacheFormat::bf16, 4, 2);
  const BatchMetadata md = plan_batch({{1, 0, {1}}}, cache.geometry());
  auto hidden = make_hidden(1, cfg.hidden_size, 5, DType::bf16);
  const Result res = run(cfg, w, md, hidden, cache);

  // Softmax over one key is 1, so attn = W_UV kv_c_normed whatever q is.
  const HandToken t = hand_token(cfg, w, hidden_row(hidden, 0, cfg.hidden_size, DType::bf16));
  Row attn;
  for (int h = 0; h < cfg.local_heads(); ++h) {
    const Row v = up_value(w, h, t.latent.data());
    attn.insert(attn.end(), v.begin(), v.end());
  }
  EXPECT_LT(rel_diff(res.attn_out, attn), kTight);
  EXPECT_LT(rel_diff(res.out, hand_out(cfg, w, t, attn)), kTight);

  // The cache row (slot 4: block 1, offset 0) holds the bf16 latent.
  const Row stored = read_cache_row(cache, 4);
  for (int i = 0; i < kLatentDim; ++i) EXPECT_EQ(stored[i], round_bf16(float(t.latent[i]))) << i;
}

TEST(Oracle, DecodeOverTwoEqualCachedKeysOutputsValueOfTheCachedRow) {
  // Without RoPE the same hidden state gives the same cache row at positions 0 and 1, so the
  // decode token attends uniformly to two copies of the stored (bf16) latent.
  const MlaConfig cfg = small_config(1, std::nullopt, /*gate=*/false);
  const MlaWeights w = MlaWeights::random(cfg, 12);
  LatentCache cache = LatentCache::allocate(CacheFormat::bf16, 2, 3);
  auto hidden = make_hidden(1, cfg.hidden_size, 6, DType::bf16);
  const BatchMetadata first = plan_batch({{1, 0, {2}}}, cache.geometry());
  run(cfg, w, first, hidden, cache);
  const BatchMetadata decode = plan_batch({{1, 1, {2}}}, cache.geometry());
  ASSERT_EQ(decode.kind(0), RequestKind::decode);
  const Result res = run(cfg, w, decode, hidden, cache);

  const Row stored = read_cache_row(cache, 5);
  ASSERT_EQ(stored, read_cache_row(cache, 4));
  const Row attn = up_value(w, 0, stored.data());
  EXPECT_LT(rel_diff(res.attn_out, attn), kTight);
  EXPECT_LT(rel_diff(res.out, project(w.o_proj, attn)), kTight);
}

// ---- 2. multi-token decode blocks ------------------------------------------------------------

TEST(Oracle, TwoTokenDecodeBlockIsCausalBottomRightOrSeesAllKeys) {
  const MlaConfig cfg = small_config(2, 48, /*gate=*/true);
  const MlaWeights w = MlaWeights::random(cfg, 13);
  LatentCache base = LatentCache::allocate(CacheFormat::bf16, 4, 4);
  const int ctx = 5;
  const std::vector<int32_t> table = {2, 0};
  BatchOptions opt;
  opt.decode_threshold = 2;
  const BatchMetadata causal = plan_batch({{2, ctx, table}}, base.geometry(), opt);
  opt.non_causal_decode = true;
  const BatchMetadata full = plan_batch({{2, ctx, table}}, base.geometry(), opt);
  ASSERT_EQ(causal.num_decodes, 1);
  for (int p = 0; p < ctx; ++p) base.write_row(causal.slot_of(0, p), random_latent(100 + p).data());

  auto hidden = make_hidden(2, cfg.hidden_size, 7, DType::bf16);
  LatentCache cache_c = base.clone(), cache_f = base.clone();
  const Result rc = run(cfg, w, causal, hidden, cache_c);
  const Result rf = run(cfg, w, full, hidden, cache_f);
  ASSERT_EQ(cache_bytes(cache_c), cache_bytes(cache_f));

  const int64_t width = cfg.hidden_size;
  EXPECT_GT(rel_diff(row_of(rc.out, 0, width), row_of(rf.out, 0, width)), 1e-6);
  EXPECT_EQ(row_of(rc.out, 1, width), row_of(rf.out, 1, width));  // the last token sees all keys

  std::vector<Row> keys;
  for (int p = 0; p < ctx + 2; ++p) keys.push_back(read_cache_row(cache_c, causal.slot_of(0, p)));
  const HandToken t0 = hand_token(cfg, w, hidden_row(hidden, 0, width, DType::bf16));
  // The decode token's own key is its bf16 cache row, written before attention.
  for (int i = 0; i < kLatentDim; ++i) ASSERT_EQ(keys[ctx][i], round_bf16(float(t0.latent[i])));
  const std::vector<Row> first_keys(keys.begin(), keys.end() - 1);  // seq_len - 1 keys
  EXPECT_LT(rel_diff(row_of(rc.out, 0, width),
                     hand_out(cfg, w, t0, hand_attention(cfg, w, t0, first_keys))),
            kTight);
  EXPECT_LT(
      rel_diff(row_of(rf.out, 0, width), hand_out(cfg, w, t0, hand_attention(cfg, w, t0, keys))),
      kTight);
}

TEST(Oracle, SeedModeDecodeBlockMatchesTheSameTokensAsAContextPrefill) {
  // In seed mode with a bf16 cache the new tokens' in-memory latents equal their cache rows, so
  // a causal decode block and a prefill with context over the same tokens see the same keys.
  const MlaConfig cfg = small_config(2, 32, /*gate=*/true);
  const MlaWeights w = MlaWeights::random(cfg, 14);
  LatentCache base = LatentCache::allocate(CacheFormat::bf16, 4, 4);
  const std::vector<RequestSpec> reqs = {{3, 6, {3, 1, 0}}};
  BatchOptions opt;
  opt.decode_threshold = 3;
  const BatchMetadata as_decode = plan_batch(reqs, base.geometry(), opt);
  const BatchMetadata as_prefill = plan_batch(reqs, base.geometry());
  ASSERT_EQ(as_decode.kind(0), RequestKind::decode);
  ASSERT_EQ(as_prefill.kind(0), RequestKind::context_prefill);
  for (int p = 0; p < 6; ++p)
    base.write_row(as_decode.slot_of(0, p), random_latent(200 + p).data());

  auto hidden = make_hidden(3, cfg.hidden_size, 8, DType::bf16);
  const Options seed{Rounding::seed, DType::bf16, false};
  LatentCache c1 = base.clone(), c2 = base.clone();
  const Result rd = run(cfg, w, as_decode, hidden, c1, seed);
  const Result rp = run(cfg, w, as_prefill, hidden, c2, seed);
  EXPECT_LT(rel_diff(rd.out, rp.out), 1e-12);
  EXPECT_EQ(cache_bytes(c1), cache_bytes(c2));
}

// ---- 3. slots ---------------------------------------------------------------------------------

TEST(Oracle, NegativeSlotsLeaveTheCacheUntouchedAndStillProduceOutput) {
  const MlaConfig cfg = small_config(1, 32, /*gate=*/true);
  const MlaWeights w = MlaWeights::random(cfg, 15);
  LatentCache cache = LatentCache::allocate(CacheFormat::bf16, 4, 4);
  const std::vector<RequestSpec> reqs = {{1, 3, {0}}, {2, 0, {1}}};
  for (int p = 0; p < 3; ++p) cache.write_row(p, random_latent(300 + p).data());
  BatchOptions opt;
  opt.slot_mapping = {-1, -1, -1};
  const BatchMetadata md = plan_batch(reqs, cache.geometry(), opt);
  const BatchMetadata md_written = plan_batch(reqs, cache.geometry());
  auto hidden = make_hidden(3, cfg.hidden_size, 9, DType::bf16);

  const auto before = cache_bytes(cache);
  const Result res = run(cfg, w, md, hidden, cache);
  EXPECT_EQ(cache_bytes(cache), before);
  EXPECT_TRUE(all_finite(res.out));
  for (int64_t t = 0; t < 3; ++t) EXPECT_GT(max_abs(row_of(res.out, t, cfg.hidden_size)), 0) << t;

  // The decode token reads its (never written, zero) row: keys are 3 context rows and zeros.
  std::vector<Row> keys;
  for (int p = 0; p < 4; ++p) keys.push_back(read_cache_row(cache, p));
  const HandToken t0 = hand_token(cfg, w, hidden_row(hidden, 0, cfg.hidden_size, DType::bf16));
  EXPECT_LT(rel_diff(row_of(res.out, 0, cfg.hidden_size),
                     hand_out(cfg, w, t0, hand_attention(cfg, w, t0, keys))),
            kTight);

  // A fresh prefill attends to its in-memory latents, so the slots do not change its output.
  LatentCache written = cache.clone();
  const Result ref = run(cfg, w, md_written, hidden, written);
  EXPECT_NE(cache_bytes(written), before);
  for (int64_t t = 1; t < 3; ++t)
    EXPECT_EQ(row_of(res.out, t, cfg.hidden_size), row_of(ref.out, t, cfg.hidden_size)) << t;
}

// ---- 4. no metadata, padding ----------------------------------------------------------------

TEST(Oracle, NoMetadataGivesZerosAndLeavesTheCacheAlone) {
  const MlaConfig cfg = small_config(2, std::nullopt, /*gate=*/true);
  const MlaWeights w = MlaWeights::random(cfg, 16);
  LatentCache cache = LatentCache::allocate(CacheFormat::bf16, 4, 2);
  std::memset(cache.base(), 0x5a, cache_bytes(cache).size());
  const auto before = cache_bytes(cache);
  auto hidden = make_hidden(5, cfg.hidden_size, 10, DType::bf16);
  const Result res = run(cfg, w, nullptr, hidden, std::vector<int64_t>(5, 0), cache);
  EXPECT_EQ(res.out, std::vector<double>(size_t(5 * cfg.hidden_size), 0.0));
  EXPECT_EQ(res.attn_out, std::vector<double>(size_t(5 * 2 * kVDim), 0.0));
  EXPECT_EQ(cache_bytes(cache), before);
}

TEST(Oracle, PaddingRowsAreZeroAndDoNotChangeRealRows) {
  const MlaConfig cfg = small_config(2, 32, /*gate=*/true);
  const MlaWeights w = MlaWeights::random(cfg, 17);
  LatentCache base = LatentCache::allocate(CacheFormat::bf16, 4, 6);
  for (int p = 0; p < 4; ++p) base.write_row(p, random_latent(400 + p).data());
  const std::vector<RequestSpec> reqs = {{1, 4, {0, 1}}, {3, 0, {2}}};
  const BatchMetadata md = plan_batch(reqs, base.geometry());
  BatchOptions opt;
  opt.num_rows = 7;
  const BatchMetadata padded = plan_batch(reqs, base.geometry(), opt);
  auto hidden = make_hidden(4, cfg.hidden_size, 11, DType::bf16);
  auto hidden_padded = hidden;
  hidden_padded.resize(size_t(7 * cfg.hidden_size), 0x7fc0);  // NaN in the padding rows

  LatentCache c1 = base.clone(), c2 = base.clone();
  const Result a = run(cfg, w, md, hidden, c1);
  const Result b = run(cfg, w, padded, hidden_padded, c2);
  EXPECT_EQ(cache_bytes(c1), cache_bytes(c2));
  const int64_t hs = cfg.hidden_size, aw = 2 * kVDim;
  for (int64_t t = 0; t < 4; ++t) {
    EXPECT_EQ(row_of(a.out, t, hs), row_of(b.out, t, hs)) << t;
    EXPECT_EQ(row_of(a.attn_out, t, aw), row_of(b.attn_out, t, aw)) << t;
  }
  for (int64_t t = 4; t < 7; ++t) {
    EXPECT_EQ(row_of(b.out, t, hs), Row(size_t(hs), 0.0)) << t;
    EXPECT_EQ(row_of(b.attn_out, t, aw), Row(size_t(aw), 0.0)) << t;
  }
}

// ---- 5. rounding modes ----------------------------------------------------------------------

TEST(Oracle, SeedRoundingIsSlightlyOffExactAndFp16IsCloserThanBf16) {
  const MlaConfig cfg = small_config(2, 48, /*gate=*/true);
  const MlaWeights w16 = MlaWeights::random(cfg, 18, DType::bf16);
  // The same weights in fp16 (bf16 values convert exactly unless they are tiny).
  MlaWeights wf = w16;
  for (HostTensor* t : {&wf.q_a_proj, &wf.q_a_layernorm, &wf.q_b_proj, &wf.kv_a_proj_with_mqa,
                        &wf.kv_a_layernorm, &wf.kv_b_proj, &wf.g_proj, &wf.o_proj}) {
    const TensorView v = t->view();
    HostTensor c(DType::f16, std::vector<int64_t>(v.shape, v.shape + v.ndim));
    for (int64_t i = 0; i < t->numel(); ++i)
      c.data<uint16_t>()[i] = float_to_fp16(bf16_to_float(t->data<uint16_t>()[i]));
    *t = c;
  }
  const std::vector<RequestSpec> reqs = {{1, 5, {0, 1}}, {2, 3, {2, 4}}, {3, 0, {3}}};

  struct Run {
    Row exact, seed;
  };
  auto both = [&](DType act, CacheFormat fmt, const MlaWeights& w) {
    LatentCache base = LatentCache::allocate(fmt, 4, 5);
    const BatchMetadata md = plan_batch(reqs, base.geometry());
    for (int r = 0; r < md.num_requests; ++r)
      for (int p = 0; p < md.context_lens[r]; ++p)
        base.write_row(md.slot_of(r, p), random_latent(500 + 10 * r + p).data());
    auto hidden = make_hidden(md.num_rows, cfg.hidden_size, 12, act);
    LatentCache c1 = base.clone(), c2 = base.clone();
    return Run{run(cfg, w, md, hidden, c1, {Rounding::exact, act, false}).out,
               run(cfg, w, md, hidden, c2, {Rounding::seed, act, false}).out};
  };
  const Run bf = both(DType::bf16, CacheFormat::bf16, w16);
  const Run hf = both(DType::f16, CacheFormat::fp16, wf);
  const double err_bf = rel_diff(bf.seed, bf.exact), err_hf = rel_diff(hf.seed, hf.exact);
  EXPECT_GT(err_bf, 1e-4);
  EXPECT_LT(err_bf, 1e-2);
  EXPECT_GT(err_hf, 1e-6);
  EXPECT_LT(err_hf, err_bf / 2);  // fp16 keeps 3 more mantissa bits
  EXPECT_NE(bf.seed, hf.seed);
  // Seed outputs are act values; exact ones are not.
  for (double x : bf.seed) ASSERT_EQ(x, double(round_bf16(float(x))));
  for (double x : hf.seed) ASSERT_EQ(x, double(round_fp16(float(x))));
}

// ---- 6. block tables and poisoned memory ---------------------------------------------------

TEST(Oracle, PermutedBlockTablesGiveIdenticalOutputsAndPoisonDoesNotLeak) {
  const MlaConfig cfg = small_config(2, 32, /*gate=*/true);
  MlaWeights w = MlaWeights::random(cfg, 19);
  w.k_scale = 0.5f;  // matches the fp8 cache's scale below
  for (CacheFormat fmt : {CacheFormat::bf16, CacheFormat::fp8, CacheFormat::fp8_ds_mla}) {
    SCOPED_TRACE(cache_format_name(fmt));
    auto results = std::vector<Result>();
    for (const auto& tables : {std::vector<std::vector<int32_t>>{{0, 1, 2}, {3, 4, 5}, {6}},
                               std::vector<std::vector<int32_t>>{{9, 2, 7}, {0, 11, 4}, {5}}}) {
      LatentCache cache = LatentCache::allocate(fmt, 4, 12, 0.5f);
      std::memset(cache.base(), 0xff, cache_bytes(cache).size());  // NaN in every format
      const std::vector<RequestSpec> reqs = {
          {1, 9, tables[0]}, {3, 6, tables[1]}, {3, 0, tables[2]}};
      const BatchMetadata md = plan_batch(reqs, cache.geometry());
      for (int r = 0; r < md.num_requests; ++r)
        for (int p = 0; p < md.context_lens[r]; ++p)
          cache.write_row(md.slot_of(r, p), random_latent(600 + 10 * r + p).data());
      auto hidden = make_hidden(md.num_rows, cfg.hidden_size, 13, DType::bf16);
      results.push_back(run(cfg, w, md, hidden, cache, {Rounding::seed, DType::bf16, false}));
      EXPECT_TRUE(all_finite(results.back().out));
      EXPECT_TRUE(all_finite(results.back().attn_out));
    }
    EXPECT_EQ(results[0].out, results[1].out);
    EXPECT_EQ(results[0].attn_out, results[1].attn_out);
  }
}

// ---- 7. bad input ---------------------------------------------------------------------------

TEST(Oracle, BadInputThrowsBeforeTouchingTheCache) {
  MlaConfig cfg = small_config(1, 32, /*gate=*/false);
  cfg.use_rope = true;
  const MlaWeights w = MlaWeights::random(cfg, 20);
  const auto rope = RopeTable::build(cfg, 8);
  LatentCache cache = LatentCache::allocate(CacheFormat::bf16, 4, 4);
  const auto before = cache_bytes(cache);
  auto hidden = make_hidden(2, cfg.hidden_size, 14, DType::bf16);
  const BatchMetadata md = plan_batch({{2, 0, {1}}}, cache.geometry());
  const TensorView pos(const_cast<int64_t*>(md.positions.data()), DType::i64, {2});
  auto forward = [&](const TensorView& p, const TensorView& h, const BatchMetadata* m,
                     const RopeTable* table, DType act = DType::bf16) {
    return reference::forward(cfg, w, table, p, h, m, cache, {Rounding::exact, act, false});
  };
  const TensorView good(hidden.data(), DType::bf16, {2, cfg.hidden_size});
  const TensorView wide(hidden.data(), DType::bf16, {1, cfg.hidden_size + 1});
  const TensorView short_rows(hidden.data(), DType::bf16, {1, cfg.hidden_size});
  const TensorView as_f16(hidden.data(), DType::f16, {2, cfg.hidden_size});

  EXPECT_NO_THROW(forward(pos, good, nullptr, rope.get()));  // sanity: the good call's shapes
  EXPECT_THROW(forward(pos, wide, &md, rope.get()), Error);
  EXPECT_THROW(forward(TensorView(pos.data, DType::i64, {1}), short_rows, &md, rope.get()), Error);
  EXPECT_THROW(forward(pos, as_f16, &md, rope.get(), DType::f16), Error);  // bf16 weights
  EXPECT_THROW(forward(pos, good, &md, nullptr), Error);                   // RoPE without a table

  std::vector<int64_t> far = {3, 8};  // the table has 8 rows
  EXPECT_THROW(forward(TensorView(far.data(), DType::i64, {2}), good, &md, rope.get()), Error);
  const BatchMetadata past_table = plan_batch({{2, 7, {0, 1, 2}}}, cache.geometry());
  const TensorView past_pos(const_cast<int64_t*>(past_table.positions.data()), DType::i64, {2});
  EXPECT_THROW(forward(past_pos, good, &past_table, rope.get()), Error);

  LatentCache big = LatentCache::allocate(CacheFormat::bf16, 8, 4);
  const BatchMetadata other_block = plan_batch({{2, 0, {1}}}, big.geometry());
  EXPECT_THROW(forward(pos, good, &other_block, rope.get()), Error);
  LatentCache more = LatentCache::allocate(CacheFormat::bf16, 4, 8);
  const BatchMetadata more_blocks = plan_batch({{2, 0, {6}}}, more.geometry());
  EXPECT_THROW(forward(pos, good, &more_blocks, rope.get()), Error);

  EXPECT_EQ(cache_bytes(cache), before);
  EXPECT_NO_THROW(forward(pos, good, &md, rope.get()));
  EXPECT_NE(cache_bytes(cache), before);
}

// ---- 8. plain fp8 cache ---------------------------------------------------------------------

TEST(Oracle, PlainFp8DecodeScoresTheQuantizedAbsorbedQuery) {
  const MlaConfig cfg = small_config(1, std::nullopt, /*gate=*/false);
  MlaWeights w = MlaWeights::random(cfg, 21);
  const float k_scale = 0.05f, q_scale = 0.02f;
  w.k_scale = k_scale;
  w.q_scale = q_scale;
  LatentCache cache = LatentCache::allocate(CacheFormat::fp8, 2, 2, k_scale);
  cache.write_row(2, random_latent(700).data());
  const BatchMetadata md = plan_batch({{1, 1, {1}}}, cache.geometry());
  auto hidden = make_hidden(1, cfg.hidden_size, 15, DType::bf16);
  const Result res = run(cfg, w, md, hidden, cache);

  const HandToken t = hand_token(cfg, w, hidden_row(hidden, 0, cfg.hidden_size, DType::bf16));
  // The token's own row: e4m3(x / k_scale) read back as code * k_scale.
  const Row own = read_cache_row(cache, 3);
  for (int i = 0; i < kLatentDim; ++i) {
    const float code = e4m3_to_float(
        float_to_e4m3_sat(std::clamp(float(t.latent[i]) * (1.0f / k_scale), -448.0f, 448.0f)));
    ASSERT_EQ(own[i], double(code * k_scale)) << i;
  }
  const std::vector<Row> keys = {read_cache_row(cache, 2), own};

  // query = [q_nope W_UK | q_pe], each element e4m3(x / q_scale) * q_scale.
  Row query(kLatentDim, 0.0);
  for (int l = 0; l < kKvLoraRank; ++l)
    for (int p = 0; p < kNopeDim; ++p) query[l] += t.q[p] * at(w.kv_b_proj, p, l);
  for (int d = 0; d < kRopeDim; ++d) query[kKvLoraRank + d] = t.q[kNopeDim + d];
  Row quantized = query;
  for (double& x : quantized)
    x = double(e4m3_to_float(
            float_to_e4m3_sat(std::clamp(float(x) * (1.0f / q_scale), -448.0f, 448.0f)))) *
        q_scale;
  auto output_for = [&](const Row& qv) {
    Row scores;
    for (const Row& k : keys) {
      double s = 0;
      for (int i = 0; i < kLatentDim; ++i) s += qv[i] * k[i];
      scores.push_back(cfg.softmax_scale() * s);
    }
    return project(w.o_proj, absorbed_output(w, 0, scores, keys));
  };
  const Row expected = output_for(quantized);
  EXPECT_LT(rel_diff(res.out, expected), kTight);
  // The quantization is visible at this scale, so the check above can tell the two apart.
  EXPECT_GT(rel_diff(output_for(query), expected), 1e-4);
}

TEST(Oracle, ContextPrefillAttendsRoundedContextAndItsOwnUnquantizedLatents) {
  const MlaConfig cfg = small_config(2, 32, /*gate=*/false);
  MlaWeights w = MlaWeights::random(cfg, 22);
  const float k_scale = 0.037f;  // dequantized context values are not bf16 values
  w.k_scale = k_scale;
  LatentCache cache = LatentCache::allocate(CacheFormat::fp8, 4, 2, k_scale);
  const BatchMetadata md = plan_batch({{2, 2, {1}}}, cache.geometry());
  ASSERT_EQ(md.kind(0), RequestKind::context_prefill);
  for (int p = 0; p < 2; ++p) cache.write_row(4 + p, random_latent(800 + p).data());
  auto hidden = make_hidden(2, cfg.hidden_size, 16, DType::bf16);
  const Result res = run(cfg, w, md, hidden, cache);

  std::vector<Row> keys;
  for (int p = 0; p < 2; ++p) {
    Row k = read_cache_row(cache, 4 + p);
    for (double& x : k) x = round_bf16(float(x));  // the gather's act workspace
    keys.push_back(k);
  }
  for (int i = 0; i < 2; ++i) {
    const HandToken t = hand_token(cfg, w, hidden_row(hidden, i, cfg.hidden_size, DType::bf16));
    keys.push_back(t.latent);  // causal: token i sees the context and tokens 0..i
    EXPECT_LT(rel_diff(row_of(res.out, i, cfg.hidden_size),
                       hand_out(cfg, w, t, hand_attention(cfg, w, t, keys))),
              kTight)
        << i;
  }
}

TEST(Oracle, Fp8PrefillCastsTheValueToE4m3) {
  const MlaConfig cfg = small_config(2, std::nullopt, /*gate=*/true);
  const MlaWeights w = MlaWeights::random(cfg, 23);
  LatentCache cache = LatentCache::allocate(CacheFormat::bf16, 4, 1);
  const BatchMetadata md = plan_batch({{1, 0, {0}}}, cache.geometry());
  auto hidden = make_hidden(1, cfg.hidden_size, 17, DType::bf16);
  const Result res = run(cfg, w, md, hidden, cache, {Rounding::exact, DType::bf16, true});

  // One key: attn = e4m3(v) with v = W_UV kv_c_normed (the score's casts do not matter).
  const HandToken t = hand_token(cfg, w, hidden_row(hidden, 0, cfg.hidden_size, DType::bf16));
  Row attn;
  for (int h = 0; h < 2; ++h)
    for (double v : up_value(w, h, t.latent.data()))
      attn.push_back(e4m3_to_float(float_to_e4m3_sat(float(v))));
  EXPECT_LT(rel_diff(res.attn_out, attn), kTight);
  EXPECT_LT(rel_diff(res.out, hand_out(cfg, w, t, attn)), kTight);
}

// ---- RoPE ----------------------------------------------------------------------------------

TEST(Oracle, RopeRotatesCachedKeysAndOnlyRelativePositionsMatter) {
  MlaConfig cfg = small_config(2, 32, /*gate=*/true);
  cfg.use_rope = true;
  const MlaWeights w = MlaWeights::random(cfg, 24);
  const auto rope = RopeTable::build(cfg, 64);
  LatentCache cache = LatentCache::allocate(CacheFormat::bf16, 4, 1);
  const BatchMetadata md = plan_batch({{3, 0, {0}}}, cache.geometry());
  auto hidden = make_hidden(3, cfg.hidden_size, 18, DType::bf16);
  auto fwd = [&](std::vector<int64_t> pos) {
    LatentCache c = cache.clone();
    Result r = run(cfg, w, &md, hidden, pos, c, {}, rope.get());
    return std::make_pair(r, c);
  };
  const auto [at0, cache0] = fwd({0, 1, 2});
  const auto [at20, cache20] = fwd({20, 21, 22});
  const Result spread = fwd({0, 7, 30}).first;
  EXPECT_LT(rel_diff(at20.out, at0.out), 1e-5);  // the fp32 table's cos/sin differ slightly
  EXPECT_GT(rel_diff(spread.out, at0.out), 1e-3);

  // Token 2's cached k_pe at position 22: pairs rotated by 22 * inv_freq_i.
  const HandToken t = hand_token(cfg, w, hidden_row(hidden, 2, cfg.hidden_size, DType::bf16));
  const Row stored = read_cache_row(cache20, 2);
  for (int i = 0; i < kRopeDim / 2; ++i) {
    const double angle = 22.0 * rope->inv_freq()[i];
    const double a = t.latent[kKvLoraRank + 2 * i], b = t.latent[kKvLoraRank + 2 * i + 1];
    EXPECT_NEAR(stored[kKvLoraRank + 2 * i], a * std::cos(angle) - b * std::sin(angle),
                1e-2 * (std::fabs(a) + std::fabs(b)));
    EXPECT_NEAR(stored[kKvLoraRank + 2 * i + 1], a * std::sin(angle) + b * std::cos(angle),
                1e-2 * (std::fabs(a) + std::fabs(b)));
  }
  for (int i = 0; i < kKvLoraRank; ++i) EXPECT_EQ(stored[i], read_cache_row(cache0, 2)[i]);
}

// ---- a realistic size ---------------------------------------------------------------------------

TEST(Oracle, MixedBatchWithHundredsOfKeysRunsQuickly) {
  MlaConfig cfg = small_config(3, 96, /*gate=*/true, /*hidden=*/256);
  cfg.use_rope = true;
  const MlaWeights w = MlaWeights::random(cfg, 25);
  const auto rope = RopeTable::build(cfg, 512);
  LatentCache cache = LatentCache::allocate(CacheFormat::fp8_ds_mla, 16, 128);
  // 40 tokens: two decodes, a prefill with context and a fresh prefill, ~700 keys in all.
  const std::vector<RequestSpec> reqs = {{1, 300, iota_blocks(19, 0)},
                                         {1, 200, iota_blocks(13, 20)},
                                         {20, 150, iota_blocks(11, 40)},
                                         {18, 0, iota_blocks(2, 60)}};
  const BatchMetadata md = plan_batch(reqs, cache.geometry());
  for (int r = 0; r < md.num_requests; ++r)
    for (int p = 0; p < md.context_lens[r]; ++p)
      cache.write_row(md.slot_of(r, p), random_latent(1000 + p).data());
  auto hidden = make_hidden(md.num_rows, cfg.hidden_size, 19, DType::bf16);
  const auto start = std::chrono::steady_clock::now();
  const Result res =
      run(cfg, w, md, hidden, cache, {Rounding::seed, DType::bf16, false}, rope.get());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  RecordProperty("forward_seconds", std::to_string(seconds));
  EXPECT_TRUE(all_finite(res.out));
  EXPECT_GT(max_abs(res.out), 0);
}

}  // namespace
}  // namespace kmla
