// MlaWeights: random() shapes and determinism, validate() errors, tensor-parallel slices
// and the kv_b split for the absorbed decode path.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kmla/error.hpp"
#include "test_util.hpp"
#include "kmla/numeric.hpp"
#include "kmla/weights.hpp"

using namespace kmla;

namespace {

using kmla::testing_util::expect_error_naming;

// Small stand-ins for the real geometries (the real ones take seconds to fill under ASan).
MlaConfig lora_gate_config() {  // Kimi-K3-like: q-LoRA + output gate
  MlaConfig c = MlaConfig::preset("kimi-k3");
  c.name = "small-k3";
  c.hidden_size = 96;
  c.num_heads = 4;
  c.q_lora_rank = 48;
  return c;
}

MlaConfig plain_config() {  // Kimi-Linear-like: q_proj, no gate
  MlaConfig c = MlaConfig::preset("kimi-linear-48b");
  c.name = "small-linear";
  c.hidden_size = 80;
  c.num_heads = 6;
  return c;
}

std::vector<int64_t> shape(const HostTensor& t) {
  std::vector<int64_t> s;
  if (t.empty()) return s;
  for (int i = 0; i < t.view().ndim; ++i) s.push_back(t.dim(i));
  return s;
}

using Shape = std::vector<int64_t>;

bool same_bytes(const HostTensor& a, const HostTensor& b) {
  return shape(a) == shape(b) && a.dtype() == b.dtype() &&
         std::memcmp(a.data<std::byte>(), b.data<std::byte>(), a.bytes()) == 0;
}

// All tensors of a weight set, by name.
std::vector<std::pair<const char*, const HostTensor*>> tensors(const MlaWeights& w) {
  return {{"q_a_proj", &w.q_a_proj}, {"q_a_layernorm", &w.q_a_layernorm}, {"q_b_proj", &w.q_b_proj},
          {"q_proj", &w.q_proj},     {"kv_a_proj_with_mqa", &w.kv_a_proj_with_mqa},
          {"kv_a_layernorm", &w.kv_a_layernorm}, {"kv_b_proj", &w.kv_b_proj},
          {"g_proj", &w.g_proj},     {"o_proj", &w.o_proj}};
}

float at(const HostTensor& t, int64_t i) {
  const uint16_t v = t.data<uint16_t>()[i];
  return t.dtype() == DType::bf16 ? bf16_to_float(v) : fp16_to_float(v);
}

}  // namespace

TEST(Weights, RandomShapesWithLoraAndGate) {
  const MlaConfig c = lora_gate_config();
  const MlaWeights w = MlaWeights::random(c, 1);
  EXPECT_EQ(shape(w.q_a_proj), (Shape{48, 96}));
  EXPECT_EQ(shape(w.q_a_layernorm), (Shape{48}));
  EXPECT_EQ(shape(w.q_b_proj), (Shape{4 * 192, 48}));
  EXPECT_TRUE(w.q_proj.empty());
  EXPECT_EQ(shape(w.kv_a_proj_with_mqa), (Shape{576, 96}));
  EXPECT_EQ(shape(w.kv_a_layernorm), (Shape{512}));
  EXPECT_EQ(shape(w.kv_b_proj), (Shape{4 * 256, 512}));
  EXPECT_EQ(shape(w.g_proj), (Shape{4 * 128, 96}));
  EXPECT_EQ(shape(w.o_proj), (Shape{96, 4 * 128}));
  EXPECT_EQ(w.dtype(), DType::bf16);
  for (const auto& [name, t] : tensors(w))
    if (!t->empty()) {
      EXPECT_EQ(t->dtype(), DType::bf16) << name;
    }
  EXPECT_NO_THROW(w.validate(c));
  // Local heads of a TP rank.
  const MlaConfig r1 = c.tp_slice(1, 2);
  const MlaWeights wl = MlaWeights::random(r1, 1);
  EXPECT_EQ(shape(wl.q_b_proj), (Shape{2 * 192, 48}));
  EXPECT_EQ(shape(wl.kv_b_proj), (Shape{2 * 256, 512}));
  EXPECT_EQ(shape(wl.g_proj), (Shape{2 * 128, 96}));
  EXPECT_EQ(shape(wl.o_proj), (Shape{96, 2 * 128}));
  EXPECT_NO_THROW(wl.validate(r1));
}

