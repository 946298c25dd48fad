// The CPU backend's public stages against plain scalar fp64 computations written here
// (never the production code), plus a smoke test of MlaLayer::forward on a mixed batch.
//
// Tolerances. The stages compute in fp32 and round their outputs once to the output dtype.
// Against an fp64 reference on the same (exactly representable) inputs:
//   |got - ref| <= ulp_rel * |ref| + abs_tol
// where ulp_rel is one unit in the last place of the output dtype relative to the value
// (2^-8 for bf16, 2^-10 for f16: the final rounding costs at most half of that, the other
// half covers an fp32 result that sits next to a rounding boundary), and abs_tol = 5e-5
// covers fp32 accumulation: a 576-wide dot product of O(1) values carries ~24 * 2^-24 * 24
// absolute error (~3.5e-5 before the 192^-0.5 scale), which moves softmax weights by a few
// 1e-6 relative, and values near zero have a tiny ulp. LSEs are fp32: 1e-4 absolute.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <ostream>
#include <random>
#include <vector>

#include "kmla/batch.hpp"
#include "kmla/cache.hpp"
#include "kmla/layer.hpp"
#include "kmla/numeric.hpp"
#include "kmla/stages.hpp"

namespace kmla {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kAbsTol = 5e-5;
constexpr double kLseTol = 1e-4;

double ulp_rel(DType t) {
  switch (t) {
    case DType::bf16:
      return 1.0 / 256;
    case DType::f16:
      return 1.0 / 1024;
    default:
      return 1e-6;  // f32 output: only fp32 accumulation error
  }
}

// ---- small helpers -----------------------------------------------------------------

struct Rng {
  std::mt19937_64 gen;
  explicit Rng(uint64_t seed) : gen(seed) {}
  double normal() { return std::normal_distribution<double>(0.0, 1.0)(gen); }
  int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen); }
};

// A host tensor of `dtype` filled with N(0, sd^2) values (rounded/quantized to the dtype).
HostTensor random_tensor(Rng& rng, DType dtype, std::initializer_list<int64_t> dims,
                         double sd = 1.0) {
  HostTensor t(dtype, dims);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float x = float(rng.normal() * sd);
    switch (dtype) {
      case DType::bf16:
        t.data<uint16_t>()[i] = float_to_bf16(x);
        break;
      case DType::f16:
        t.data<uint16_t>()[i] = float_to_fp16(x);
        break;
      case DType::f32:
        t.data<float>()[i] = x;
        break;
      case DType::e4m3:
        t.data<uint8_t>()[i] = float_to_e4m3_sat(x);
        break;
      default:
        ADD_FAILURE() << "unsupported dtype";
    }
  }
  return t;
}

// Element i of a float-like tensor as double (e4m3 times `scale`).
double value(const HostTensor& t, int64_t i, double scale = 1.0) {
  switch (t.dtype()) {
    case DType::bf16:
      return bf16_to_float(t.data<uint16_t>()[i]);
    case DType::f16:
      return fp16_to_float(t.data<uint16_t>()[i]);
    case DType::f32:
      return t.data<float>()[i];
    case DType::e4m3:
      return double(e4m3_to_float(t.data<uint8_t>()[i])) * scale;
    default:
      ADD_FAILURE() << "unsupported dtype";
      return 0;
  }
}

std::vector<double> values(const HostTensor& t, double scale = 1.0) {
  std::vector<double> v(size_t(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[size_t(i)] = value(t, i, scale);
  return v;
}

HostTensor tensor_of(DType dtype, std::initializer_list<int64_t> dims,
                     const std::vector<float>& v) {
  HostTensor t(dtype, dims);
  EXPECT_EQ(int64_t(v.size()), t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (dtype == DType::f32)
      t.data<float>()[i] = v[size_t(i)];
    else if (dtype == DType::bf16)
      t.data<uint16_t>()[i] = float_to_bf16(v[size_t(i)]);
    else
      t.data<uint16_t>()[i] = float_to_fp16(v[size_t(i)]);
  }
  return t;
}

// The reference: one (query, head) row attending to n keys in fp64.
// out[dv] = sum_j softmax_j(scale * q.k_j) v_j; lse = log sum_j exp(scale * q.k_j).
void ref_row(const double* q, int dq, const std::vector<const double*>& keys,
             const std::vector<const double*>& vals, int dv, double scale, double* out,
             double* lse) {
  const size_t n = keys.size();
  if (n == 0) {
    std::fill(out, out + dv, 0.0);
    *lse = -kInf;
    return;
  }
  std::vector<double> s(n);
  for (size_t j = 0; j < n; ++j) {
    double d = 0;
    for (int i = 0; i < dq; ++i) d += q[i] * keys[j][i];
    s[j] = scale * d;
  }
  const double m = *std::max_element(s.begin(), s.end());
  double sum = 0;
  for (double& x : s) sum += (x = std::exp(x - m));
  for (int d = 0; d < dv; ++d) {
    double acc = 0;
    for (size_t j = 0; j < n; ++j) acc += s[j] * vals[j][d];
    out[d] = acc / sum;
  }
  *lse = m + std::log(sum);
}

void expect_close(const HostTensor& got, const std::vector<double>& ref, const char* what) {
  ASSERT_EQ(got.numel(), int64_t(ref.size())) << what;
  const double rel = ulp_rel(got.dtype());
  int bad = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = value(got, i), r = ref[size_t(i)];
    ASSERT_TRUE(std::isfinite(g)) << what << " element " << i << " is " << g;
    if (std::fabs(g - r) > rel * std::fabs(r) + kAbsTol && ++bad <= 5)
      ADD_FAILURE() << what << " element " << i << ": got " << g << ", reference " << r;
  }
  EXPECT_EQ(bad, 0) << what;
}

void expect_lse(const HostTensor& got, const std::vector<double>& ref, const char* what) {
  ASSERT_EQ(got.numel(), int64_t(ref.size())) << what;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = got.data<float>()[i], r = ref[size_t(i)];
    if (std::isinf(r)) {
      EXPECT_EQ(g, r) << what << " lse " << i;
    } else {
      EXPECT_NEAR(g, r, kLseTol * std::max(1.0, std::fabs(r))) << what << " lse " << i;
    }
  }
}

