// Scalar number formats used by the layer: bf16, fp16 and fp8 e4m3 (the "fn" variant:
// no infinities, 0x7F/0xFF are NaN, largest finite value 448). All conversions from
// float round to nearest, ties to even. These are plain inline functions so host code,
// tests and (later) device code share one definition.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KMLA_HD __host__ __device__
#else
#define KMLA_HD
#endif

namespace kmla {

// Largest finite e4m3 value; the fp8 writers clamp to +-kFp8Max before converting.
inline constexpr float kFp8Max = 448.0f;

KMLA_HD inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

KMLA_HD inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// ---- bf16 ----------------------------------------------------------------------
KMLA_HD inline float bf16_to_float(uint16_t b) { return bits_float(uint32_t(b) << 16); }

// NaN stays NaN (quiet, sign kept); overflow rounds to +-inf as IEEE does.
KMLA_HD inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

KMLA_HD inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

// ---- fp16 ----------------------------------------------------------------------
KMLA_HD inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in float
    const float v = float(man) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

KMLA_HD inline uint16_t float_to_fp16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (abs < 0x38800000u) {
    // Below the smallest normal (2^-14): result is a multiple of 2^-24. Adding 0.5
    // shifts the value so the hardware's RNE at that quantum does the rounding.
    const float v = bits_float(abs) + 0.5f;
    return uint16_t(sign | uint16_t(float_bits(v) - 0x3f000000u));
  }
  uint32_t r = abs + 0xfffu + ((abs >> 13) & 1u);  // RNE on the 13 dropped bits
  return uint16_t(sign | uint16_t((r - 0x38000000u) >> 13));
}

KMLA_HD inline float round_fp16(float f) { return fp16_to_float(float_to_fp16(f)); }

// ---- fp8 e4m3fn ----------------------------------------------------------------
KMLA_HD inline float e4m3_to_float(uint8_t c) {
  const float sign = (c & 0x80u) ? -1.0f : 1.0f;
  const uint32_t exp = (c >> 3) & 0xfu;
  const uint32_t man = c & 0x7u;
  if (exp == 0xf && man == 0x7) return NAN;
  if (exp == 0) return sign * float(man) * 0.001953125f;  // man * 2^-9
  return sign * bits_float(((exp + 120u) << 23) | (man << 20));
}

// Saturating conversion (like __nv_cvt_float_to_fp8 with __NV_SATFINITE): finite values
// beyond 448 and infinities become +-448; NaN becomes 0x7F.
KMLA_HD inline uint8_t float_to_e4m3_sat(float f) {
  const uint32_t u = float_bits(f);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return 0x7f;
  if (abs >= 0x43e00000u) return uint8_t(sign | 0x7e);  // >= 448
  if (abs < 0x3c800000u) {
    // Below 2^-6 the codes are multiples of 2^-9 (subnormals, 0..7, and 8 = 2^-6).
    // Adding 2^14 puts the value where float's ulp is 2^-9, so the FPU rounds for us.
    const float v = bits_float(abs) + 16384.0f;
    return uint8_t(sign | uint8_t(float_bits(v) - 0x46800000u));
  }
  // Normal range: keep 3 mantissa bits, RNE on the 20 dropped bits. A carry may reach
  // 464 (0x7F would be NaN), which saturates to 448.
  uint32_t r = abs + 0x7ffffu + ((abs >> 20) & 1u);
  uint32_t code = (r >> 20) - (120u << 3);
  if (code > 0x7e) code = 0x7e;
  return uint8_t(sign | code);
}

// The plain-fp8 writers' rule: multiply by a precomputed reciprocal scale, clamp to
// +-448 with fmaxf/fminf (so NaN becomes -448: fmaxf(NaN, -448) = -448), then convert.
KMLA_HD inline uint8_t e4m3_scaled_clamped(float x, float scale_inv) {
  const float s = std::fmin(std::fmax(x * scale_inv, -kFp8Max), kFp8Max);
  return float_to_e4m3_sat(s);
}

}  // namespace kmla
