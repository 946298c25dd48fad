// RoPE tables (default and YaRN) against closed forms computed in double, and the
// interleaved-pair rotation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "kmla/config.hpp"
#include "kmla/error.hpp"
#include "kmla/rope.hpp"

using namespace kmla;

namespace {

MlaConfig default_rope(double theta) {
  MlaConfig c = MlaConfig::preset("kimi-k3-dspark");  // default rope
  c.rope.theta = theta;
  return c;
}

// Closed forms in double.
double inv_freq_exact(double theta, int i) { return 1.0 / std::pow(theta, 2.0 * i / 64.0); }

double correction_dim(double turns, double base, double orig) {
  return 64.0 * std::log(orig / (turns * 2.0 * M_PI)) / (2.0 * std::log(base));
}

// Error bound of a table entry against cos/sin(p * f) with the exact frequency f.
// The table's frequency is an fp32 pow and reciprocal of the exact one (|rel err| <=
// 2^-21, i.e. a few ulps, generous for glibc's < 1 ulp powf plus 0.5 ulp for 1/x), the
// angle is the fp32 product p * f (0.5 ulp = 2^-24 relative; p itself is exact below
// 2^24), and cos/sin are rounded to fp32 (2^-24 absolute near 1). Since |d cos/d angle|
// <= 1, the entry error is at most angle * (2^-21 + 2^-24) + 2^-24 (times the scale).
double entry_bound(double angle) { return angle * (std::ldexp(1.0, -21) + std::ldexp(1.0, -24)) + std::ldexp(1.0, -24); }

// One 2^17-row default table (theta 10000) shared by the large-position tests; a 1M-row
// table is too slow to build under ASan. Pair 0's angle reaches 1.3e5 rad there, where
// one fp32 ulp of the angle is 2^-6.
constexpr int64_t kBigRows = int64_t(1) << 17;
const RopeTable& big_table() {
  static const auto t = RopeTable::build(default_rope(10000.0), kBigRows);
  return *t;
}

}  // namespace

TEST(Rope, DefaultInvFreqMatchesClosedForm) {
  for (double theta : {10000.0, 50000.0}) {
    const auto t = RopeTable::build(default_rope(theta), 4);
    ASSERT_EQ(t->inv_freq().size(), 32u);
    EXPECT_EQ(t->inv_freq()[0], 1.0f);  // theta^0
    for (int i = 0; i < 32; ++i) {
      const double want = inv_freq_exact(theta, i);
      EXPECT_NEAR(t->inv_freq()[i], want, want * std::ldexp(1.0, -21)) << i;
    }
    EXPECT_EQ(t->cos_sin_scale(), 1.0f);
    EXPECT_EQ(t->type(), RopeType::default_);
  }
}

TEST(Rope, DefaultTableMatchesClosedForm) {
  const double theta = 50000.0;
  const int64_t rows = 4096;
  const auto t = RopeTable::build(default_rope(theta), rows);
  ASSERT_EQ(t->rows(), rows);
  // Row 0 is exactly [1 x 32 | 0 x 32].
  for (int i = 0; i < 32; ++i) {
    EXPECT_EQ(t->row(0)[i], 1.0f);
    EXPECT_EQ(t->row(0)[32 + i], 0.0f);
  }
  // Small positions, tight: the bound is ~1e-7 absolute at p <= 2.
  for (int64_t p = 1; p <= 2; ++p)
    for (int i = 0; i < 32; ++i) {
      const double a = double(p) * inv_freq_exact(theta, i);
      ASSERT_NEAR(t->row(p)[i], std::cos(a), entry_bound(a)) << p << " " << i;
      ASSERT_NEAR(t->row(p)[32 + i], std::sin(a), entry_bound(a)) << p << " " << i;
    }
  // p = 1, pair 0: the frequency is exactly 1, so these are cos(1), sin(1) rounded to fp32.
  EXPECT_EQ(t->row(1)[0], float(std::cos(1.0)));
  EXPECT_EQ(t->row(1)[32], float(std::sin(1.0)));
  // All rows: the bound grows with the angle p * f.
  for (int64_t p = 0; p < rows; p += 7)
    for (int i = 0; i < 32; ++i) {
      const double a = double(p) * inv_freq_exact(theta, i);
      ASSERT_NEAR(t->row(p)[i], std::cos(a), entry_bound(a)) << p << " " << i;
      ASSERT_NEAR(t->row(p)[32 + i], std::sin(a), entry_bound(a)) << p << " " << i;
    }
}

