// fp8 block-quantized projections (DeepSeek-V3 / Kimi-K2 checkpoints) run as W8A8: the
// activation quantization and the checkpoint simulation by hand, the CPU layer against the
// oracle under the verification rule, tensor-parallel slices that start inside a 128-block,
// and evidence that W8A8 is not silently skipped.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kmla/layer.hpp"
#include "kmla/numeric.hpp"
#include "kmla/reference.hpp"
#include "verify/cases.hpp"

namespace kmla {
namespace {

using verify::Case;

// A small mixed batch (a decode, a 2-token decode block, a prefill with two context chunks,
// a fresh prefill, a padding row), so the whole file stays quick under sanitizers.
Case small_case(const std::string& preset, CacheFormat format, uint64_t seed, int heads = 2) {
  Case c = verify::mixed_case(preset, format, 16, seed, heads);
  c.requests = {{1, 12}, {2, 5}, {4, 9}, {3, 0}};
  c.workspace_tokens = 8;
  c.padding_rows = 1;
  c.rope_rows = c.config.use_rope ? 256 : 0;
  return c;
}

std::shared_ptr<const RopeTable> rope_of(const Case& c) {
  return c.config.use_rope ? RopeTable::build(c.config, c.rope_rows) : nullptr;
}

// The CPU layer's real output rows as doubles.
std::vector<double> cpu_out(const Case& c, const verify::Inputs& in, const MlaWeights& w) {
  LayerOptions lo;
  lo.activation = c.activation;
  lo.num_threads = 1;
  MlaLayer layer(c.config, w, lo, rope_of(c));
  HostTensor out(c.activation, {in.md.num_rows, c.config.hidden_size});
  LatentCache cache = in.cache.clone();
  layer.forward(in.positions.view(), in.hidden.view(), &in.md, cache, out.view());
  std::vector<double> v(size_t(in.md.num_tokens * c.config.hidden_size));
  for (size_t i = 0; i < v.size(); ++i) {
    const uint16_t x = out.data<uint16_t>()[i];
    v[i] = c.activation == DType::bf16 ? bf16_to_float(x) : fp16_to_float(x);
  }
  return v;
}

std::vector<double> oracle_out(const Case& c, const verify::Inputs& in, const MlaConfig& cfg,
                               const MlaWeights& w, reference::Rounding rounding) {
  reference::Options ro;
  ro.activation = c.activation;
  ro.rounding = rounding;
  LatentCache cache = in.cache.clone();
  const auto rope = rope_of(c);
  reference::Result r =
      reference::forward(cfg, w, rope.get(), in.positions.view(), in.hidden.view(), &in.md, cache, ro);
  r.out.resize(size_t(in.md.num_tokens * c.config.hidden_size));  // drop the padding rows
  return r.out;
}

// max |a - b| over elements [from, to).
double max_diff(const std::vector<double>& a, const std::vector<double>& b, size_t from = 0,
                size_t to = SIZE_MAX) {
  double d = 0;
  for (size_t i = from; i < std::min(to, a.size()); ++i) d = std::max(d, std::fabs(a[i] - b[i]));
  return d;
}

// The 16-bit tensor of projection `name`.
const HostTensor& tensor_of(const MlaWeights& w, const std::string& name) {
  if (name == "q_a_proj") return w.q_a_proj;
  if (name == "q_b_proj") return w.q_b_proj;
  if (name == "q_proj") return w.q_proj;
  if (name == "kv_a_proj_with_mqa") return w.kv_a_proj_with_mqa;
  if (name == "kv_b_proj") return w.kv_b_proj;
  if (name == "g_proj") return w.g_proj;
  return w.o_proj;
}

double max_abs(const std::vector<double>& a) {
  double m = 0;
  for (double x : a) m = std::max(m, std::fabs(x));
  return m;
}

// ---- (1) the activation quantization ------------------------------------------------------

TEST(W8A8, ActivationQuantizationByHand) {
  // 200 inputs are two groups: [0, 128) with amax 448 (scale 1) and [128, 200) with amax 7
  // (scale 7 / 448 = 2^-6).
  std::vector<float> x(200, 0.0f), q(200, -1.0f);
  x[0] = 448.0f;       // code 0x7E
  x[1] = 1.0625f;      // halfway between 1 and 1.125: ties to even, 1
  x[2] = -3.25f;       // exact in e4m3
  x[3] = 0.003f;       // subnormal at scale 1: 1.536 * 2^-9 -> 2 * 2^-9
  x[128] = 7.0f;       // the group's amax: 448 * 2^-6
  x[129] = 0.003f;     // 0.192 at scale 2^-6 -> 0.1875 (step 2^-6 in [0.125, 0.25))
  x[199] = -0.1f;      // -6.4 -> -6.5 (step 0.5 in [4, 8))
  quantize_activation_fp8(x.data(), 200, q.data());
  EXPECT_EQ(q[0], 448.0f);
  EXPECT_EQ(q[1], 1.0f);
  EXPECT_EQ(q[2], -3.25f);
  EXPECT_EQ(q[3], 0.00390625f);
  for (int i = 4; i < 128; ++i) ASSERT_EQ(q[i], 0.0f) << i;
  EXPECT_EQ(q[128], 7.0f);
  EXPECT_EQ(q[129], 0.0029296875f);  // 0.1875 / 64: the group's own scale, not the first one's
  EXPECT_EQ(q[199], -0.1015625f);
  for (int i = 130; i < 199; ++i) ASSERT_EQ(q[i], 0.0f) << i;

  // An all-zero group stays zero (the 1e-10 floor keeps the scale positive).
  std::vector<float> z(128, 0.0f), zq(128, 1.0f);
  quantize_activation_fp8(z.data(), 128, zq.data());
  for (float v : zq) ASSERT_EQ(v, 0.0f);
}

// ---- (2) simulating an fp8 checkpoint -------------------------------------------------------

TEST(W8A8, ToFp8BlocksByHand) {
  // o_proj [130, 130]: four blocks, the last row/column blocks two wide.
  MlaWeights w;
  w.o_proj = HostTensor(DType::bf16, {130, 130});
  auto set = [&](int64_t r, int64_t c, float v) { w.o_proj.data<uint16_t>()[r * 130 + c] = float_to_bf16(v); };
  set(0, 0, 3.5f);         // block (0,0): amax 3.5, scale 2^-7
  set(5, 7, 1.0f);
  set(127, 127, -0.5f);
  set(64, 1, 1.0625f);     // 136 at that scale: a tie between 128 and 144, to even: 128
  set(3, 129, 0.75f);      // block (0,1): amax 0.75, scale 0.75 / 448
  set(100, 128, 0.25f);    // 149.33 -> 144
  set(129, 0, -448.0f);    // block (1,0): amax 448, scale 1
  set(128, 50, 0.3f);      // bf16 0.30078125 -> 0.3125 (step 1/32 in [0.25, 0.5))
                           // block (1,1): all zero, scale 1
  const MlaWeights f = w.to_fp8_blocks({"o_proj"});
  ASSERT_EQ(f.fp8.size(), 1u);
  const Fp8BlockWeight& b = f.fp8.at("o_proj");
  ASSERT_EQ(b.scale_inv.dim(0), 2);
  ASSERT_EQ(b.scale_inv.dim(1), 2);
  EXPECT_EQ(b.row_offset, 0);
  EXPECT_EQ(b.col_offset, 0);
  const float* s = b.scale_inv.data<float>();
  EXPECT_EQ(s[0], 0x1p-7f);
  EXPECT_EQ(s[1], 0.75f / 448.0f);
  EXPECT_EQ(s[2], 1.0f);
  EXPECT_EQ(s[3], 1.0f);
  auto code = [&](int64_t r, int64_t c) { return b.codes.data<uint8_t>()[r * 130 + c]; };
  EXPECT_EQ(code(0, 0), 0x7E);     // 448
  EXPECT_EQ(code(5, 7), 0x70);     // 128
  EXPECT_EQ(code(127, 127), 0xE8); // -64
  EXPECT_EQ(code(64, 1), 0x70);    // 128
  EXPECT_EQ(code(3, 129), 0x7E);   // 448
  EXPECT_EQ(code(100, 128), 0x71); // 144
  EXPECT_EQ(code(129, 0), 0xFE);   // -448
  EXPECT_EQ(code(128, 50), 0x2A);  // 0.3125
  int nonzero = 0;
  for (int64_t i = 0; i < b.codes.numel(); ++i) nonzero += b.codes.data<uint8_t>()[i] != 0;
  EXPECT_EQ(nonzero, 8);

  // The 16-bit tensor is now the dequantized copy; the source weights are untouched.
  auto val = [](const HostTensor& t, int64_t r, int64_t c) { return bf16_to_float(t.data<uint16_t>()[r * 130 + c]); };
  EXPECT_EQ(val(f.o_proj, 64, 1), 1.0f);
  EXPECT_EQ(val(w.o_proj, 64, 1), 1.0625f);
  EXPECT_EQ(val(f.o_proj, 128, 50), 0.3125f);
  EXPECT_EQ(val(f.o_proj, 100, 128), round_bf16(144.0f * (0.75f / 448.0f)));
  const HostTensor d = b.dequantize(DType::bf16);
  EXPECT_EQ(std::memcmp(d.data<void>(), f.o_proj.data<void>(), d.bytes()), 0);

  // Names that are not projections, absent ones, and double conversion are errors.
  EXPECT_THROW(w.to_fp8_blocks({"kv_a_layernorm"}), Error);
  EXPECT_THROW(w.to_fp8_blocks({"q_proj"}), Error);
  EXPECT_THROW(f.to_fp8_blocks({"o_proj"}), Error);
}

// A whole model converted: every dequantized copy equals dequantize() of its fp8 weight, and
// the result passes validation (shapes and scale grids).
TEST(W8A8, ToFp8BlocksWholeModel) {
  const MlaConfig cfg = verify::small_model("kimi-k3", 1);
  const MlaWeights w = MlaWeights::random(cfg, 5);
  const std::vector<std::string> names = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj", "o_proj"};
  const MlaWeights f = w.to_fp8_blocks(names);
  f.validate(cfg);
  for (const std::string& name : names) {
    const HostTensor d = f.fp8.at(name).dequantize(DType::bf16);
    const HostTensor& copy = tensor_of(f, name);
    ASSERT_EQ(d.bytes(), copy.bytes()) << name;
    EXPECT_EQ(std::memcmp(d.data<void>(), copy.data<void>(), d.bytes()), 0) << name;
  }
  EXPECT_EQ(f.fp8.size(), names.size());
}

// ---- (3) the CPU layer against the oracle -------------------------------------------------

void expect_pass(const Case& c) {
  const verify::Report r = verify::run_case(c);
  EXPECT_TRUE(r.pass) << c.name << ": " << r.detail << " (err " << r.err_backend << ", baseline "
                      << r.err_baseline << ", bound " << r.bound << ")";
  EXPECT_GT(r.err_baseline, 0.0) << c.name;
  EXPECT_GT(r.max_ref, 0.0) << c.name;
}

// All projections fp8: q-LoRA with the gate (K3 shape) in f16 activations, and q_proj with
// RoPE and a plain fp8 cache (V2-Lite shape). The standard grid adds DeepSeek-V3 and Kimi-K2.
TEST(W8A8, LayerMatchesOracleAllProjections) {
  Case k3 = small_case("kimi-k3", CacheFormat::fp16, 31, 1);
  k3.activation = DType::f16;
  k3.fp8_weights = true;
  expect_pass(k3);
  Case v2 = small_case("deepseek-v2-lite", CacheFormat::fp8, 32, 1);
  v2.fp8_weights = true;
  expect_pass(v2);
}

// Some projections fp8, the rest 16-bit: the fused front end mixes recipes (q_a_proj W8A8,
// kv_a_proj_with_mqa 16-bit: two GEMMs on two inputs).
TEST(W8A8, LayerMatchesOracleMixedRecipes) {
  Case c = small_case("kimi-k2", CacheFormat::fp8_ds_mla, 34);
  const MlaWeights w = MlaWeights::random(c.config, c.seed, c.activation);
  c.weights = std::make_shared<MlaWeights>(w.to_fp8_blocks({"q_a_proj", "kv_b_proj", "o_proj"}));
  expect_pass(c);
}

// ---- (4) tensor-parallel slices of fp8 weights ---------------------------------------------

// 3 heads, world 3: rank 1's q_b_proj rows are [192, 384), which start half-way into the
// second 128-row block. The ranks' exact partial outputs add up to the full layer.
TEST(W8A8, TensorParallelSlicesStartingInsideBlocks) {
  Case c = small_case("kimi-k3", CacheFormat::bf16, 35, 3);
  c.requests = {{1, 7}, {4, 5}, {2, 0}};  // a decode, a prefill with context, a fresh prefill
  c.fp8_weights = true;
  const verify::Inputs in = verify::make_inputs(c);
  ASSERT_EQ(in.weights.fp8.size(), 6u);
  const auto full = oracle_out(c, in, c.config, in.weights, reference::Rounding::exact);
  std::vector<double> sum(full.size(), 0.0);
  const int world = 3;
  for (int rank = 0; rank < world; ++rank) {
    const MlaConfig local = c.config.tp_slice(rank, world);
    const MlaWeights w = in.weights.tp_slice(c.config, rank, world);
    const Fp8BlockWeight& q_b = w.fp8.at("q_b_proj");
    EXPECT_EQ(q_b.row_offset, (rank * 192) % 128) << rank;
    if (rank == 1) {
      EXPECT_EQ(q_b.scale_inv.dim(0), 2);  // rows 192..383: blocks 1 and 2
    }
    // The sliced 16-bit copy is still the dequantized sliced fp8 weight.
    for (const auto& [name, f] : w.fp8) {
      const HostTensor d = f.dequantize(DType::bf16);
      EXPECT_EQ(std::memcmp(d.data<void>(), tensor_of(w, name).data<void>(), d.bytes()), 0) << name << " rank " << rank;
    }
    const auto part = oracle_out(c, in, local, w, reference::Rounding::exact);
    for (size_t i = 0; i < part.size(); ++i) sum[i] += part[i];
  }
  const double m = max_abs(full);
  ASSERT_GT(m, 0.0);
  EXPECT_LE(max_diff(sum, full), 1e-12 * m);
}

// ---- (5) W8A8 is really applied ---------------------------------------------------------------

double rms_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += (a[i] - b[i]) * (a[i] - b[i]);
  return std::sqrt(s / double(a.size()));
}

// Each projection in turn runs W8A8 while every other projection runs its dequantized copy
// as a 16-bit weight; the reference is all copies as 16-bit weights. The only difference is
// that projection's activation quantization (and its fp32 vs bf16 dequantized weight),
// which must stand clearly above the rounding noise of the 16-bit layer (the seed-rounding
// oracle's error), in the CPU path and in the oracle. RMS rather than max: one max is a
// noisy statistic. Over ten seeds the ratio to the noise was >= 2.1 for g_proj (damped by
// the sigmoid) and q_b_proj, 2.6-7 for the others; the test asks 1.5. An fp8 kv_b_proj leaves
// the decode rows exactly alone: decode uses the bf16 copy through the absorbed weights.
// `only`: check just this projection (the others still run their 16-bit copies).
void expect_every_projection_matters(const std::string& preset, const std::string& only = "") {
  Case c = small_case(preset, CacheFormat::bf16, 36, 1);
  c.fp8_weights = true;
  const verify::Inputs in = verify::make_inputs(c);
  const int64_t hid = c.config.hidden_size;
  const size_t decode_end = size_t(in.md.num_decode_tokens * hid);
  ASSERT_GT(in.md.num_decode_tokens, 0);
  ASSERT_LT(decode_end, size_t(in.md.num_tokens * hid));
  MlaWeights w16 = in.weights;
  w16.fp8.clear();
  const auto exact16 = oracle_out(c, in, c.config, w16, reference::Rounding::exact);
  const auto seed16 = oracle_out(c, in, c.config, w16, reference::Rounding::seed);
  const auto cpu16 = cpu_out(c, in, w16);
  const double noise = rms_diff(seed16, exact16);
  ASSERT_GT(noise, 0.0);
  for (const auto& [name, f] : in.weights.fp8) {
    if (!only.empty() && name != only) continue;
    MlaWeights w8 = w16;
    w8.fp8[name] = f;
    const auto exact8 = oracle_out(c, in, c.config, w8, reference::Rounding::exact);
    const auto cpu8 = cpu_out(c, in, w8);
    EXPECT_GT(rms_diff(exact8, exact16), 1.5 * noise) << preset << " " << name;
    EXPECT_GT(rms_diff(cpu8, cpu16), 1.5 * noise) << preset << " " << name;
    if (name == "kv_b_proj") {
      EXPECT_EQ(max_diff(exact8, exact16, 0, decode_end), 0.0);
      EXPECT_EQ(max_diff(cpu8, cpu16, 0, decode_end), 0.0);
      EXPECT_GT(max_diff(cpu8, cpu16, decode_end), 0.0);
    }
  }
}

TEST(W8A8, EveryFp8ProjectionChangesTheOutput) {
  expect_every_projection_matters("kimi-k3");           // q_a, q_b, kv_a, kv_b, g, o
  expect_every_projection_matters("deepseek-v2-lite", "q_proj");
}

}  // namespace
}  // namespace kmla
