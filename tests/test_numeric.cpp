// bf16 / fp16 / e4m3 conversions, checked exhaustively against the closed-form value
// of every code and a search-based reference rounder (core_reference.hpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "core_reference.hpp"
#include "kmla/numeric.hpp"

using namespace kmla;
using kmla_test::ref_round;

namespace {

const float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

bool same_bits(float a, float b) { return float_bits(a) == float_bits(b); }

// For every pair of adjacent non-negative codes (lo, lo+1) of a format: the midpoint
// goes to the even one, the floats just below / above it to lo / lo+1, and the same
// for the negated values. The midpoints of these formats are exact in float.
template <class Encode>
void check_midpoints(const kmla_test::RefFormat& f, uint32_t last_lo, Encode enc) {
  int checked = 0;
  for (uint32_t lo = 0; lo <= last_lo; ++lo) {
    const double mid_d = 0.5 * (f.mags[lo] + f.mags[lo + 1]);
    const float mid = float(mid_d);
    ASSERT_EQ(double(mid), mid_d) << "midpoint not exact for code " << lo;
    const uint32_t even = (lo & 1) ? lo + 1 : lo;
    for (int s = 0; s < 2; ++s) {
      const float sg = s ? -1.0f : 1.0f;
      const uint32_t sb = s ? f.sign_bit : 0;
      ASSERT_EQ(enc(sg * mid), sb | even) << "tie at code " << lo;
      ASSERT_EQ(enc(sg * std::nextafter(mid, 0.0f)), sb | lo) << "below tie at code " << lo;
      ASSERT_EQ(enc(sg * std::nextafter(mid, kInf)), sb | (lo + 1)) << "above tie at code " << lo;
      ++checked;
    }
  }
  EXPECT_EQ(checked, int(2 * (last_lo + 1)));
}

// Random floats (fixed seed) with exponents drawn from [emin, emax] against the reference.
template <class Encode>
void check_random(const kmla_test::RefFormat& f, int emin, int emax, int n, Encode enc) {
  std::mt19937 rng(12345);
  for (int i = 0; i < n; ++i) {
    const uint32_t r = rng();
    const uint32_t e = uint32_t(emin) + rng() % uint32_t(emax - emin + 1);
    const float x = bits_float((r & 0x80000000u) | (e << 23) | (r & 0x7fffffu));
    ASSERT_EQ(enc(x), ref_round(f, x)) << "x = " << x << " bits " << std::hex << float_bits(x);
  }
}

}  // namespace

// ---- bf16 ------------------------------------------------------------------------

TEST(Bf16, DecodesEveryCodeToItsClosedForm) {
  for (uint32_t c = 0; c < 65536; ++c) {
    const uint32_t s = c >> 15, e = (c >> 7) & 0xff, m = c & 0x7f;
    const float got = bf16_to_float(uint16_t(c));
    double want;
    if (e == 0xff) {
      if (m) {
        ASSERT_TRUE(std::isnan(got)) << c;
        ASSERT_EQ(std::signbit(got), bool(s)) << c;
        continue;
      }
      want = HUGE_VAL;
    } else {
      want = e == 0 ? std::ldexp(double(m), -133) : std::ldexp(1.0 + m / 128.0, int(e) - 127);
    }
    if (s) want = -want;
    ASSERT_EQ(double(got), want) << c;
    ASSERT_EQ(std::signbit(got), bool(s)) << c;  // -0 stays -0
  }
}

// Every 16-bit code decodes and encodes back to itself; NaN stays NaN with its sign (quieted,
// so the code may gain the quiet bit).
template <class Decode, class Encode>
void expect_every_code_round_trips(Decode decode, Encode encode) {
  for (uint32_t c = 0; c < 65536; ++c) {
    const float f = decode(uint16_t(c));
    const uint16_t back = encode(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(decode(back))) << c;
      ASSERT_EQ(back & 0x8000, c & 0x8000) << c;
    } else {
      ASSERT_EQ(back, c) << c;
    }
  }
}

TEST(Bf16, EveryCodeRoundTrips) { expect_every_code_round_trips(bf16_to_float, float_to_bf16); }