TEST(Weights, RandomShapesWithoutLora) {
  const MlaConfig c = plain_config();
  const MlaWeights w = MlaWeights::random(c, 2, DType::f16);
  EXPECT_TRUE(w.q_a_proj.empty());
  EXPECT_TRUE(w.q_a_layernorm.empty());
  EXPECT_TRUE(w.q_b_proj.empty());
  EXPECT_TRUE(w.g_proj.empty());
  EXPECT_EQ(shape(w.q_proj), (Shape{6 * 192, 80}));
  EXPECT_EQ(shape(w.kv_a_proj_with_mqa), (Shape{576, 80}));
  EXPECT_EQ(shape(w.kv_b_proj), (Shape{6 * 256, 512}));
  EXPECT_EQ(shape(w.o_proj), (Shape{80, 6 * 128}));
  EXPECT_EQ(w.dtype(), DType::f16);
  EXPECT_NO_THROW(w.validate(c));
  EXPECT_THROW(MlaWeights::random(c, 2, DType::f32), Error);
}

TEST(Weights, RandomIsDeterministicAndScaled) {
  const MlaConfig c = lora_gate_config();
  const MlaWeights a = MlaWeights::random(c, 42), b = MlaWeights::random(c, 42), d = MlaWeights::random(c, 43);
  for (size_t i = 0; i < tensors(a).size(); ++i) {
    const auto* ta = tensors(a)[i].second;
    if (ta->empty()) continue;
    EXPECT_TRUE(same_bytes(*ta, *tensors(b)[i].second)) << tensors(a)[i].first;
    EXPECT_FALSE(same_bytes(*ta, *tensors(d)[i].second)) << tensors(a)[i].first;
  }
  // N(0, 1/in): the sample variance of kv_b (512 inputs, 524288 samples) is 1/512 within
  // a few percent; norms are 1 + N(0, 0.01) so their mean is near 1.
  double s2 = 0;
  for (int64_t i = 0; i < a.kv_b_proj.numel(); ++i) s2 += double(at(a.kv_b_proj, i)) * at(a.kv_b_proj, i);
  EXPECT_NEAR(s2 / a.kv_b_proj.numel() * 512.0, 1.0, 0.03);
  double m = 0;
  for (int64_t i = 0; i < 512; ++i) m += at(a.kv_a_layernorm, i);
  EXPECT_NEAR(m / 512, 1.0, 0.02);
}

TEST(Weights, ValidateCatchesMistakes) {
  const MlaConfig c = lora_gate_config();
  const MlaWeights good = MlaWeights::random(c, 5);
  {
    MlaWeights w = good;
    w.q_b_proj = HostTensor();
    expect_error_naming([&] { w.validate(c); }, {"q_b_proj", "missing"});
  }
  {
    MlaWeights w = good;
    w.g_proj = HostTensor();
    expect_error_naming([&] { w.validate(c); }, {"g_proj"});
  }
  {
    MlaWeights w = good;
    w.q_proj = HostTensor(DType::bf16, {4 * 192, 96});  // not used with q-LoRA
    expect_error_naming([&] { w.validate(c); }, {"q_proj", "small-k3"});
  }
  {
    MlaWeights w = good;
    w.kv_b_proj = HostTensor(DType::bf16, {3 * 256, 512});
    expect_error_naming([&] { w.validate(c); }, {"kv_b_proj", "768", "1024"});
  }
  {
    MlaWeights w = good;
    w.q_a_layernorm = HostTensor(DType::bf16, {48, 1});
    expect_error_naming([&] { w.validate(c); }, {"q_a_layernorm"});
  }
  {
    MlaWeights w = good;
    w.o_proj = HostTensor(DType::f16, {96, 4 * 128});
    expect_error_naming([&] { w.validate(c); }, {"o_proj", "f16", "bf16"});
  }
  {
    MlaWeights w = good;
    w.kv_b_proj = HostTensor(DType::f32, {4 * 256, 512});
    expect_error_naming([&] { w.validate(c); }, {"f32"});
  }
  {
    MlaWeights w = good;
    w.k_scale = 0;
    expect_error_naming([&] { w.validate(c); }, {"k_scale"});
  }
  // A config without the gate rejects a g_proj.
  MlaConfig nogate = c;
  nogate.use_output_gate = false;
  expect_error_naming([&] { good.validate(nogate); }, {"g_proj"});
  // Weights for 4 heads are not the weights of a TP rank holding 2.
  EXPECT_THROW(good.validate(c.tp_slice(0, 2)), Error);
}