// ---- prefill attention ----------------------------------------------------------------

struct PrefillRef {
  std::vector<double> out, lse;
};

// fp64 varlen attention on dequantized copies of q [Tq,H,192], k [Tk,H,192], v [Tk,H,128].
PrefillRef prefill_reference(const std::vector<double>& q, const std::vector<double>& k,
                             const std::vector<double>& v, int H, const std::vector<int64_t>& cu_q,
                             const std::vector<int64_t>& cu_k, bool causal, double scale) {
  const int64_t Tq = cu_q.back();
  PrefillRef r{std::vector<double>(size_t(Tq) * H * kVDim), std::vector<double>(size_t(Tq) * H)};
  for (size_t s = 0; s + 1 < cu_q.size(); ++s) {
    const int64_t nq = cu_q[s + 1] - cu_q[s], nk = cu_k[s + 1] - cu_k[s];
    for (int64_t i = 0; i < nq; ++i)
      for (int h = 0; h < H; ++h) {
        const int64_t vis = causal ? std::clamp<int64_t>(nk - nq + i + 1, 0, nk) : nk;
        std::vector<const double*> ks, vs;
        for (int64_t j = 0; j < vis; ++j) {
          ks.push_back(&k[size_t(((cu_k[s] + j) * H + h) * kQkHeadDim)]);
          vs.push_back(&v[size_t(((cu_k[s] + j) * H + h) * kVDim)]);
        }
        const int64_t row = (cu_q[s] + i) * H + h;
        ref_row(&q[size_t(row * kQkHeadDim)], kQkHeadDim, ks, vs, kVDim, scale,
                &r.out[size_t(row * kVDim)], &r.lse[size_t(row)]);
      }
  }
  return r;
}

std::vector<int64_t> cumulative(const std::vector<int64_t>& lens) {
  std::vector<int64_t> cu(lens.size() + 1, 0);
  for (size_t i = 0; i < lens.size(); ++i) cu[i + 1] = cu[i] + lens[i];
  return cu;
}

void run_prefill_case(const std::vector<int64_t>& q_lens, const std::vector<int64_t>& k_lens,
                      bool causal, DType in_dtype, DType out_dtype, int H, uint64_t seed) {
  Rng rng(seed);
  const auto cu_q = cumulative(q_lens), cu_k = cumulative(k_lens);
  const int64_t Tq = cu_q.back(), Tk = cu_k.back();
  const double sd = in_dtype == DType::e4m3 ? 2.0 : 1.0;
  HostTensor q = random_tensor(rng, in_dtype, {Tq, H, kQkHeadDim}, sd);
  HostTensor k = random_tensor(rng, in_dtype, {Tk, H, kQkHeadDim}, sd);
  HostTensor v = random_tensor(rng, in_dtype, {Tk, H, kVDim}, sd);
  HostTensor out(out_dtype, {Tq, H, kVDim}), lse(DType::f32, {Tq, H});
  const double scale = 1.0 / std::sqrt(192.0) * (in_dtype == DType::e4m3 ? 0.25 : 1.0);
  prefill_attention(q.view(), k.view(), v.view(), cu_q, cu_k, causal, scale, out.view(),
                    lse.view());
  const PrefillRef ref =
      prefill_reference(values(q), values(k), values(v), H, cu_q, cu_k, causal, scale);
  expect_close(out, ref.out, "prefill output");
  expect_lse(lse, ref.lse, "prefill");
}

TEST(PrefillAttention, CausalOddLengthsThreeHeads) {
  run_prefill_case({1, 7, 33}, {1, 7, 33}, true, DType::bf16, DType::bf16, 3, 1);
}

TEST(PrefillAttention, NonCausalOddLengthsThreeHeads) {
  run_prefill_case({1, 7, 33}, {33, 1, 7}, false, DType::bf16, DType::bf16, 3, 2);
}

TEST(PrefillAttention, CausalMoreQueriesThanKeysGivesEmptyRows) {
  // Bottom-right aligned: 7 queries over 3 keys leave the first 4 rows without keys.
  Rng rng(3);
  const std::vector<int64_t> cu_q{0, 7}, cu_k{0, 3};
  HostTensor q = random_tensor(rng, DType::bf16, {7, 2, kQkHeadDim});
  HostTensor k = random_tensor(rng, DType::bf16, {3, 2, kQkHeadDim});
  HostTensor v = random_tensor(rng, DType::bf16, {3, 2, kVDim});
  HostTensor out(DType::bf16, {7, 2, kVDim}), lse(DType::f32, {7, 2});
  prefill_attention(q.view(), k.view(), v.view(), cu_q, cu_k, true, 0.07, out.view(), lse.view());
  const PrefillRef ref =
      prefill_reference(values(q), values(k), values(v), 2, cu_q, cu_k, true, 0.07);
  expect_close(out, ref.out, "prefill output");
  expect_lse(lse, ref.lse, "prefill");
  for (int i = 0; i < 8; ++i) EXPECT_EQ(lse.data<float>()[i], -INFINITY);
}

TEST(PrefillAttention, EmptySequencesAndF16) {
  // A sequence without queries, one without keys (its rows are empty), f16 in and out.
  run_prefill_case({0, 5, 4}, {3, 0, 9}, false, DType::f16, DType::f16, 2, 4);
}

TEST(PrefillAttention, CrossesQueryAndKeyBlocks) {
  // 600 tokens cross the kernel's 128-query and 512-key blocks; f32 output checks the
  // online softmax tightly.
  run_prefill_case({600}, {600}, true, DType::bf16, DType::f32, 1, 5);
}

TEST(PrefillAttention, Fp8Inputs) {
  run_prefill_case({7, 33}, {7, 33}, true, DType::e4m3, DType::bf16, 3, 6);
}

// ---- decode attention ------------------------------------------------------------------

struct DecodeSetup {
  LatentCache cache;
  BatchMetadata md;
};