TEST(Rope, DefaultTableLargePositions) {
  const double theta = 10000.0;
  const RopeTable* t = &big_table();
  for (int64_t p = kBigRows - 64; p < kBigRows; ++p)
    for (int i = 0; i < 32; ++i) {
      const double a = double(p) * inv_freq_exact(theta, i);
      ASSERT_NEAR(t->row(p)[i], std::cos(a), entry_bound(a)) << p << " " << i;
      ASSERT_NEAR(t->row(p)[32 + i], std::sin(a), entry_bound(a)) << p << " " << i;
    }
}

TEST(Rope, TableUsesFp32AngleLikeVllm) {
  // SEMANTICS.md: the angle is the fp32 product float(p) * inv_freq (as torch.outer on
  // fp32 tensors), and cos/sin are rounded from double. At large p this differs visibly
  // from the exact angle, so a table built from double angles would fail here.
  const RopeTable* t = &big_table();
  int differs = 0;
  for (int64_t p : {kBigRows / 2, kBigRows - 1, int64_t(100001)})
    for (int i = 0; i < 32; ++i) {
      const float angle = float(p) * t->inv_freq()[i];
      ASSERT_EQ(t->row(p)[i], float(std::cos(double(angle)))) << p << " " << i;
      ASSERT_EQ(t->row(p)[32 + i], float(std::sin(double(angle)))) << p << " " << i;
      const double exact = double(p) * double(t->inv_freq()[i]);
      differs += std::fabs(std::cos(exact) - t->row(p)[i]) > 1e-4;
    }
  EXPECT_GT(differs, 0);
}

TEST(Rope, YarnCorrectionRangeDeepSeekV3) {
  const RopeParams p = MlaConfig::preset("deepseek-v3").rope;
  ASSERT_EQ(p.theta, 10000.0);
  ASSERT_EQ(p.factor, 40.0);
  ASSERT_EQ(p.original_max_position_embeddings, 4096);
  ASSERT_EQ(p.beta_fast, 32.0);
  ASSERT_EQ(p.beta_slow, 1.0);
  // d(32) = 64 ln(4096 / (64 pi)) / (2 ln 10000) = 10.47..., d(1) = 22.51...
  const double lo = std::max(std::floor(correction_dim(32, 10000, 4096)), 0.0);
  const double hi = std::min(std::ceil(correction_dim(1, 10000, 4096)), 63.0);
  EXPECT_EQ(lo, 10.0);
  EXPECT_EQ(hi, 23.0);
  const YarnRange r = yarn_correction_range(p);
  EXPECT_EQ(r.low, 10.0);
  EXPECT_EQ(r.high, 23.0);
}

TEST(Rope, YarnCorrectionRangeOtherConfigsAndClamps) {
  // Kimi-K2: theta 50000, orig 4096, beta 1/1: d(1) = 19.16 -> [19, 20].
  const YarnRange k2 = yarn_correction_range(MlaConfig::preset("kimi-k2").rope);
  EXPECT_EQ(k2.low, 19.0);
  EXPECT_EQ(k2.high, 20.0);
  // DSpark yarn: theta 50000, orig 32768, beta 32/1: d(32) = 15.06, d(1) = 25.31 -> [15, 26].
  const YarnRange ds = yarn_correction_range(MlaConfig::preset("kimi-k3-dspark-yarn").rope);
  EXPECT_EQ(ds.low, std::floor(correction_dim(32, 50000, 32768)));
  EXPECT_EQ(ds.low, 15.0);
  EXPECT_EQ(ds.high, 26.0);
  // A short original context makes d(beta_fast) negative: low clamps to 0.
  RopeParams p;
  p.theta = 10000;
  p.original_max_position_embeddings = 64;
  ASSERT_LT(correction_dim(32, 10000, 64), 0.0);
  EXPECT_EQ(yarn_correction_range(p).low, 0.0);
  // A tiny base makes d(beta_slow) huge: high clamps to rot - 1 = 63.
  p.theta = 2.0;
  p.original_max_position_embeddings = 4096;
  ASSERT_GT(correction_dim(1, 2.0, 4096), 63.0);
  EXPECT_EQ(yarn_correction_range(p).high, 63.0);
}

TEST(Rope, YarnInvFreqBlend) {
  MlaConfig c = MlaConfig::preset("deepseek-v3");  // range [10, 23], factor 40
  const auto t = RopeTable::build(c, 16);
  const auto& f = t->inv_freq();
  const double theta = 10000, factor = 40, lo = 10, hi = 23;
  for (int i = 0; i < 32; ++i) {
    const double extrap = inv_freq_exact(theta, i);
    const double interp = extrap / factor;
    // ramp 0 below low (pure extrapolation), 1 above high (pure interpolation).
    const double ramp = std::clamp((i - lo) / (hi - lo), 0.0, 1.0);
    const double want = interp * ramp + extrap * (1.0 - ramp);
    // fp32 pow, products and one blend add: a few ulps; 2^-20 relative is loose but far
    // below the 40x gap between the two frequencies.
    EXPECT_NEAR(f[i], want, want * std::ldexp(1.0, -20)) << i;
    if (i <= lo) {
      EXPECT_NEAR(f[i], extrap, extrap * std::ldexp(1.0, -21)) << i;
    }
    if (i >= hi) {
      EXPECT_NEAR(f[i], interp, interp * std::ldexp(1.0, -20)) << i;
    }
  }
  // Pure extrapolation is bit-identical to the default rope's frequency.
  const auto d = RopeTable::build(default_rope(10000), 4);
  for (int i = 0; i <= 10; ++i) EXPECT_EQ(f[i], d->inv_freq()[i]) << i;
  for (int i = 11; i < 32; ++i) EXPECT_LT(f[i], d->inv_freq()[i]) << i;
}

