#include "kmla/rope.hpp"

#include <algorithm>
#include <cmath>

#include "kmla/error.hpp"

namespace kmla {

namespace {

// The per-pair frequencies base^(2i/rot) as torch computes them: fp32 exponent, fp32 pow.
std::vector<float> pos_freqs(double theta, int rot) {
  std::vector<float> f(rot / 2);
  for (int i = 0; i < rot / 2; ++i) {
    const float e = float(2 * i) / float(rot);
    f[i] = std::pow(float(theta), e);
  }
  return f;
}

// d(r) = rot * ln(orig / (r * 2 pi)) / (2 ln base): the pair index whose wavelength
// completes r turns over the original context.
double correction_dim(double turns, int rot, double base, double orig) {
  return rot * std::log(orig / (turns * 2.0 * M_PI)) / (2.0 * std::log(base));
}

}  // namespace

YarnRange yarn_correction_range(const RopeParams& p, int rot) {
  const double orig = double(p.original_max_position_embeddings);
  YarnRange r;
  r.low = std::max(std::floor(correction_dim(p.beta_fast, rot, p.theta, orig)), 0.0);
  r.high = std::min(std::ceil(correction_dim(p.beta_slow, rot, p.theta, orig)), double(rot - 1));
  return r;
}

double yarn_mscale(double factor, double m) {
  return factor <= 1.0 ? 1.0 : 0.1 * m * std::log(factor) + 1.0;
}

std::shared_ptr<const RopeTable> RopeTable::build(const MlaConfig& cfg, int64_t rows) {
  KMLA_CHECK(cfg.use_rope, "RoPE table requested for a layer without RoPE (", cfg.name, ")");
  const int rot = kRopeDim;
  const int half = rot / 2;
  auto t = std::make_shared<RopeTable>();
  t->type_ = cfg.rope.type;
  t->rows_ = rows > 0 ? rows : cfg.rope_table_rows();
  KMLA_CHECK(t->rows_ > 0 && t->rows_ <= (int64_t(1) << 26), "RoPE table row count ", t->rows_,
             " is out of range (1..2^26)");
  const std::vector<float> pf = pos_freqs(cfg.rope.theta, rot);
  t->inv_freq_.resize(half);
  if (cfg.rope.type == RopeType::default_) {
    for (int i = 0; i < half; ++i) t->inv_freq_[i] = 1.0f / pf[i];
  } else {
    const RopeParams& p = cfg.rope;
    YarnRange r = yarn_correction_range(p, rot);
    if (r.low == r.high) r.high += 0.001;  // avoid a zero-width ramp
    const float factor = float(p.factor);
    for (int i = 0; i < half; ++i) {
      const float inv_extrap = 1.0f / pf[i];
      const float inv_interp = 1.0f / (factor * pf[i]);
      float ramp = (float(i) - float(r.low)) / (float(r.high) - float(r.low));
      ramp = std::clamp(ramp, 0.0f, 1.0f);
      const float mask = (1.0f - ramp) * float(p.extrapolation_factor);
      t->inv_freq_[i] = inv_interp * (1.0f - mask) + inv_extrap * mask;
    }
    t->scale_ = float(yarn_mscale(p.factor, p.mscale) / yarn_mscale(p.factor, p.mscale_all_dim) *
                      p.attn_factor);
  }
  t->data_.resize(size_t(t->rows_) * rot);
  for (int64_t pos = 0; pos < t->rows_; ++pos) {
    float* row = t->data_.data() + pos * rot;
    for (int i = 0; i < half; ++i) {
      const float angle = float(pos) * t->inv_freq_[i];  // fp32 product, as torch.outer
      // cos/sin of the fp32 angle, correctly rounded to fp32 (torch's are within 1 ulp).
      float c = float(std::cos(double(angle)));
      float s = float(std::sin(double(angle)));
      if (t->type_ != RopeType::default_) {
        c *= t->scale_;
        s *= t->scale_;
      }
      row[i] = c;
      row[half + i] = s;
    }
  }
  return t;
}

void RopeTable::rotate(float* x, int64_t pos) const {
  const float* r = row(pos);
  for (int i = 0; i < kRopeDim / 2; ++i) {
    const float c = r[i], s = r[kRopeDim / 2 + i];
    const float a = x[2 * i], b = x[2 * i + 1];
    x[2 * i] = a * c - b * s;
    x[2 * i + 1] = a * s + b * c;
  }
}

}  // namespace kmla