TEST(Weights, TpSlicesConcatenateToTheFullWeights) {
  for (const MlaConfig& c : {lora_gate_config(), plain_config()}) {
    const MlaWeights full = MlaWeights::random(c, 9);
    const int H = c.num_heads;
    for (int world : {1, 2, H}) {
      if (H % world) continue;
      const int hl = H / world;
      std::vector<uint16_t> q, kvb, g, o(size_t(c.hidden_size) * H * 128);
      for (int rank = 0; rank < world; ++rank) {
        const MlaWeights s = full.tp_slice(c, rank, world);
        const MlaConfig lc = c.tp_slice(rank, world);
        EXPECT_NO_THROW(s.validate(lc));
        const HostTensor& sq = c.q_lora_rank ? s.q_b_proj : s.q_proj;
        q.insert(q.end(), sq.data<uint16_t>(), sq.data<uint16_t>() + sq.numel());
        kvb.insert(kvb.end(), s.kv_b_proj.data<uint16_t>(), s.kv_b_proj.data<uint16_t>() + s.kv_b_proj.numel());
        if (c.use_output_gate)
          g.insert(g.end(), s.g_proj.data<uint16_t>(), s.g_proj.data<uint16_t>() + s.g_proj.numel());
        // o_proj [hidden, H*128]: the rank's columns [rank*hl*128, (rank+1)*hl*128).
        ASSERT_EQ(s.o_proj.dim(1), hl * 128);
        for (int64_t r = 0; r < c.hidden_size; ++r)
          std::memcpy(&o[size_t(r) * H * 128 + size_t(rank) * hl * 128],
                      s.o_proj.data<uint16_t>() + r * hl * 128, size_t(hl) * 128 * 2);
        // Replicated tensors are the full ones.
        EXPECT_TRUE(same_bytes(s.kv_a_proj_with_mqa, full.kv_a_proj_with_mqa));
        EXPECT_TRUE(same_bytes(s.kv_a_layernorm, full.kv_a_layernorm));
        if (c.q_lora_rank) {
          EXPECT_TRUE(same_bytes(s.q_a_proj, full.q_a_proj));
          EXPECT_TRUE(same_bytes(s.q_a_layernorm, full.q_a_layernorm));
        }
      }
      const HostTensor& fq = c.q_lora_rank ? full.q_b_proj : full.q_proj;
      EXPECT_EQ(q, std::vector<uint16_t>(fq.data<uint16_t>(), fq.data<uint16_t>() + fq.numel())) << world;
      EXPECT_EQ(kvb, std::vector<uint16_t>(full.kv_b_proj.data<uint16_t>(),
                                           full.kv_b_proj.data<uint16_t>() + full.kv_b_proj.numel()))
          << world;
      if (c.use_output_gate) {
        EXPECT_EQ(g, std::vector<uint16_t>(full.g_proj.data<uint16_t>(),
                                           full.g_proj.data<uint16_t>() + full.g_proj.numel()))
            << world;
      }
      EXPECT_EQ(o, std::vector<uint16_t>(full.o_proj.data<uint16_t>(),
                                         full.o_proj.data<uint16_t>() + full.o_proj.numel()))
          << world;
    }
  }
  const MlaConfig c = lora_gate_config();
  const MlaWeights full = MlaWeights::random(c, 9);
  EXPECT_THROW(full.tp_slice(c, 0, 3), Error);  // 4 heads over 3 ranks
  EXPECT_THROW(full.tp_slice(c, 2, 2), Error);
  EXPECT_THROW(full.tp_slice(c.tp_slice(0, 2), 0, 2), Error);
}

