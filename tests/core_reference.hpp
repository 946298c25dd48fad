// Slow, obviously-right reference rounding for the core tests. Each format is described
// by the values of its non-negative codes, computed from the closed form in double; a
// value is rounded by searching that list (nearest, ties to the even code). Nothing here
// shares code with include/kmla/numeric.hpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace kmla_test {

struct RefFormat {
  // mags[k] = magnitude of code k for k = 0 .. max_code. For an IEEE format one more
  // entry follows: the value one step past the largest finite number, standing for the
  // code of infinity (rounding to it means overflow).
  std::vector<double> mags;
  uint32_t max_code = 0;   // largest finite code
  uint32_t sign_bit = 0;
  bool saturating = false; // e4m3fn SATFINITE: anything beyond max becomes max
};

// bf16: sign, 8-bit exponent (bias 127), 7-bit mantissa.
inline RefFormat ref_bf16() {
  RefFormat f;
  for (uint32_t e = 0; e < 255; ++e)
    for (uint32_t m = 0; m < 128; ++m)
      f.mags.push_back(e == 0 ? std::ldexp(double(m), -133) : std::ldexp(1.0 + m / 128.0, int(e) - 127));
  f.max_code = 0x7f7f;
  f.mags.push_back(std::ldexp(1.0, 128));  // "code" 0x7f80 = inf
  f.sign_bit = 0x8000;
  return f;
}

// fp16: sign, 5-bit exponent (bias 15), 10-bit mantissa.
inline RefFormat ref_fp16() {
  RefFormat f;
  for (uint32_t e = 0; e < 31; ++e)
    for (uint32_t m = 0; m < 1024; ++m)
      f.mags.push_back(e == 0 ? std::ldexp(double(m), -24) : std::ldexp(1.0 + m / 1024.0, int(e) - 15));
  f.max_code = 0x7bff;
  f.mags.push_back(65536.0);  // "code" 0x7c00 = inf
  f.sign_bit = 0x8000;
  return f;
}

// e4m3fn: sign, 4-bit exponent (bias 7), 3-bit mantissa; 0x7F is NaN, so 0x7E = 448 is max.
inline RefFormat ref_e4m3() {
  RefFormat f;
  for (uint32_t c = 0; c <= 0x7e; ++c) {
    const uint32_t e = c >> 3, m = c & 7;
    f.mags.push_back(e == 0 ? std::ldexp(double(m), -9) : std::ldexp(1.0 + m / 8.0, int(e) - 7));
  }
  f.max_code = 0x7e;
  f.sign_bit = 0x80;
  f.saturating = true;
  return f;
}

// Round-to-nearest-even of a finite or infinite (not NaN) x into the format's code.
inline uint32_t ref_round(const RefFormat& f, double x) {
  const uint32_t sign = std::signbit(x) ? f.sign_bit : 0;
  const double a = std::fabs(x);
  const double top = f.mags[f.max_code];
  if (f.saturating && a >= top) return sign | f.max_code;
  if (!f.saturating && a >= f.mags.back()) return sign | (f.max_code + 1);
  const auto it = std::lower_bound(f.mags.begin(), f.mags.end(), a);
  const uint32_t hi = uint32_t(it - f.mags.begin());
  if (*it == a) return sign | hi;
  const uint32_t lo = hi - 1;
  const double dlo = a - f.mags[lo], dhi = f.mags[hi] - a;
  if (dlo < dhi) return sign | lo;
  if (dhi < dlo) return sign | hi;
  return sign | ((lo & 1) ? hi : lo);
}

}  // namespace kmla_test