TEST(Rope, YarnZeroWidthRamp) {
  // beta_slow = 42.3 puts d(beta_slow) = 9.5 just below d(beta_fast) = 10.47, so
  // low = floor(10.47) = 10 = ceil(9.5) = high. The ramp must not divide by zero: the
  // table widens it to [10, 10.001], i.e. a step between pairs 10 and 11.
  MlaConfig c = MlaConfig::preset("deepseek-v3");
  c.rope.beta_slow = 42.3;
  ASSERT_EQ(std::ceil(correction_dim(42.3, 10000, 4096)), 10.0);
  const YarnRange r = yarn_correction_range(c.rope);
  ASSERT_EQ(r.low, 10.0);
  ASSERT_EQ(r.high, 10.0);
  const auto t = RopeTable::build(c, 4);
  for (int i = 0; i < 32; ++i) {
    const double ex = inv_freq_exact(10000, i);
    const double want = i <= 10 ? ex : ex / 40;
    ASSERT_TRUE(std::isfinite(t->inv_freq()[i])) << i;
    EXPECT_NEAR(t->inv_freq()[i], want, want * std::ldexp(1.0, -20)) << i;
  }
}

TEST(Rope, YarnMscale) {
  EXPECT_EQ(yarn_mscale(1.0, 1.0), 1.0);
  EXPECT_EQ(yarn_mscale(0.5, 1.0), 1.0);
  EXPECT_DOUBLE_EQ(yarn_mscale(40.0, 1.0), 0.1 * std::log(40.0) + 1.0);
  EXPECT_NEAR(yarn_mscale(40.0, 1.0), 1.3688879, 1e-7);
  EXPECT_DOUBLE_EQ(yarn_mscale(40.0, 0.707), 0.0707 * std::log(40.0) + 1.0);
  EXPECT_EQ(yarn_mscale(40.0, 0.0), 1.0);
}

TEST(Rope, YarnCosSinScale) {
  // DeepSeek-V2-Lite: mscale == mscale_all_dim (0.707) -> ratio exactly 1.
  MlaConfig lite = MlaConfig::preset("deepseek-v2-lite");
  const auto a = RopeTable::build(lite, 64);
  EXPECT_EQ(a->cos_sin_scale(), 1.0f);
  EXPECT_EQ(a->row(0)[0], 1.0f);
  // The class defaults mscale 1, mscale_all_dim 0 -> (0.1 ln f + 1) / 1.
  MlaConfig c = MlaConfig::preset("deepseek-v3");
  c.rope.mscale = 1.0;
  c.rope.mscale_all_dim = 0.0;
  const auto b = RopeTable::build(c, 64);
  const double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_EQ(b->cos_sin_scale(), float(m));
  EXPECT_EQ(b->row(0)[0], float(m));  // cos(0) * scale
  EXPECT_EQ(b->row(0)[32], 0.0f);
  // Every entry is the unscaled table times the scale: cos^2 + sin^2 = scale^2.
  for (int64_t p = 0; p < 64; ++p)
    for (int i = 0; i < 32; ++i) {
      const double cs = b->row(p)[i], sn = b->row(p)[32 + i];
      ASSERT_NEAR(cs * cs + sn * sn, m * m, 1e-6) << p << " " << i;
      // Same frequencies as the mscale-ratio-1 table of the same (theta, factor, betas).
      ASSERT_NEAR(b->row(p)[i], a->row(p)[i] * m, 1e-6) << p << " " << i;
    }
  // attn_factor multiplies in as well.
  c.rope.attn_factor = 0.5;
  EXPECT_EQ(RopeTable::build(c, 2)->cos_sin_scale(), float(m * 0.5));
}