// Plans `reqs` (query_len, context_len) over a cache whose blocks are handed out in a
// random permutation, poisons every byte with 0xFF (NaN in every format) and the unused
// block-table entries with garbage, then writes random rows for every position in use.
DecodeSetup make_decode_setup(CacheFormat fmt, int block_size,
                              const std::vector<std::pair<int, int>>& reqs, int threshold,
                              bool non_causal, Rng& rng, float k_scale = 0.5f) {
  int64_t blocks = 0;
  for (auto [ql, ctx] : reqs) blocks += (ql + ctx + block_size - 1) / block_size;
  blocks += 3;  // a few blocks no request owns
  std::vector<int32_t> perm(static_cast<size_t>(blocks));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng.gen);
  std::vector<RequestSpec> specs;
  size_t next = 0;
  for (auto [ql, ctx] : reqs) {
    RequestSpec s{ql, ctx, {}};
    const int64_t need = (ql + ctx + block_size - 1) / block_size;
    for (int64_t b = 0; b < need; ++b) s.block_table.push_back(perm[next++]);
    specs.push_back(std::move(s));
  }
  DecodeSetup d;
  d.cache = LatentCache::allocate(fmt, block_size, blocks, k_scale);
  std::memset(d.cache.base(), 0xFF, size_t(d.cache.geometry().block_stride) * size_t(blocks));
  BatchOptions opt;
  opt.decode_threshold = threshold;
  opt.non_causal_decode = non_causal;
  opt.keep_order = true;
  d.md = plan_batch(specs, d.cache.geometry(), opt);
  for (int r = 0; r < d.md.num_requests; ++r) {
    const int64_t need = (d.md.seq_lens[r] + block_size - 1) / block_size;
    for (int64_t b = need; b < d.md.max_blocks_per_request; ++b)
      d.md.block_tables[size_t(r) * d.md.max_blocks_per_request + b] = 1 << 30;
    for (int64_t p = 0; p < d.md.seq_lens[r]; ++p) {
      float row[kLatentDim];
      for (float& x : row) x = float(rng.normal());
      d.cache.write_row(d.md.slot_of(r, p), row);
    }
  }
  return d;
}

struct DecodeCase {
  CacheFormat format;
  int block_size;
};

void PrintTo(const DecodeCase& c, std::ostream* os) {
  *os << cache_format_name(c.format) << " cache, block size " << c.block_size;
}

class DecodeAttentionTest : public ::testing::TestWithParam<DecodeCase> {};

void run_decode_case(CacheFormat fmt, int block_size, const std::vector<std::pair<int, int>>& reqs,
                     int threshold, bool non_causal, int H, uint64_t seed) {
  Rng rng(seed);
  DecodeSetup d = make_decode_setup(fmt, block_size, reqs, threshold, non_causal, rng);
  ASSERT_EQ(d.md.num_decodes, int(reqs.size()));
  const int64_t Td = d.md.num_decode_tokens;
  const DType q_dtype = fmt == CacheFormat::fp8    ? DType::e4m3
                        : fmt == CacheFormat::fp16 ? DType::f16
                                                   : DType::bf16;
  const DType out_dtype = fmt == CacheFormat::fp16 ? DType::f16 : DType::bf16;
  const float q_scale = 0.25f;
  HostTensor q =
      random_tensor(rng, q_dtype, {Td, H, kLatentDim}, q_dtype == DType::e4m3 ? 4.0 : 1.0);
  HostTensor out(out_dtype, {Td, H, kKvLoraRank}), lse(DType::f32, {Td, H});
  const double scale = 1.0 / std::sqrt(192.0);
  decode_attention(q.view(), q_scale, d.cache, d.md, scale, out.view(), lse.view());

  // Reference: keys are the cache rows read back through the codec, in fp64.
  const std::vector<double> qd = values(q, q_scale);
  std::vector<double> ref_out(size_t(Td) * H * kKvLoraRank), ref_lse(size_t(Td) * H);
  for (int r = 0; r < d.md.num_decodes; ++r) {
    const int64_t S = d.md.seq_lens[r];
    std::vector<std::vector<double>> keys(static_cast<size_t>(S), std::vector<double>(kLatentDim));
    for (int64_t p = 0; p < S; ++p) {
      float row[kLatentDim];
      d.cache.read_row(d.md.slot_of(r, p), row);
      std::copy(row, row + kLatentDim, keys[size_t(p)].begin());
    }
    for (int i = 0; i < d.md.query_lens[r]; ++i) {
      const int64_t vis = non_causal ? S : S - (d.md.query_lens[r] - 1 - i);
      std::vector<const double*> ks;
      for (int64_t p = 0; p < vis; ++p) ks.push_back(keys[size_t(p)].data());
      for (int h = 0; h < H; ++h) {
        const int64_t row = (d.md.query_start[r] + i) * H + h;
        ref_row(&qd[size_t(row * kLatentDim)], kLatentDim, ks, ks, kKvLoraRank, scale,
                &ref_out[size_t(row * kKvLoraRank)], &ref_lse[size_t(row)]);
      }
    }
  }
  expect_close(out, ref_out, "decode output");
  expect_lse(lse, ref_lse, "decode");
}

TEST_P(DecodeAttentionTest, SingleAndMultiTokenCausal) {
  // (query_len, context_len): single tokens, a causal 3-token block, a 2-token block, and
  // a request with no new tokens.
  run_decode_case(GetParam().format, GetParam().block_size,
                  {{1, 1}, {1, 36}, {3, 60}, {0, 5}, {2, 140}}, 4, false, 3,
                  10 + GetParam().block_size);
}

TEST_P(DecodeAttentionTest, MultiTokenNonCausal) {
  run_decode_case(GetParam().format, GetParam().block_size, {{4, 9}, {1, 20}, {3, 1}}, 4, true, 2,
                  20 + GetParam().block_size);
}

INSTANTIATE_TEST_SUITE_P(
    FormatsAndBlockSizes, DecodeAttentionTest,
    ::testing::Values(DecodeCase{CacheFormat::bf16, 1}, DecodeCase{CacheFormat::bf16, 16},
                      DecodeCase{CacheFormat::bf16, 64}, DecodeCase{CacheFormat::fp16, 16},
                      DecodeCase{CacheFormat::fp8, 1}, DecodeCase{CacheFormat::fp8, 16},
                      DecodeCase{CacheFormat::fp8, 64}, DecodeCase{CacheFormat::fp8_ds_mla, 1},
                      DecodeCase{CacheFormat::fp8_ds_mla, 16},
                      DecodeCase{CacheFormat::fp8_ds_mla, 64}),
    [](const ::testing::TestParamInfo<DecodeCase>& info) {
      return std::string(cache_format_name(info.param.format)) + "_bs" +
             std::to_string(info.param.block_size);
    });

