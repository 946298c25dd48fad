#include "kmla/weights.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "kmla/error.hpp"
#include "kmla/numeric.hpp"
#include "random.hpp"

namespace kmla {

namespace {

struct Expect {
  const char* name;
  const HostTensor* t;
  bool needed;
  int64_t rows, cols;  // cols = 0 for 1-D
};

std::vector<Expect> expectations(const MlaWeights& w, const MlaConfig& c) {
  const int64_t H = c.local_heads();
  const bool lora = c.q_lora_rank.has_value();
  const int64_t ql = c.q_lora_rank.value_or(0);
  return {
      {"q_a_proj", &w.q_a_proj, lora, ql, c.hidden_size},
      {"q_a_layernorm", &w.q_a_layernorm, lora, ql, 0},
      {"q_b_proj", &w.q_b_proj, lora, H * kQkHeadDim, ql},
      {"q_proj", &w.q_proj, !lora, H * kQkHeadDim, c.hidden_size},
      {"kv_a_proj_with_mqa", &w.kv_a_proj_with_mqa, true, kLatentDim, c.hidden_size},
      {"kv_a_layernorm", &w.kv_a_layernorm, true, kKvLoraRank, 0},
      {"kv_b_proj", &w.kv_b_proj, true, H * kKvBOut, kKvLoraRank},
      {"g_proj", &w.g_proj, c.use_output_gate, H * kVDim, c.hidden_size},
      {"o_proj", &w.o_proj, true, c.hidden_size, H * kVDim},
  };
}

uint16_t to_act(float x, DType t) { return t == DType::bf16 ? float_to_bf16(x) : float_to_fp16(x); }

HostTensor random_matrix(Random& g, int64_t rows, int64_t cols, DType t) {
  HostTensor m(t, {rows, cols});
  const double sd = 1.0 / std::sqrt(double(cols));
  auto* p = m.data<uint16_t>();
  for (int64_t i = 0; i < rows * cols; ++i) p[i] = to_act(float(g.normal() * sd), t);
  return m;
}

HostTensor random_norm(Random& g, int64_t n, DType t) {
  HostTensor m(t, {n});
  auto* p = m.data<uint16_t>();
  for (int64_t i = 0; i < n; ++i) p[i] = to_act(float(1.0 + 0.1 * g.normal()), t);
  return m;
}


// The projections an fp8 checkpoint may quantize, by their names in MlaWeights::fp8.
HostTensor MlaWeights::*projection_field(const std::string& name) {
  static const std::pair<const char*, HostTensor MlaWeights::*> kProjections[] = {
      {"q_a_proj", &MlaWeights::q_a_proj},   {"q_b_proj", &MlaWeights::q_b_proj},
      {"q_proj", &MlaWeights::q_proj},       {"kv_a_proj_with_mqa", &MlaWeights::kv_a_proj_with_mqa},
      {"kv_b_proj", &MlaWeights::kv_b_proj}, {"g_proj", &MlaWeights::g_proj},
      {"o_proj", &MlaWeights::o_proj}};
  for (const auto& [n, field] : kProjections)
    if (name == n) return field;
  return nullptr;
}

float act_value(uint16_t x, DType t) { return t == DType::bf16 ? bf16_to_float(x) : fp16_to_float(x); }

// Rows [r0, r0 + n) of a 2-D tensor.
HostTensor slice_rows(const HostTensor& t, int64_t r0, int64_t n) {
  HostTensor s(t.dtype(), {n, t.dim(1)});
  const size_t row = size_t(t.dim(1)) * dtype_size(t.dtype());
  std::memcpy(s.data<std::byte>(), t.data<std::byte>() + r0 * row, n * row);
  return s;
}

// Columns [c0, c0 + n) of a 2-D tensor.
HostTensor slice_cols(const HostTensor& t, int64_t c0, int64_t n) {
  HostTensor s(t.dtype(), {t.dim(0), n});
  const size_t e = dtype_size(t.dtype());
  for (int64_t r = 0; r < t.dim(0); ++r)
    std::memcpy(s.data<std::byte>() + r * n * e, t.data<std::byte>() + (r * t.dim(1) + c0) * e, n * e);
  return s;
}

}  // namespace

HostTensor Fp8BlockWeight::dequantize(DType act) const {
  HostTensor out(act, {codes.dim(0), codes.dim(1)});
  const auto* c = codes.data<uint8_t>();
  auto* o = out.data<uint16_t>();
  for (int64_t r = 0; r < codes.dim(0); ++r)
    for (int64_t k = 0; k < codes.dim(1); ++k) {
      const float v = e4m3_to_float(c[r * codes.dim(1) + k]) * scale(r, k);
      o[r * codes.dim(1) + k] = to_act(v, act);
    }
  return out;
}

Fp8BlockWeight Fp8BlockWeight::slice_rows(int64_t r0, int64_t n) const {
  Fp8BlockWeight s;
  s.codes = kmla::slice_rows(codes, r0, n);
  const int64_t first = (r0 + row_offset) / kBlock, last = (r0 + row_offset + n - 1) / kBlock;
  s.scale_inv = kmla::slice_rows(scale_inv, first, last - first + 1);
  s.row_offset = int((r0 + row_offset) % kBlock);
  s.col_offset = col_offset;
  return s;
}

Fp8BlockWeight Fp8BlockWeight::slice_cols(int64_t c0, int64_t n) const {
  Fp8BlockWeight s;
  s.codes = kmla::slice_cols(codes, c0, n);
  const int64_t first = (c0 + col_offset) / kBlock, last = (c0 + col_offset + n - 1) / kBlock;
  s.scale_inv = kmla::slice_cols(scale_inv, first, last - first + 1);
  s.row_offset = row_offset;
  s.col_offset = int((c0 + col_offset) % kBlock);
  return s;
}

void Fp8BlockWeight::validate(const char* name) const {
  KMLA_CHECK(codes.dtype() == DType::e4m3 && codes.view().ndim == 2, "fp8 weight ", name,
             " must be a 2-D e4m3 tensor, got ", dtype_name(codes.dtype()), " ", codes.view().shape_str());
  KMLA_CHECK(row_offset >= 0 && row_offset < kBlock && col_offset >= 0 && col_offset < kBlock, "fp8 weight ", name,
             " has block offsets ", row_offset, ", ", col_offset, " outside [0, 128)");
  const int64_t rows = (row_offset + codes.dim(0) + kBlock - 1) / kBlock;
  const int64_t cols = (col_offset + codes.dim(1) + kBlock - 1) / kBlock;
  check_tensor(scale_inv.view(), (std::string(name) + ".weight_scale_inv").c_str(), DType::f32, {rows, cols});
}

void quantize_activation_fp8(const float* x, int64_t n, float* out) {
  for (int64_t g = 0; g < n; g += Fp8BlockWeight::kBlock) {
    const int64_t end = std::min<int64_t>(n, g + Fp8BlockWeight::kBlock);
    float amax = 0.0f;
    for (int64_t i = g; i < end; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    const float s = std::fmax(amax, 1e-10f) / kFp8Max;
    for (int64_t i = g; i < end; ++i) out[i] = e4m3_to_float(float_to_e4m3_sat(x[i] / s)) * s;
  }
}

void MlaWeights::validate(const MlaConfig& c) const {
  c.validate();
  const DType dt = kv_b_proj.dtype();
  KMLA_CHECK(dt == DType::bf16 || dt == DType::f16, "weights must be bf16 or f16, kv_b_proj is ",
             dtype_name(dt));
  for (const Expect& e : expectations(*this, c)) {
    if (!e.needed) {
      KMLA_CHECK(e.t->empty(), "weight ", e.name, " is present but config '", c.name, "' does not use it");
      continue;
    }
    KMLA_CHECK(!e.t->empty(), "weight ", e.name, " is missing (config '", c.name, "')");
    KMLA_CHECK(e.t->dtype() == dt, "weight ", e.name, " has dtype ", dtype_name(e.t->dtype()),
               ", the other weights are ", dtype_name(dt));
    if (e.cols == 0)
      check_tensor(e.t->view(), e.name, dt, {e.rows});
    else
      check_tensor(e.t->view(), e.name, dt, {e.rows, e.cols});
  }
  for (const auto& [name, f] : fp8) {
    const Expect* e = nullptr;
    const auto exp = expectations(*this, c);
    for (const Expect& x : exp)
      if (name == x.name && x.cols != 0) e = &x;
    KMLA_CHECK(e != nullptr && e->needed, "fp8 weight '", name, "' is not a projection of config '", c.name, "'");
    f.validate(name.c_str());
    KMLA_CHECK(f.codes.dim(0) == e->rows && f.codes.dim(1) == e->cols, "fp8 weight ", name, " has shape ",
               f.codes.view().shape_str(), ", expected [", e->rows, ", ", e->cols, "]");
  }
  KMLA_CHECK(std::isfinite(k_scale) && k_scale > 0, "k_scale must be finite and positive, got ", k_scale);
  KMLA_CHECK(std::isfinite(q_scale) && q_scale > 0, "q_scale must be finite and positive, got ", q_scale);
}

MlaWeights MlaWeights::random(const MlaConfig& c, uint64_t seed, DType dt) {
  c.validate();
  KMLA_CHECK(dt == DType::bf16 || dt == DType::f16, "random weights must be bf16 or f16, got ",
             dtype_name(dt));
  Random g(seed);
  const int64_t H = c.local_heads();
  MlaWeights w;
  if (c.q_lora_rank) {
    w.q_a_proj = random_matrix(g, *c.q_lora_rank, c.hidden_size, dt);
    w.q_a_layernorm = random_norm(g, *c.q_lora_rank, dt);
    w.q_b_proj = random_matrix(g, H * kQkHeadDim, *c.q_lora_rank, dt);
  } else {
    w.q_proj = random_matrix(g, H * kQkHeadDim, c.hidden_size, dt);
  }
  w.kv_a_proj_with_mqa = random_matrix(g, kLatentDim, c.hidden_size, dt);
  w.kv_a_layernorm = random_norm(g, kKvLoraRank, dt);
  w.kv_b_proj = random_matrix(g, H * kKvBOut, kKvLoraRank, dt);
  if (c.use_output_gate) w.g_proj = random_matrix(g, H * kVDim, c.hidden_size, dt);
  w.o_proj = random_matrix(g, c.hidden_size, H * kVDim, dt);
  return w;
}

MlaWeights MlaWeights::tp_slice(const MlaConfig& full, int rank, int world) const {
  KMLA_CHECK(full.tp_size == 1, "tp_slice needs the unsliced config");
  const MlaConfig local = full.tp_slice(rank, world);
  validate(full);
  const int64_t h0 = local.first_local_head(), H = local.local_heads();
  MlaWeights w = *this;  // replicated tensors are shared (copy-on-nothing: read only)
  if (full.q_lora_rank)
    w.q_b_proj = slice_rows(q_b_proj, h0 * kQkHeadDim, H * kQkHeadDim);
  else
    w.q_proj = slice_rows(q_proj, h0 * kQkHeadDim, H * kQkHeadDim);
  w.kv_b_proj = slice_rows(kv_b_proj, h0 * kKvBOut, H * kKvBOut);
  if (full.use_output_gate) w.g_proj = slice_rows(g_proj, h0 * kVDim, H * kVDim);
  w.o_proj = slice_cols(o_proj, h0 * kVDim, H * kVDim);
  for (auto& [name, f] : w.fp8) {
    if (name == "q_b_proj" || name == "q_proj") f = f.slice_rows(h0 * kQkHeadDim, H * kQkHeadDim);
    else if (name == "kv_b_proj") f = f.slice_rows(h0 * kKvBOut, H * kKvBOut);
    else if (name == "g_proj") f = f.slice_rows(h0 * kVDim, H * kVDim);
    else if (name == "o_proj") f = f.slice_cols(h0 * kVDim, H * kVDim);
  }
  return w;
}

MlaWeights MlaWeights::to_fp8_blocks(const std::vector<std::string>& names) const {
  constexpr int64_t B = Fp8BlockWeight::kBlock;
  MlaWeights w = *this;  // tensors are shared; converted ones are replaced, never modified
  for (const std::string& name : names) {
    HostTensor MlaWeights::*field = projection_field(name);
    KMLA_CHECK(field != nullptr, "to_fp8_blocks: '", name,
               "' is not a projection (q_a_proj, q_b_proj, q_proj, kv_a_proj_with_mqa, kv_b_proj, g_proj, o_proj)");
    const HostTensor& t = w.*field;
    KMLA_CHECK(!t.empty(), "to_fp8_blocks: weight ", name, " is absent");
    KMLA_CHECK(w.fp8.count(name) == 0, "to_fp8_blocks: weight ", name, " is already fp8");
    KMLA_CHECK((t.dtype() == DType::bf16 || t.dtype() == DType::f16) && t.view().ndim == 2, "to_fp8_blocks: weight ",
               name, " must be a 2-D bf16 or f16 tensor, got ", dtype_name(t.dtype()), " ", t.view().shape_str());
    const int64_t rows = t.dim(0), cols = t.dim(1);
    Fp8BlockWeight f;
    f.codes = HostTensor(DType::e4m3, {rows, cols});
    f.scale_inv = HostTensor(DType::f32, {(rows + B - 1) / B, (cols + B - 1) / B});
    const auto* src = t.data<uint16_t>();
    auto* codes = f.codes.data<uint8_t>();
    for (int64_t r0 = 0; r0 < rows; r0 += B)
      for (int64_t c0 = 0; c0 < cols; c0 += B) {
        const int64_t r1 = std::min(rows, r0 + B), c1 = std::min(cols, c0 + B);
        float amax = 0.0f;
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t c = c0; c < c1; ++c) amax = std::fmax(amax, std::fabs(act_value(src[r * cols + c], t.dtype())));
        const float scale = amax > 0.0f ? amax / kFp8Max : 1.0f;
        f.scale_inv.data<float>()[(r0 / B) * f.scale_inv.dim(1) + c0 / B] = scale;
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t c = c0; c < c1; ++c)
            codes[r * cols + c] = float_to_e4m3_sat(act_value(src[r * cols + c], t.dtype()) / scale);
      }
    w.*field = f.dequantize(t.dtype());
    w.fp8[name] = std::move(f);
  }
  return w;
}

