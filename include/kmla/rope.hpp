// RoPE cos/sin tables, built the way vLLM builds them (fp32 throughout), and the
// interleaved-pair (GPT-J) rotation applied to the 64 rope dims.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kmla/config.hpp"

namespace kmla {

// YaRN's correction range [low, high] over the 32 rotation pairs (clamped to [0, 63]).
struct YarnRange {
  double low = 0, high = 0;
};
YarnRange yarn_correction_range(const RopeParams& p, int rot_dim = kRopeDim);

// yarn_get_mscale(s, m) = 1 if s <= 1 else 0.1*m*ln(s) + 1.
double yarn_mscale(double factor, double m);

class RopeTable {
 public:
  // Builds the table for cfg (cfg.use_rope must be true). `rows` overrides the row count
  // (0 = cfg.rope_table_rows()); tests use it to keep tables small.
  static std::shared_ptr<const RopeTable> build(const MlaConfig& cfg, int64_t rows = 0);

  int64_t rows() const { return rows_; }
  RopeType type() const { return type_; }
  // Row p: 32 cos values then 32 sin values, fp32.
  const float* row(int64_t pos) const { return data_.data() + pos * kRopeDim; }
  // The 32 per-pair inverse frequencies the table was built from.
  const std::vector<float>& inv_freq() const { return inv_freq_; }
  // Factor applied to both cos and sin (1 for default rope).
  float cos_sin_scale() const { return scale_; }

  // Rotates x[0..63] in place, in fp32: pairs (x[2i], x[2i+1]) with cos_i, sin_i of row pos.
  // pos must be in [0, rows()); the caller validates positions at the API edge.
  void rotate(float* x, int64_t pos) const;

 private:
  RopeType type_ = RopeType::default_;
  int64_t rows_ = 0;
  float scale_ = 1.0f;
  std::vector<float> inv_freq_;
  std::vector<float> data_;  // [rows, 64]
};

}  // namespace kmla