TEST(Bf16, MidpointsRoundToEven) {
  const auto f = kmla_test::ref_bf16();
  // Pairs up to (max finite, inf): the last midpoint is the overflow threshold.
  check_midpoints(f, f.max_code, [](float x) { return uint32_t(float_to_bf16(x)); });
}

TEST(Bf16, AllHighHalvesWithEdgeLowHalves) {
  // The low 16 bits decide the rounding: exact, just below / at / just above half, max.
  const auto f = kmla_test::ref_bf16();
  const uint32_t lows[] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff, 0x4321};
  for (uint32_t hi = 0; hi < 65536; ++hi) {
    if (((hi >> 7) & 0xff) == 0xff) continue;  // inf / NaN have their own test
    for (uint32_t lo : lows) {
      const float x = bits_float((hi << 16) | lo);
      ASSERT_EQ(float_to_bf16(x), ref_round(f, x)) << std::hex << ((hi << 16) | lo);
    }
  }
}

TEST(Bf16, SpecialValues) {
  EXPECT_EQ(float_to_bf16(0.0f), 0x0000);
  EXPECT_EQ(float_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(kInf), 0x7f80);
  EXPECT_EQ(float_to_bf16(-kInf), 0xff80);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // overflow -> inf
  // 1 + 2^-8 is the tie between 1 and 1 + 2^-7: even (1.0) wins; 1 + 3*2^-8 goes up.
  EXPECT_EQ(float_to_bf16(1.00390625f), 0x3f80);
  EXPECT_EQ(float_to_bf16(1.01171875f), 0x3f82);
  // Float subnormals: 2^-133 is the smallest bf16 subnormal; half of it ties to zero.
  EXPECT_EQ(float_to_bf16(std::ldexp(1.0f, -133)), 0x0001);
  EXPECT_EQ(float_to_bf16(std::ldexp(1.0f, -134)), 0x0000);
  EXPECT_EQ(float_to_bf16(-std::ldexp(3.0f, -134)), 0x8002);
  // A NaN whose payload lives only in the low 16 bits must not truncate to inf.
  const uint16_t snan = float_to_bf16(bits_float(0x7f800001u));
  EXPECT_TRUE(std::isnan(bf16_to_float(snan)));
  const uint16_t nnan = float_to_bf16(bits_float(0xff800001u));
  EXPECT_TRUE(std::isnan(bf16_to_float(nnan)));
  EXPECT_EQ(nnan & 0x8000, 0x8000);
  EXPECT_TRUE(std::isnan(round_bf16(kNaN)));
  EXPECT_TRUE(same_bits(round_bf16(-0.0f), -0.0f));
}

// ---- fp16 ------------------------------------------------------------------------

TEST(Fp16, DecodesEveryCodeToItsClosedForm) {
  for (uint32_t c = 0; c < 65536; ++c) {
    const uint32_t s = c >> 15, e = (c >> 10) & 0x1f, m = c & 0x3ff;
    const float got = fp16_to_float(uint16_t(c));
    double want;
    if (e == 0x1f) {
      if (m) {
        ASSERT_TRUE(std::isnan(got)) << c;
        ASSERT_EQ(std::signbit(got), bool(s)) << c;
        continue;
      }
      want = HUGE_VAL;
    } else {
      want = e == 0 ? std::ldexp(double(m), -24) : std::ldexp(1.0 + m / 1024.0, int(e) - 15);
    }
    if (s) want = -want;
    ASSERT_EQ(double(got), want) << c;
    ASSERT_EQ(std::signbit(got), bool(s)) << c;
  }
}

TEST(Fp16, EveryCodeRoundTrips) { expect_every_code_round_trips(fp16_to_float, float_to_fp16); }

TEST(Fp16, MidpointsRoundToEven) {
  const auto f = kmla_test::ref_fp16();
  check_midpoints(f, f.max_code, [](float x) { return uint32_t(float_to_fp16(x)); });
}