TEST(DecodeAttention, LongSequenceSplitsKeys) {
  // One request over 1300 keys: several 512-key blocks, split across threads and merged.
  run_decode_case(CacheFormat::bf16, 16, {{1, 1299}}, 1, false, 2, 30);
}

TEST(DecodeAttention, ManyHeadsCrossRowChunks) {
  // 3 tokens x 100 heads = 300 query rows: the 256-row chunks split a token's heads.
  run_decode_case(CacheFormat::bf16, 16, {{3, 20}}, 4, false, 100, 31);
}

// ---- merge ------------------------------------------------------------------------------

TEST(MergeAttnStates, WeightsByLse) {
  Rng rng(40);
  const int T = 5, H = 2, D = 16;
  HostTensor p = random_tensor(rng, DType::bf16, {T, H, D});
  HostTensor s = random_tensor(rng, DType::bf16, {T, H, D});
  HostTensor pl = random_tensor(rng, DType::f32, {T, H}, 3.0);
  HostTensor sl = random_tensor(rng, DType::f32, {T, H}, 3.0);
  HostTensor out(DType::bf16, {T, H, D}), ol(DType::f32, {T, H});
  merge_attn_states(p.view(), pl.view(), s.view(), sl.view(), T, out.view(), ol.view());
  std::vector<double> ref(size_t(T * H * D)), ref_lse(size_t(T * H));
  for (int i = 0; i < T * H; ++i) {
    const double a = value(pl, i), b = value(sl, i), m = std::max(a, b);
    const double wa = std::exp(a - m), wb = std::exp(b - m);
    for (int d = 0; d < D; ++d)
      ref[size_t(i * D + d)] = (value(p, i * D + d) * wa + value(s, i * D + d) * wb) / (wa + wb);
    ref_lse[size_t(i)] = m + std::log(wa + wb);
  }
  expect_close(out, ref, "merge output");
  expect_lse(ol, ref_lse, "merge");
}

TEST(MergeAttnStates, EmptySidesAndInfinities) {
  // Row 0: empty prefix; row 1: empty suffix; row 2: both empty; row 3: +inf prefix LSE
  // (counts as empty); row 4: +inf on both sides.
  const int T = 5, H = 1, D = 2;
  HostTensor p = tensor_of(DType::f32, {T, H, D}, {9, 9, 1, 2, 0, 0, 7, 7, 0, 0});
  HostTensor s = tensor_of(DType::f32, {T, H, D}, {3, 4, 8, 8, 0, 0, 5, 6, 0, 0});
  const float inf = INFINITY;
  HostTensor pl = tensor_of(DType::f32, {T, H}, {-inf, 0.5f, -inf, inf, inf});
  HostTensor sl = tensor_of(DType::f32, {T, H}, {1.5f, -inf, -inf, 2.0f, inf});
  HostTensor out(DType::f32, {T, H, D}), ol(DType::f32, {T, H});
  merge_attn_states(p.view(), pl.view(), s.view(), sl.view(), T, out.view(), ol.view());
  const std::vector<float> want_out{3, 4, 1, 2, 0, 0, 5, 6, 0, 0};
  const std::vector<float> want_lse{1.5f, 0.5f, -inf, 2.0f, -inf};
  for (int i = 0; i < T * D; ++i) EXPECT_EQ(out.data<float>()[i], want_out[size_t(i)]) << i;
  for (int i = 0; i < T; ++i) EXPECT_EQ(ol.data<float>()[i], want_lse[size_t(i)]) << i;
}

TEST(MergeAttnStates, RowsPastPrefixCopySuffix) {
  // The prefix has only 2 rows; rows 2.. take the suffix (and its LSE) unchanged. The
  // merged LSE output is optional.
  const int T = 4, H = 1, D = 2;
  HostTensor p = tensor_of(DType::bf16, {2, H, D}, {1, 1, 2, 2});
  HostTensor pl = tensor_of(DType::f32, {2, H}, {0.0f, 0.0f});
  HostTensor s = tensor_of(DType::bf16, {T, H, D}, {3, 3, 4, 4, 5, 6, 7, 8});
  HostTensor sl = tensor_of(DType::f32, {T, H}, {0.0f, 0.0f, 9.0f, -INFINITY});
  HostTensor out(DType::bf16, {T, H, D}), ol(DType::f32, {T, H});
  merge_attn_states(p.view(), pl.view(), s.view(), sl.view(), 2, out.view(), ol.view());
  const std::vector<double> want{2, 2, 3, 3, 5, 6, 7, 8};
  for (int i = 0; i < T * D; ++i) EXPECT_EQ(value(out, i), want[size_t(i)]) << i;
  EXPECT_FLOAT_EQ(ol.data<float>()[0], std::log(2.0f));
  EXPECT_EQ(ol.data<float>()[2], 9.0f);
  EXPECT_EQ(ol.data<float>()[3], -INFINITY);
  merge_attn_states(p.view(), pl.view(), s.view(), sl.view(), 2, out.view(), TensorView{});
  for (int i = 0; i < T * D; ++i) EXPECT_EQ(value(out, i), want[size_t(i)]) << i;
}