TEST(Weights, TpSliceHeadRowsByIndex) {
  // Rank 1 of 2 (heads 2, 3): its kv_b row j is full row 2*256 + j; its q_b row j is full
  // row 2*192 + j; its o_proj column j is full column 2*128 + j.
  const MlaConfig c = lora_gate_config();
  const MlaWeights full = MlaWeights::random(c, 17);
  const MlaWeights s = full.tp_slice(c, 1, 2);
  for (int64_t j = 0; j < 2 * 256; j += 37)
    for (int64_t l = 0; l < 512; l += 101)
      ASSERT_EQ(s.kv_b_proj.data<uint16_t>()[j * 512 + l], full.kv_b_proj.data<uint16_t>()[(512 + j) * 512 + l]);
  for (int64_t j = 0; j < 2 * 192; j += 7)
    ASSERT_EQ(s.q_b_proj.data<uint16_t>()[j * 48 + 5], full.q_b_proj.data<uint16_t>()[(384 + j) * 48 + 5]);
  for (int64_t r = 0; r < 96; r += 11)
    for (int64_t j = 0; j < 256; j += 13)
      ASSERT_EQ(s.o_proj.data<uint16_t>()[r * 256 + j], full.o_proj.data<uint16_t>()[r * 512 + 256 + j]);
}

TEST(Weights, AbsorbKvbIndexes) {
  // kv_b filled with a code of its own (row, col), so any misplaced element shows.
  const int H = 3;
  HostTensor kvb(DType::bf16, {H * 256, 512});
  auto* p = kvb.data<uint16_t>();
  auto code = [](int64_t row, int64_t col) { return uint16_t((row * 7919 + col * 104729) & 0xffff); };
  for (int64_t r = 0; r < H * 256; ++r)
    for (int64_t l = 0; l < 512; ++l) p[r * 512 + l] = code(r, l);
  const AbsorbedWeights a = absorb_kv_b(kvb, H);
  ASSERT_EQ(shape(a.w_uk_t), (Shape{H, 128, 512}));
  ASSERT_EQ(shape(a.w_uv), (Shape{H, 512, 128}));
  EXPECT_EQ(a.w_uk_t.dtype(), DType::bf16);
  const auto* uk = a.w_uk_t.data<uint16_t>();
  const auto* uv = a.w_uv.data<uint16_t>();
  for (int h = 0; h < H; ++h) {
    // W_UK_T[h][p][l] = kv_b[h*256 + p][l]
    for (int pp = 0; pp < 128; ++pp)
      for (int l = 0; l < 512; ++l)
        ASSERT_EQ(uk[(h * 128 + pp) * 512 + l], code(h * 256 + pp, l)) << h << " " << pp << " " << l;
    // W_UV[h][l][v] = kv_b[h*256 + 128 + v][l]
    for (int l = 0; l < 512; ++l)
      for (int v = 0; v < 128; ++v)
        ASSERT_EQ(uv[(h * 512 + l) * 128 + v], code(h * 256 + 128 + v, l)) << h << " " << l << " " << v;
  }
  expect_error_naming([&] { absorb_kv_b(kvb, 2); }, {"kv_b_proj"});
  HostTensor f32(DType::f32, {256, 512});
  EXPECT_THROW(absorb_kv_b(f32, 1), Error);
}