TEST(Fp16, RandomFloatsMatchReference) {
  // Exponents 2^-30 .. 2^20 span zero-flush, subnormals, normals and overflow.
  check_random(kmla_test::ref_fp16(), 127 - 30, 127 + 20, 300000,
               [](float x) { return uint32_t(float_to_fp16(x)); });
}

TEST(Fp16, SpecialValues) {
  EXPECT_EQ(float_to_fp16(65520.0f), 0x7c00);  // the tie above 65504 rounds to even: inf
  EXPECT_EQ(float_to_fp16(-65520.0f), 0xfc00);
  EXPECT_EQ(float_to_fp16(65519.99f), 0x7bff);
  EXPECT_EQ(float_to_fp16(std::nextafter(65520.0f, 0.0f)), 0x7bff);
  EXPECT_EQ(float_to_fp16(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_fp16(1e6f), 0x7c00);
  EXPECT_EQ(float_to_fp16(kInf), 0x7c00);
  EXPECT_EQ(float_to_fp16(-kInf), 0xfc00);
  EXPECT_EQ(float_to_fp16(0.0f), 0x0000);
  EXPECT_EQ(float_to_fp16(-0.0f), 0x8000);
  EXPECT_EQ(float_to_fp16(1.0f), 0x3c00);
  // Subnormals: 2^-24 is code 1; 2^-25 ties to 0 (even); 3*2^-25 ties to code 2.
  EXPECT_EQ(float_to_fp16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(float_to_fp16(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(float_to_fp16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(float_to_fp16(std::ldexp(3.0f, -25)), 0x0002);
  EXPECT_EQ(float_to_fp16(-std::ldexp(1.0f, -25)), 0x8000);
  // The largest subnormal rounding up into the smallest normal (2^-14 = 0x0400).
  EXPECT_EQ(float_to_fp16(std::ldexp(2047.0f, -25)), 0x0400);
  EXPECT_EQ(float_to_fp16(std::ldexp(1.0f, -30)), 0x0000);
  const uint16_t n = float_to_fp16(-kNaN);
  EXPECT_TRUE(std::isnan(fp16_to_float(n)));
  EXPECT_EQ(n & 0x8000, 0x8000);
  EXPECT_TRUE(std::isnan(fp16_to_float(float_to_fp16(bits_float(0x7f800001u)))));
}

// ---- e4m3fn ----------------------------------------------------------------------

TEST(E4m3, DecodesEveryCodeToItsClosedForm) {
  for (uint32_t c = 0; c < 256; ++c) {
    const uint32_t s = c >> 7, e = (c >> 3) & 0xf, m = c & 7;
    const float got = e4m3_to_float(uint8_t(c));
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(got)) << c;
      continue;
    }
    double want = e == 0 ? m * std::ldexp(1.0, -9) : std::ldexp(1.0, int(e) - 7) * (1.0 + m / 8.0);
    if (s) want = -want;
    EXPECT_EQ(double(got), want) << c;
    EXPECT_EQ(std::signbit(got), bool(s)) << c;
  }
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_TRUE(same_bits(e4m3_to_float(0x80), -0.0f));
}

TEST(E4m3, EveryCodeRoundTrips) {
  for (uint32_t c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    EXPECT_EQ(float_to_e4m3_sat(e4m3_to_float(uint8_t(c))), c) << c;
  }
}

TEST(E4m3, MidpointsRoundToEven) {
  const auto f = kmla_test::ref_e4m3();
  // All 126 gaps between the 127 non-negative finite codes, both signs.
  check_midpoints(f, f.max_code - 1, [](float x) { return uint32_t(float_to_e4m3_sat(x)); });
}

TEST(E4m3, RandomFloatsMatchReference) {
  // 2^-14 .. 2^12: below the smallest subnormal through saturation.
  check_random(kmla_test::ref_e4m3(), 127 - 14, 127 + 12, 300000,
               [](float x) { return uint32_t(float_to_e4m3_sat(x)); });
}

TEST(E4m3, SaturatesAndHandlesSpecials) {
  EXPECT_EQ(float_to_e4m3_sat(448.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3_sat(std::nextafter(448.0f, kInf)), 0x7e);
  EXPECT_EQ(float_to_e4m3_sat(464.0f), 0x7e);  // would round to 480 (the NaN code's slot)
  EXPECT_EQ(float_to_e4m3_sat(479.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3_sat(1e30f), 0x7e);
  EXPECT_EQ(float_to_e4m3_sat(-1e30f), 0xfe);
  EXPECT_EQ(float_to_e4m3_sat(kInf), 0x7e);
  EXPECT_EQ(float_to_e4m3_sat(-kInf), 0xfe);
  EXPECT_EQ(float_to_e4m3_sat(kNaN), 0x7f);
  EXPECT_EQ(float_to_e4m3_sat(-kNaN), 0x7f);
  EXPECT_EQ(float_to_e4m3_sat(0.0f), 0x00);
  EXPECT_EQ(float_to_e4m3_sat(-0.0f), 0x80);
  // 2^-10 is half the smallest subnormal: ties to (signed) zero; just above goes to 1.
  EXPECT_EQ(float_to_e4m3_sat(std::ldexp(1.0f, -10)), 0x00);
  EXPECT_EQ(float_to_e4m3_sat(-std::ldexp(1.0f, -10)), 0x80);
  EXPECT_EQ(float_to_e4m3_sat(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
  EXPECT_EQ(float_to_e4m3_sat(std::ldexp(1.0f, -30)), 0x00);
  // 336 is the tie between 320 (0x7A) and 352 (0x7B): even wins.
  EXPECT_EQ(float_to_e4m3_sat(336.0f), 0x7a);
  EXPECT_EQ(float_to_e4m3_sat(2.0f), 0x40);
}

TEST(E4m3, ScaledClampedRules) {
  // NaN -> -448: fmaxf(NaN, -448) returns -448 before the clamp to +448.
  EXPECT_EQ(e4m3_scaled_clamped(kNaN, 1.0f), 0xfe);
  EXPECT_EQ(e4m3_scaled_clamped(-kNaN, 0.5f), 0xfe);
  EXPECT_EQ(e4m3_scaled_clamped(kInf, 1.0f), 0x7e);
  EXPECT_EQ(e4m3_scaled_clamped(-kInf, 1.0f), 0xfe);
  EXPECT_EQ(e4m3_scaled_clamped(1.0f, 2.0f), 0x40);
  EXPECT_EQ(e4m3_scaled_clamped(300.0f, 2.0f), 0x7e);
  EXPECT_EQ(e4m3_scaled_clamped(-300.0f, 2.0f), 0xfe);
  // inf * 0 is NaN, which the clamp also sends to -448.
  EXPECT_EQ(e4m3_scaled_clamped(kInf, 0.0f), 0xfe);
}

TEST(E4m3, ScaledClampedIsMultiplyThenRound) {
  // The code must be the rounding of the fp32 product x * scale_inv, not of x / scale.
  // Search for inputs where the two differ (so the test could tell them apart) and check
  // every input against the product rule.
  const auto f = kmla_test::ref_e4m3();
  int differing = 0, checked = 0;
  for (float scale : {0.1f, 0.3f, 0.7f, 1.1f, 3.0f, 7.0f, 0.013f}) {
    const float inv = 1.0f / scale;
    for (uint32_t lo = 0; lo + 1 <= f.max_code; ++lo) {
      const double mid = 0.5 * (f.mags[lo] + f.mags[lo + 1]);
      float x = float(mid * scale);
      for (int k = 0; k < 4; ++k) x = std::nextafter(x, 0.0f);
      for (int k = 0; k < 9; ++k, x = std::nextafter(x, kInf)) {
        const float prod = x * inv;
        const uint32_t by_mul = ref_round(f, prod);
        const uint32_t by_div = ref_round(f, x / scale);
        ASSERT_EQ(e4m3_scaled_clamped(x, inv), by_mul) << "x " << x << " scale " << scale;
        differing += by_mul != by_div;
        ++checked;
      }
    }
  }
  EXPECT_GT(differing, 0) << "no input separates multiply from divide; the test is vacuous";
  EXPECT_GT(checked, 1000);
}