TEST(MergeAttnStates, AttentionOverUnionEqualsMergedParts) {
  // softmax attention over keys A u B equals the LSE merge of attention over A and over B.
  Rng rng(41);
  const int H = 3;
  const std::vector<int64_t> cu_q{0, 5, 8};
  const std::vector<int64_t> cu_a{0, 9, 10}, cu_b{0, 14, 17}, cu_ab{0, 23, 27};
  HostTensor q = random_tensor(rng, DType::f32, {8, H, kQkHeadDim});
  HostTensor ka = random_tensor(rng, DType::f32, {10, H, kQkHeadDim});
  HostTensor va = random_tensor(rng, DType::f32, {10, H, kVDim});
  HostTensor kb = random_tensor(rng, DType::f32, {17, H, kQkHeadDim});
  HostTensor vb = random_tensor(rng, DType::f32, {17, H, kVDim});
  // The union, sequence by sequence: [A_s | B_s].
  HostTensor kab(DType::f32, {27, H, kQkHeadDim}), vab(DType::f32, {27, H, kVDim});
  auto append = [&](const HostTensor& src, int64_t row0, int64_t n, HostTensor& dst, int64_t at,
                    int64_t w) {
    std::memcpy(dst.data<float>() + at * H * w, src.data<float>() + row0 * H * w,
                size_t(n * H * w) * 4);
  };
  int64_t at = 0;
  for (int s = 0; s < 2; ++s) {
    const int64_t na = cu_a[s + 1] - cu_a[s], nb = cu_b[s + 1] - cu_b[s];
    append(ka, cu_a[s], na, kab, at, kQkHeadDim);
    append(va, cu_a[s], na, vab, at, kVDim);
    append(kb, cu_b[s], nb, kab, at + na, kQkHeadDim);
    append(vb, cu_b[s], nb, vab, at + na, kVDim);
    at += na + nb;
  }
  auto attend = [&](const HostTensor& k, const HostTensor& v, const std::vector<int64_t>& cu,
                    HostTensor& out, HostTensor& lse) {
    out = HostTensor(DType::f32, {8, H, kVDim});
    lse = HostTensor(DType::f32, {8, H});
    prefill_attention(q.view(), k.view(), v.view(), cu_q, cu, false, 0.08, out.view(), lse.view());
  };
  HostTensor oa, la, ob, lb, oab, lab;
  attend(ka, va, cu_a, oa, la);
  attend(kb, vb, cu_b, ob, lb);
  attend(kab, vab, cu_ab, oab, lab);
  HostTensor merged(DType::f32, {8, H, kVDim}), merged_lse(DType::f32, {8, H});
  merge_attn_states(oa.view(), la.view(), ob.view(), lb.view(), 8, merged.view(),
                    merged_lse.view());
  for (int64_t i = 0; i < merged.numel(); ++i)
    EXPECT_NEAR(merged.data<float>()[i], oab.data<float>()[i], 1e-5) << i;
  for (int64_t i = 0; i < merged_lse.numel(); ++i)
    EXPECT_NEAR(merged_lse.data<float>()[i], lab.data<float>()[i], 1e-5) << i;
}

// ---- cache insert -------------------------------------------------------------------

std::vector<std::byte> bytes_of(const LatentCache& c) {
  const size_t n = size_t(c.geometry().block_stride) * size_t(c.num_blocks());
  return std::vector<std::byte>(c.base(), c.base() + n);
}

// The row the writer must store for token t, computed here: [kv | rotated k_pe], the rope
// part rounded to bf16 except for a plain fp8 cache.
std::vector<float> expected_row(const HostTensor& kv, const HostTensor& pe, int64_t t,
                                const RopeTable* rope, int64_t pos, CacheFormat fmt,
                                int64_t layer = 0, int64_t layers = 1) {
  std::vector<float> row(kLatentDim);
  for (int i = 0; i < kKvLoraRank; ++i)
    row[size_t(i)] = float(value(kv, (t * layers + layer) * kKvLoraRank + i));
  std::vector<double> x(kRopeDim);
  for (int i = 0; i < kRopeDim; ++i) x[size_t(i)] = value(pe, (t * layers + layer) * kRopeDim + i);
  for (int i = 0; i < kRopeDim; ++i) {
    float y = float(x[size_t(i)]);
    if (rope) {
      const float c = rope->row(pos)[i / 2], s = rope->row(pos)[kRopeDim / 2 + i / 2];
      const float a = float(x[size_t(i & ~1)]), b = float(x[size_t(i | 1)]);
      y = (i % 2 == 0) ? a * c - b * s : a * s + b * c;
      if (fmt != CacheFormat::fp8) y = round_bf16(y);
    }
    row[size_t(kKvLoraRank + i)] = y;
  }
  return row;
}

MlaConfig rope_config() {
  MlaConfig c;
  c.use_rope = true;
  c.rope.theta = 50000;
  c.max_position_embeddings = 64;
  return c;
}

TEST(CacheInsert, WritesRowsAndSkipsNegativeSlots) {
  for (CacheFormat fmt : {CacheFormat::bf16, CacheFormat::fp8, CacheFormat::fp8_ds_mla}) {
    Rng rng(50);
    auto rope = RopeTable::build(rope_config());
    LatentCache cache = LatentCache::allocate(fmt, 4, 3, 0.5f);
    std::memset(cache.base(), 0x5A, bytes_of(cache).size());
    HostTensor kv = random_tensor(rng, DType::bf16, {4, kKvLoraRank});
    HostTensor pe = random_tensor(rng, DType::bf16, {4, kRopeDim});
    std::vector<int64_t> slots{-1, 3, -1, 10}, pos{5, 17, 2, 63};
    HostTensor slot_t(DType::i64, {4}), pos_t(DType::i64, {4});
    std::memcpy(slot_t.data<int64_t>(), slots.data(), 32);
    std::memcpy(pos_t.data<int64_t>(), pos.data(), 32);
    const std::vector<std::byte> before = bytes_of(cache);
    cache_insert(kv.view(), pe.view(), pos_t.view(), rope.get(), slot_t.view(), cache);
    const std::vector<std::byte> after = bytes_of(cache);
    const size_t e = cache.geometry().entry_bytes();
    for (int64_t slot = 0; slot < cache.geometry().num_slots(); ++slot) {
      const size_t off = size_t(cache.slot_ptr(slot) - cache.base());
      if (slot == 3 || slot == 10) continue;
      EXPECT_EQ(std::memcmp(before.data() + off, after.data() + off, e), 0)
          << cache_format_name(fmt) << " slot " << slot << " changed";
    }
    for (int t : {1, 3}) {
      const std::vector<float> want = expected_row(kv, pe, t, rope.get(), pos[size_t(t)], fmt);
      std::vector<std::byte> enc(e);
      cache.codec().encode(want.data(), enc.data());
      EXPECT_EQ(std::memcmp(enc.data(), cache.slot_ptr(slots[size_t(t)]), e), 0)
          << cache_format_name(fmt) << " token " << t;
    }
  }
}

