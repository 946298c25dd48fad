// Deterministic random numbers for weights, test data and benchmarks: splitmix64 with
// Box-Muller normals, identical on every platform (unlike std::normal_distribution).
#pragma once

#include <cmath>
#include <cstdint>

namespace kmla {

class Random {
 public:
  explicit Random(uint64_t seed) : state_(seed * 0x2545f4914f6cdd1dull + 1) {}

  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in (0, 1).
  double uniform() { return (double(next() >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
  // Uniform integer in [0, n).
  uint64_t below(uint64_t n) { return next() % n; }
  // Standard normal.
  double normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double r = std::sqrt(-2.0 * std::log(uniform()));
    const double a = 2 * M_PI * uniform();
    spare_ = r * std::sin(a);
    has_spare_ = true;
    return r * std::cos(a);
  }

 private:
  uint64_t state_;
  bool has_spare_ = false;
  double spare_ = 0;
};

}  // namespace kmla