AbsorbedWeights absorb_kv_b(const HostTensor& kv_b, int heads) {
  check_tensor(kv_b.view(), "kv_b_proj", kv_b.dtype(), {int64_t(heads) * kKvBOut, kKvLoraRank});
  KMLA_CHECK(dtype_size(kv_b.dtype()) == 2, "kv_b_proj must be a 16-bit type, got ", dtype_name(kv_b.dtype()));
  AbsorbedWeights a{HostTensor(kv_b.dtype(), {heads, kNopeDim, kKvLoraRank}),
                    HostTensor(kv_b.dtype(), {heads, kKvLoraRank, kVDim})};
  const auto* src = kv_b.data<uint16_t>();
  auto* uk = a.w_uk_t.data<uint16_t>();
  auto* uv = a.w_uv.data<uint16_t>();
  for (int h = 0; h < heads; ++h) {
    const uint16_t* blk = src + int64_t(h) * kKvBOut * kKvLoraRank;  // [256, 512]
    // W_UK_T[h][p][l] = kv_b[h*256 + p][l]: already [128, 512].
    std::memcpy(uk + int64_t(h) * kNopeDim * kKvLoraRank, blk, size_t(kNopeDim) * kKvLoraRank * 2);
    // W_UV[h][l][v] = kv_b[h*256 + 128 + v][l]: a transpose.
    for (int v = 0; v < kVDim; ++v)
      for (int l = 0; l < kKvLoraRank; ++l)
        uv[(int64_t(h) * kKvLoraRank + l) * kVDim + v] = blk[int64_t(kNopeDim + v) * kKvLoraRank + l];
  }
  return a;
}

}  // namespace kmla