TEST(CacheInsert, BadSlotOrPositionThrowsAndLeavesCacheUntouched) {
  Rng rng(51);
  auto rope = RopeTable::build(rope_config());
  LatentCache cache = LatentCache::allocate(CacheFormat::bf16, 4, 2);
  HostTensor kv = random_tensor(rng, DType::bf16, {3, kKvLoraRank});
  HostTensor pe = random_tensor(rng, DType::bf16, {3, kRopeDim});
  HostTensor slot_t(DType::i64, {3}), pos_t(DType::i64, {3});
  const std::vector<std::byte> before = bytes_of(cache);
  // The bad slot comes last: nothing before it may have been written either.
  int64_t slots[3] = {0, 5, 8};
  std::memcpy(slot_t.data<int64_t>(), slots, sizeof slots);
  EXPECT_THROW(cache_insert(kv.view(), pe.view(), pos_t.view(), rope.get(), slot_t.view(), cache),
               Error);
  EXPECT_EQ(bytes_of(cache), before);
  slots[2] = 7;
  std::memcpy(slot_t.data<int64_t>(), slots, sizeof slots);
  int64_t pos[3] = {0, 1, 64};  // the table has 64 rows
  std::memcpy(pos_t.data<int64_t>(), pos, sizeof pos);
  EXPECT_THROW(cache_insert(kv.view(), pe.view(), pos_t.view(), rope.get(), slot_t.view(), cache),
               Error);
  EXPECT_EQ(bytes_of(cache), before);
  // Without RoPE positions are ignored.
  cache_insert(kv.view(), pe.view(), pos_t.view(), nullptr, slot_t.view(), cache);
  EXPECT_NE(bytes_of(cache), before);
  // Mismatched shapes and dtypes.
  HostTensor pe_short = random_tensor(rng, DType::bf16, {2, kRopeDim});
  EXPECT_THROW(
      cache_insert(kv.view(), pe_short.view(), pos_t.view(), nullptr, slot_t.view(), cache), Error);
  HostTensor pe_f16 = random_tensor(rng, DType::f16, {3, kRopeDim});
  EXPECT_THROW(cache_insert(kv.view(), pe_f16.view(), pos_t.view(), nullptr, slot_t.view(), cache),
               Error);
  HostTensor slot_i32(DType::i32, {3});
  EXPECT_THROW(cache_insert(kv.view(), pe.view(), pos_t.view(), nullptr, slot_i32.view(), cache),
               Error);
}

TEST(CacheInsert, LayersWriteEachCache) {
  Rng rng(52);
  auto rope = RopeTable::build(rope_config());
  const int T = 3, L = 3;
  const CacheFormat fmts[L] = {CacheFormat::bf16, CacheFormat::fp8, CacheFormat::fp8_ds_mla};
  std::vector<LatentCache> caches;
  for (CacheFormat f : fmts) caches.push_back(LatentCache::allocate(f, 2, 4, 2.0f));
  std::vector<LatentCache*> ptrs;
  for (LatentCache& c : caches) ptrs.push_back(&c);
  HostTensor kv = random_tensor(rng, DType::bf16, {T, L, kKvLoraRank});
  HostTensor pe = random_tensor(rng, DType::bf16, {T, L, kRopeDim});
  const int64_t slots[T] = {6, -1, 1}, pos[T] = {3, 4, 9};
  HostTensor slot_t(DType::i64, {T}), pos_t(DType::i64, {T});
  std::memcpy(slot_t.data<int64_t>(), slots, sizeof slots);
  std::memcpy(pos_t.data<int64_t>(), pos, sizeof pos);
  cache_insert_layers(kv.view(), pe.view(), pos_t.view(), rope.get(), slot_t.view(), ptrs);
  for (int l = 0; l < L; ++l)
    for (int t : {0, 2}) {
      const std::vector<float> want = expected_row(kv, pe, t, rope.get(), pos[t], fmts[l], l, L);
      std::vector<std::byte> enc(caches[size_t(l)].geometry().entry_bytes());
      caches[size_t(l)].codec().encode(want.data(), enc.data());
      EXPECT_EQ(std::memcmp(enc.data(), caches[size_t(l)].slot_ptr(slots[t]), enc.size()), 0)
          << "layer " << l << " token " << t;
    }
  // A slot outside one layer's cache throws before any layer is written.
  LatentCache small = LatentCache::allocate(CacheFormat::bf16, 2, 1);
  std::vector<LatentCache*> mixed{ptrs[0], &small, ptrs[2]};
  const std::vector<std::byte> before0 = bytes_of(caches[0]);
  std::memset(caches[0].base(), 0, before0.size());
  EXPECT_THROW(
      cache_insert_layers(kv.view(), pe.view(), pos_t.view(), rope.get(), slot_t.view(), mixed),
      Error);
  for (std::byte b : bytes_of(caches[0])) ASSERT_EQ(b, std::byte{0});
  std::vector<LatentCache*> too_few{ptrs[0], ptrs[1]};
  EXPECT_THROW(
      cache_insert_layers(kv.view(), pe.view(), pos_t.view(), rope.get(), slot_t.view(), too_few),
      Error);
}

// ---- bad inputs ----------------------------------------------------------------------