TEST(Rope, YarnTableMatchesClosedForm) {
  const MlaConfig c = MlaConfig::preset("kimi-k3-dspark-yarn");  // scale ratio 1
  const auto t = RopeTable::build(c, 2048);
  const YarnRange r = yarn_correction_range(c.rope);
  for (int64_t p = 0; p < 2048; p += 3)
    for (int i = 0; i < 32; ++i) {
      const double ex = inv_freq_exact(50000, i);
      const double ramp = std::clamp((i - r.low) / (r.high - r.low), 0.0, 1.0);
      const double f = ex / 32 * ramp + ex * (1 - ramp);
      const double a = double(p) * f;
      // As entry_bound, with 2^-20 for the blended frequency.
      const double tol = a * (std::ldexp(1.0, -20) + std::ldexp(1.0, -24)) + std::ldexp(1.0, -24);
      ASSERT_NEAR(t->row(p)[i], std::cos(a), tol) << p << " " << i;
      ASSERT_NEAR(t->row(p)[32 + i], std::sin(a), tol) << p << " " << i;
    }
}

TEST(Rope, RowCounts) {
  // rows = original_max_position_embeddings * factor for YaRN.
  MlaConfig c = MlaConfig::preset("deepseek-v3");
  c.rope.original_max_position_embeddings = 64;
  c.rope.factor = 4;
  EXPECT_EQ(RopeTable::build(c)->rows(), 256);
  // A fractional product keeps every position below it (torch.arange(252.5) has 253 rows).
  c.rope.original_max_position_embeddings = 101;
  c.rope.factor = 2.5;
  EXPECT_EQ(c.rope_table_rows(), 253);
  EXPECT_EQ(RopeTable::build(c)->rows(), 253);
  // default: max_position_embeddings.
  MlaConfig d = default_rope(10000);
  d.max_position_embeddings = 300;
  EXPECT_EQ(RopeTable::build(d)->rows(), 300);
  // Override.
  EXPECT_EQ(RopeTable::build(d, 7)->rows(), 7);
  // No rope: an error naming the config.
  try {
    RopeTable::build(MlaConfig::preset("kimi-k3"));
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("kimi-k3"), std::string::npos) << e.what();
  }
}

TEST(Rope, RotateInterleavedPairs) {
  const auto t = RopeTable::build(default_rope(10000), 8);
  float x[64] = {};
  x[0] = 1.0f;  // pair 0 = (1, 0)
  x[1] = 0.0f;
  x[2] = 0.0f;  // pair 1 = (0, 1)
  x[3] = 1.0f;
  x[32] = 2.0f;  // pair 16 = (2, 3): a neox (half-split) rotation would pair x[0] with x[32]
  x[33] = 3.0f;
  x[62] = -1.0f;  // pair 31 = (-1, 0.5)
  x[63] = 0.5f;
  t->rotate(x, 1);
  // Position 1, pair 0: frequency exactly 1 -> rotation by 1 radian.
  EXPECT_FLOAT_EQ(x[0], 0.54030231f);  // cos 1
  EXPECT_FLOAT_EQ(x[1], 0.84147098f);  // sin 1
  // Pair 1: frequency 10000^(-1/32) = 0.74989421; (0, 1) -> (-sin, cos).
  EXPECT_NEAR(x[2], -std::sin(0.74989421), 2e-7);
  EXPECT_NEAR(x[3], std::cos(0.74989421), 2e-7);
  // Pair 16: frequency 10000^(-1/2) = 0.01.
  EXPECT_NEAR(x[32], 2 * std::cos(0.01) - 3 * std::sin(0.01), 5e-7);
  EXPECT_NEAR(x[33], 2 * std::sin(0.01) + 3 * std::cos(0.01), 5e-7);
  // Pair 31: frequency 10000^(-31/32).
  const double f31 = std::pow(10000.0, -31.0 / 32.0);
  EXPECT_NEAR(x[62], -1 * std::cos(f31) - 0.5 * std::sin(f31), 2e-7);
  EXPECT_NEAR(x[63], -1 * std::sin(f31) + 0.5 * std::cos(f31), 2e-7);
  // Untouched pairs stay zero.
  for (int i = 4; i < 32; ++i) EXPECT_EQ(x[i], 0.0f) << i;
  for (int i = 34; i < 62; ++i) EXPECT_EQ(x[i], 0.0f) << i;

  // Position 0 is the identity, bit for bit.
  float y[64];
  for (int i = 0; i < 64; ++i) y[i] = float(i) * 0.37f - 5.0f;
  float z[64];
  std::copy(y, y + 64, z);
  t->rotate(z, 0);
  for (int i = 0; i < 64; ++i) EXPECT_EQ(z[i], y[i]) << i;

  // A rotation keeps each pair's norm (scale 1 for default rope).
  for (int i = 0; i < 64; ++i) z[i] = y[i];
  t->rotate(z, 5);
  for (int i = 0; i < 32; ++i)
    EXPECT_NEAR(std::hypot(z[2 * i], z[2 * i + 1]), std::hypot(y[2 * i], y[2 * i + 1]), 1e-5) << i;
}