TEST(StageValidation, BadInputsThrow) {
  Rng rng(60);
  DecodeSetup d = make_decode_setup(CacheFormat::bf16, 16, {{1, 10}, {2, 5}}, 2, false, rng);
  const int64_t Td = d.md.num_decode_tokens;
  HostTensor q = random_tensor(rng, DType::bf16, {Td, 2, kLatentDim});
  HostTensor out(DType::bf16, {Td, 2, kKvLoraRank}), lse(DType::f32, {Td, 2});
  decode_attention(q.view(), 1.0f, d.cache, d.md, 0.07, out.view(), lse.view());  // fine
  HostTensor q_short = random_tensor(rng, DType::bf16, {Td - 1, 2, kLatentDim});
  EXPECT_THROW(decode_attention(q_short.view(), 1.0f, d.cache, d.md, 0.07, out.view(), lse.view()),
               Error);
  HostTensor lse_bad(DType::f32, {Td, 3});
  EXPECT_THROW(decode_attention(q.view(), 1.0f, d.cache, d.md, 0.07, out.view(), lse_bad.view()),
               Error);
  HostTensor q8 = random_tensor(rng, DType::e4m3, {Td, 2, kLatentDim});
  EXPECT_THROW(decode_attention(q8.view(), 0.0f, d.cache, d.md, 0.07, out.view(), lse.view()),
               Error);
  HostTensor out_i32(DType::i32, {Td, 2, kKvLoraRank});
  EXPECT_THROW(decode_attention(q.view(), 1.0f, d.cache, d.md, 0.07, out_i32.view(), lse.view()),
               Error);
  {
    BatchMetadata md = d.md;
    md.block_size = 8;  // planned for another cache
    EXPECT_THROW(decode_attention(q.view(), 1.0f, d.cache, md, 0.07, out.view(), lse.view()),
                 Error);
    md = d.md;
    md.block_tables[0] = int32_t(d.cache.num_blocks());  // a block the cache does not have
    EXPECT_THROW(decode_attention(q.view(), 1.0f, d.cache, md, 0.07, out.view(), lse.view()),
                 Error);
    md = d.md;
    md.seq_lens[1] += 1;  // lengths that do not add up
    EXPECT_THROW(decode_attention(q.view(), 1.0f, d.cache, md, 0.07, out.view(), lse.view()),
                 Error);
    md = d.md;
    md.query_lens[1] = 3;  // a decode above its threshold
    md.query_start[2] += 1;
    md.seq_lens[1] += 1;
    EXPECT_THROW(decode_attention(q.view(), 1.0f, d.cache, md, 0.07, out.view(), lse.view()),
                 Error);
  }

  HostTensor pq = random_tensor(rng, DType::bf16, {5, 2, kQkHeadDim});
  HostTensor pk = random_tensor(rng, DType::bf16, {6, 2, kQkHeadDim});
  HostTensor pv = random_tensor(rng, DType::bf16, {6, 2, kVDim});
  HostTensor po(DType::bf16, {5, 2, kVDim}), pl(DType::f32, {5, 2});
  auto prefill = [&](const std::vector<int64_t>& cq, const std::vector<int64_t>& ck,
                     const TensorView& k) {
    prefill_attention(pq.view(), k, pv.view(), cq, ck, true, 0.07, po.view(), pl.view());
  };
  prefill({0, 2, 5}, {0, 3, 6}, pk.view());                             // fine
  EXPECT_THROW(prefill({0, 3, 2, 5}, {0, 3, 3, 6}, pk.view()), Error);  // decreasing cu_q
  EXPECT_THROW(prefill({0, 2, 4}, {0, 3, 6}, pk.view()), Error);        // cu_q ends early
  EXPECT_THROW(prefill({0, 2, 5}, {0, 6}, pk.view()), Error);           // sizes differ
  EXPECT_THROW(prefill({1, 2, 5}, {0, 3, 6}, pk.view()), Error);        // does not start at 0
  EXPECT_THROW(prefill({}, {}, pk.view()), Error);
  HostTensor pk_f16 = random_tensor(rng, DType::f16, {6, 2, kQkHeadDim});
  EXPECT_THROW(prefill({0, 2, 5}, {0, 3, 6}, pk_f16.view()), Error);  // mixed dtypes
  HostTensor pk_heads = random_tensor(rng, DType::bf16, {6, 3, kQkHeadDim});
  EXPECT_THROW(prefill({0, 2, 5}, {0, 3, 6}, pk_heads.view()), Error);  // head mismatch

  HostTensor m_out(DType::bf16, {5, 2, kVDim});
  EXPECT_THROW(
      merge_attn_states(po.view(), pl.view(), po.view(), pl.view(), 6, m_out.view(), TensorView{}),
      Error);
  HostTensor m_lse(DType::f32, {5, 3});
  EXPECT_THROW(merge_attn_states(po.view(), pl.view(), po.view(), m_lse.view(), 5, m_out.view(),
                                 TensorView{}),
               Error);
  HostTensor m_f16(DType::f16, {5, 2, kVDim});
  EXPECT_THROW(
      merge_attn_states(po.view(), pl.view(), po.view(), pl.view(), 5, m_f16.view(), TensorView{}),
      Error);
}

// ---- layer smoke test ------------------------------------------------------------------

struct SmokeBatch {
  BatchMetadata md;
  HostTensor positions, hidden, out;
};

SmokeBatch make_batch(const std::vector<RequestSpec>& reqs, const LatentCache& cache, int pad,
                      int64_t workspace, bool non_causal, int hidden, DType act, Rng& rng) {
  BatchOptions opt;
  opt.workspace_tokens = workspace;
  opt.non_causal_decode = non_causal;
  int64_t tokens = 0;
  for (const RequestSpec& r : reqs) tokens += r.query_len;
  opt.num_rows = tokens + pad;
  SmokeBatch b;
  b.md = plan_batch(reqs, cache.geometry(), opt);
  b.positions = HostTensor(DType::i64, {b.md.num_rows});
  std::copy(b.md.positions.begin(), b.md.positions.end(), b.positions.data<int64_t>());
  b.hidden = random_tensor(rng, act, {b.md.num_rows, hidden});
  b.out = HostTensor(act, {b.md.num_rows, hidden});
  std::memset(b.out.data<void>(), 0x7F, b.out.bytes());  // garbage the layer must overwrite
  return b;
}

void run_smoke(MlaConfig cfg, CacheFormat fmt, LayerOptions opts, uint64_t seed) {
  Rng rng(seed);
  const DType act = opts.activation;
  MlaWeights w = MlaWeights::random(cfg, seed, act);
  w.k_scale = 0.5f;  // the fp8 cache below is scaled by the same k_scale
  MlaLayer layer(cfg, w, opts, cfg.use_rope ? RopeTable::build(cfg, 256) : nullptr);
  LatentCache cache = LatentCache::allocate(fmt, 16, 8, w.k_scale);
  const std::vector<int32_t> table_a{3, 0}, table_b{5, 1, 7}, table_c{2, 6};
  // Step 1: fresh prefills fill the context of requests A (5 tokens) and B (20 tokens).
  {
    SmokeBatch b = make_batch({{5, 0, table_a}, {20, 0, table_b}}, cache, 0, 65536,
                              cfg.non_causal_multi_token_decode, cfg.hidden_size, act, rng);
    layer.forward(b.positions.view(), b.hidden.view(), &b.md, cache, b.out.view());
  }
  // Step 2: a decode (A), a prefill with context (B, chunked through an 8-token workspace),
  // a fresh prefill (C) and two padding rows.
  SmokeBatch b = make_batch({{1, 5, table_a}, {6, 20, table_b}, {9, 0, table_c}}, cache, 2, 8,
                            cfg.non_causal_multi_token_decode, cfg.hidden_size, act, rng);
  ASSERT_EQ(b.md.num_decodes, 1);
  ASSERT_EQ(b.md.num_context_prefills, 1);
  ASSERT_GT(b.md.context_chunks.size(), 1u);
  layer.forward(b.positions.view(), b.hidden.view(), &b.md, cache, b.out.view());
  const int64_t hs = cfg.hidden_size;
  for (int64_t i = 0; i < b.md.num_tokens * hs; ++i)
    ASSERT_TRUE(std::isfinite(value(b.out, i))) << i;
  double energy = 0;
  for (int64_t i = 0; i < b.md.num_tokens * hs; ++i) energy += std::fabs(value(b.out, i));
  EXPECT_GT(energy, 0.0);
  for (int64_t i = b.md.num_tokens * hs; i < b.md.num_rows * hs; ++i)
    ASSERT_EQ(value(b.out, i), 0.0) << i;
  // A profiling run (no metadata) returns zeros and leaves the cache alone.
  const std::vector<std::byte> before = bytes_of(cache);
  std::memset(b.out.data<void>(), 0x7F, b.out.bytes());
  layer.forward(b.positions.view(), b.hidden.view(), nullptr, cache, b.out.view());
  for (int64_t i = 0; i < b.out.numel(); ++i) ASSERT_EQ(value(b.out, i), 0.0);
  EXPECT_EQ(bytes_of(cache), before);
}

MlaConfig small_config() {
  MlaConfig c;
  c.name = "smoke";
  c.hidden_size = 128;
  c.num_heads = 2;
  c.q_lora_rank = 64;
  c.use_output_gate = true;
  return c;
}

TEST(LayerSmoke, QLoraGateMixedBatch) { run_smoke(small_config(), CacheFormat::bf16, {}, 70); }

TEST(LayerSmoke, RopeFp8CacheFp8Prefill) {
  MlaConfig c = small_config();
  c.use_output_gate = false;
  c.use_rope = true;
  c.max_position_embeddings = 256;
  LayerOptions o;
  o.fp8_prefill = true;
  o.num_threads = 2;
  run_smoke(c, CacheFormat::fp8, o, 71);
}

TEST(LayerSmoke, NoQLoraF16DsMlaNonCausal) {
  MlaConfig c = small_config();
  c.q_lora_rank.reset();
  c.non_causal_multi_token_decode = true;
  LayerOptions o;
  o.activation = DType::f16;
  o.num_threads = 1;
  run_smoke(c, CacheFormat::fp8_ds_mla, o, 72);
}

TEST(LayerSmoke, BadCallsThrowBeforeTouchingTheCache) {
  MlaConfig cfg = small_config();
  cfg.use_rope = true;
  cfg.max_position_embeddings = 256;
  Rng rng(73);
  // Construction checks.
  {
    MlaConfig tp = cfg;
    tp.num_heads = 4;
    tp = tp.tp_slice(0, 2);
    EXPECT_THROW(MlaLayer(tp, MlaWeights::random(tp, 1)), Error);  // no all-reduce, no partial
    LayerOptions partial;
    partial.partial_output = true;
    EXPECT_NO_THROW(MlaLayer(tp, MlaWeights::random(tp, 1), partial));
    LayerOptions f16;
    f16.activation = DType::f16;
    EXPECT_THROW(MlaLayer(cfg, MlaWeights::random(cfg, 1), f16), Error);  // bf16 weights
    MlaConfig nope = small_config();
    EXPECT_THROW(MlaLayer(nope, MlaWeights::random(nope, 1), {}, RopeTable::build(cfg, 16)), Error);
  }
  MlaLayer layer(cfg, MlaWeights::random(cfg, 2), {}, RopeTable::build(cfg, 32));
  LatentCache cache = LatentCache::allocate(CacheFormat::bf16, 16, 4);
  SmokeBatch b = make_batch({{4, 0, {0}}, {3, 0, {1}}}, cache, 1, 65536, false, cfg.hidden_size,
                            DType::bf16, rng);
  const std::vector<std::byte> before = bytes_of(cache);
  // A position past the 32-row RoPE table, on the last real row.
  b.positions.data<int64_t>()[6] = 32;
  try {
    layer.forward(b.positions.view(), b.hidden.view(), &b.md, cache, b.out.view());
    ADD_FAILURE() << "position past the RoPE table did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("32"), std::string::npos) << e.what();
  }
  EXPECT_EQ(bytes_of(cache), before);
  b.positions.data<int64_t>()[6] = 2;
  // Metadata planned for another block size, a cache slot out of range, wrong shapes.
  BatchMetadata md = b.md;
  md.block_size = 8;
  EXPECT_THROW(layer.forward(b.positions.view(), b.hidden.view(), &md, cache, b.out.view()), Error);
  md = b.md;
  md.slot_mapping[3] = 64;
  EXPECT_THROW(layer.forward(b.positions.view(), b.hidden.view(), &md, cache, b.out.view()), Error);
  md = b.md;
  md.causal_decode = false;  // the config is causal
  EXPECT_THROW(layer.forward(b.positions.view(), b.hidden.view(), &md, cache, b.out.view()), Error);
  HostTensor short_out(DType::bf16, {b.md.num_rows - 1, cfg.hidden_size});
  EXPECT_THROW(layer.forward(b.positions.view(), b.hidden.view(), &b.md, cache, short_out.view()),
               Error);
  HostTensor pos_i32(DType::i32, {b.md.num_rows});
  EXPECT_THROW(layer.forward(pos_i32.view(), b.hidden.view(), &b.md, cache, b.out.view()), Error);
  EXPECT_EQ(bytes_of(cache), before);
  // The same batch, valid, runs.
  layer.forward(b.positions.view(), b.hidden.view(), &b.md, cache, b.out.view());
  EXPECT_NE(bytes_of(cache), before);
}

}  // namespace
}  // namespace kmla
