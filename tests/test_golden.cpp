// Golden fixtures from an independent PyTorch implementation of the layer
// (tests/golden/make_golden.py). Because it was written from the seed's formulas and not
// from this code, a misreading shared by the oracle and the CPU path cannot pass here.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>

#include "kmla/layer.hpp"
#include "kmla/numeric.hpp"
#include "kmla/reference.hpp"
#include "kmla/safetensors.hpp"
#include "kmla/stages.hpp"

namespace kmla {
namespace {

using nlohmann::json;

std::string golden_path(const std::string& name) {
  const char* root = std::getenv("KMLA_SOURCE_DIR");
  return std::string(root ? root : ".") + "/tests/golden/" + name + ".safetensors";
}

HostTensor to_host(const StTensor& t, DType dt) {
  std::vector<int64_t> shape(t.shape.begin(), t.shape.end());
  HostTensor h(dt, shape);
  EXPECT_EQ(h.bytes(), t.bytes) << t.name;
  std::memcpy(h.data<void>(), t.data, t.bytes);
  return h;
}

struct Golden {
  explicit Golden(SafetensorsFile f) : file(std::move(f)) {}
  SafetensorsFile file;
  json cfg;
  MlaConfig mla;
  MlaWeights w;
  CacheFormat format;
  std::vector<RequestSpec> requests;
  BatchMetadata md;
  HostTensor positions, hidden;
  LatentCache cache_in;
  std::shared_ptr<const RopeTable> rope;
};

Golden load(const std::string& name) {
  Golden g(SafetensorsFile::open(golden_path(name)));
  g.cfg = json::parse(g.file.metadata().at("config"));
  const json& c = g.cfg;
  MlaConfig& m = g.mla;
  m.name = name;
  m.hidden_size = c["hidden_size"];
  m.num_heads = c["num_heads"];
  if (c["q_lora_rank"].get<int>() > 0) m.q_lora_rank = c["q_lora_rank"].get<int>();
  m.rms_norm_eps = c["rms_norm_eps"];
  m.use_rope = c["use_rope"];
  m.rope.type = map_rope_type(c["rope_type"].get<std::string>(), true);
  m.rope.theta = c["rope_theta"];
  m.rope.factor = c["factor"];
  m.rope.original_max_position_embeddings = c["original_max_position_embeddings"];
  m.rope.beta_fast = c["beta_fast"];
  m.rope.beta_slow = c["beta_slow"];
  m.rope.mscale = c["mscale"];
  m.rope.mscale_all_dim = c["mscale_all_dim"];
  m.max_position_embeddings = c["max_position_embeddings"];
  m.use_output_gate = c["use_output_gate"];
  m.non_causal_multi_token_decode = c["non_causal_multi_token_decode"];
  m.validate();
  EXPECT_NEAR(m.softmax_scale(), c["softmax_scale"].get<double>(), 1e-7) << name;

  auto weight = [&](const char* n) {
    return g.file.has(n) ? to_host(g.file.tensor(n), DType::bf16) : HostTensor();
  };
  g.w.q_a_proj = weight("q_a_proj");
  g.w.q_a_layernorm = weight("q_a_layernorm");
  g.w.q_b_proj = weight("q_b_proj");
  g.w.q_proj = weight("q_proj");
  g.w.kv_a_proj_with_mqa = weight("kv_a_proj_with_mqa");
  g.w.kv_a_layernorm = weight("kv_a_layernorm");
  g.w.kv_b_proj = weight("kv_b_proj");
  g.w.g_proj = weight("g_proj");
  g.w.o_proj = weight("o_proj");
  g.w.k_scale = c["k_scale"];
  g.w.q_scale = c["q_scale"];
  g.w.validate(m);

  g.format = parse_cache_format(c["cache_format"].get<std::string>());
  const int bs = c["block_size"];
  g.cache_in = LatentCache::allocate(g.format, bs, c["num_blocks"].get<int64_t>(), g.w.k_scale);
  const StTensor& ci = g.file.tensor("cache_in");
  EXPECT_EQ(ci.bytes, size_t(g.cache_in.geometry().block_stride) * g.cache_in.num_blocks());
  std::memcpy(g.cache_in.base(), ci.data, ci.bytes);

  const StTensor& bt = g.file.tensor("block_table");
  const auto* table = reinterpret_cast<const int32_t*>(bt.data);
  const auto ql = c["query_lens"].get<std::vector<int>>();
  const auto cl = c["context_lens"].get<std::vector<int>>();
  for (size_t r = 0; r < ql.size(); ++r) {
    RequestSpec q{ql[r], cl[r], {}};
    q.block_table.assign(table + r * bt.shape[1], table + (r + 1) * bt.shape[1]);
    g.requests.push_back(q);
  }
  BatchOptions opt;
  opt.decode_threshold = c["decode_threshold"];
  opt.non_causal_decode = m.non_causal_multi_token_decode;
  opt.keep_order = true;  // the fixture's batch is already in layout order
  opt.num_rows = c["num_rows"];
  const StTensor& sm = g.file.tensor("slot_mapping");
  const auto* slots = reinterpret_cast<const int64_t*>(sm.data);
  opt.slot_mapping.assign(slots, slots + c["num_actual_tokens"].get<int64_t>());
  g.md = plan_batch(g.requests, g.cache_in.geometry(), opt);
  EXPECT_EQ(g.md.num_tokens, c["num_actual_tokens"].get<int64_t>());

  g.positions = to_host(g.file.tensor("positions"), DType::i64);
  g.hidden = to_host(g.file.tensor("hidden"), DType::bf16);
  if (m.use_rope) {
    int64_t max_pos = 0;
    for (int64_t i = 0; i < g.positions.numel(); ++i) max_pos = std::max(max_pos, g.positions.data<int64_t>()[i]);
    g.rope = RopeTable::build(m, m.rope.type == RopeType::default_ ? max_pos + 1 : 0);
  }
  return g;
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

class GoldenTest : public ::testing::TestWithParam<std::string> {};

// The RoPE table rows the fixture used agree with ours. Both build the angle as the fp32
// product position * inv_freq; a one-ulp difference in an fp32 inv_freq (two independent
// fp32 pow/divide chains may differ by that) moves the angle by about pos * inv_freq * 2^-23,
// so the bound grows with the angle; cos/sin themselves add a few 1e-7.
TEST_P(GoldenTest, RopeTableMatches) {
  Golden g = load(GetParam());
  if (!g.mla.use_rope) GTEST_SKIP() << "NoPE case";
  const StTensor& t = g.file.tensor("rope_cos_sin");
  const auto* ref = reinterpret_cast<const float*>(t.data);
  for (int64_t i = 0; i < g.md.num_tokens; ++i) {
    const int64_t pos = g.positions.data<int64_t>()[i];
    const float* row = g.rope->row(pos);
    for (int j = 0; j < kRopeDim; ++j) {
      const double angle = double(pos) * g.rope->inv_freq()[j % (kRopeDim / 2)];
      const double bound = 2.0 * angle * 0x1p-23 + 3e-7;
      ASSERT_NEAR(row[j], ref[i * kRopeDim + j], bound) << "token " << i << " entry " << j;
    }
  }
}

// The cache writer, fed the fixture's own latents, reproduces its cache bytes: bit for bit
// in the kv part (and everywhere without RoPE); the rotated rope part may differ by what the
// two tables differ by (see RopeTableMatches) plus one storage step.
TEST_P(GoldenTest, CacheWriterMatchesBytes) {
  Golden g = load(GetParam());
  LatentCache cache = g.cache_in.clone();
  const int64_t T = g.md.num_tokens;
  HostTensor kv(DType::bf16, {T, kKvLoraRank}), pe(DType::bf16, {T, kRopeDim}), slots(DType::i64, {T}),
      pos(DType::i64, {T});
  std::memcpy(kv.data<void>(), g.file.tensor("kv_c_normed").data, kv.bytes());
  std::memcpy(pe.data<void>(), g.file.tensor("k_pe").data, pe.bytes());
  std::memcpy(slots.data<void>(), g.md.slot_mapping.data(), slots.bytes());
  std::memcpy(pos.data<void>(), g.positions.data<void>(), pos.bytes());
  cache_insert(kv.view(), pe.view(), pos.view(), g.rope.get(), slots.view(), cache);
  const StTensor& co = g.file.tensor("cache_out");
  const size_t entry = cache.geometry().entry_bytes();
  const size_t kv_bytes = g.format == CacheFormat::fp8 ? 512 : g.format == CacheFormat::fp8_ds_mla ? 528 : 1024;
  for (int64_t slot = 0; slot < cache.geometry().num_slots(); ++slot) {
    const auto* want = co.data + slot * entry;
    const auto* got = cache.slot_ptr(slot);
    const bool written =
        std::find(g.md.slot_mapping.begin(), g.md.slot_mapping.end(), slot) != g.md.slot_mapping.end();
    if (!g.mla.use_rope || !written) {
      ASSERT_EQ(std::memcmp(got, want, entry), 0) << "slot " << slot;
      continue;
    }
    ASSERT_EQ(std::memcmp(got, want, kv_bytes), 0) << "kv part of slot " << slot;
    float a[kLatentDim], b[kLatentDim];
    cache.codec().decode(got, a);
    cache.codec().decode(want, b);
    const int64_t t = std::find(g.md.slot_mapping.begin(), g.md.slot_mapping.end(), slot) - g.md.slot_mapping.begin();
    const double pos = double(g.positions.data<int64_t>()[t]);
    const uint16_t* kpe = pe.data<uint16_t>() + t * kRopeDim;
    for (int i = 0; i < kRopeDim; ++i) {
      const int pair = i / 2;
      const double table_err = 2.0 * pos * g.rope->inv_freq()[pair] * 0x1p-23 + 3e-7;
      const double mag = std::fabs(bf16_to_float(kpe[2 * pair])) + std::fabs(bf16_to_float(kpe[2 * pair + 1]));
      ASSERT_NEAR(a[kKvLoraRank + i], b[kKvLoraRank + i], mag * table_err + std::fabs(b[kKvLoraRank + i]) * 0x1p-7 + 1e-6)
          << "rope element " << i << " of slot " << slot;
    }
  }
}

// The whole layer: the CPU path and our oracle against the independent implementation.
TEST_P(GoldenTest, LayerMatches) {
  Golden g = load(GetParam());
  LatentCache cache = g.cache_in.clone();
  MlaLayer layer(g.mla, g.w, {}, g.rope);
  HostTensor out(DType::bf16, {g.md.num_rows, g.mla.hidden_size});
  layer.forward(g.positions.view(), g.hidden.view(), &g.md, cache, out.view());

  LatentCache exact_cache = g.cache_in.clone(), seed_cache = g.cache_in.clone();
  reference::Options ro;
  const auto exact = reference::forward(g.mla, g.w, g.rope.get(), g.positions.view(), g.hidden.view(), &g.md,
                                        exact_cache, ro);
  ro.rounding = reference::Rounding::seed;
  const auto seed = reference::forward(g.mla, g.w, g.rope.get(), g.positions.view(), g.hidden.view(), &g.md,
                                       seed_cache, ro);

  const auto* golden = reinterpret_cast<const uint16_t*>(g.file.tensor("out").data);
  double err_cpu = 0, err_golden = 0, err_seed = 0, cpu_vs_golden = 0;
  for (size_t i = 0; i < exact.out.size(); ++i) {
    const double ref = exact.out[i], gv = bf16_to_float(golden[i]), cv = bf16_to_float(out.data<uint16_t>()[i]);
    ASSERT_TRUE(std::isfinite(cv) && std::isfinite(gv) && std::isfinite(ref)) << "output " << i;
    err_cpu = std::max(err_cpu, std::fabs(cv - ref));
    err_golden = std::max(err_golden, std::fabs(gv - ref));
    err_seed = std::max(err_seed, std::fabs(seed.out[i] - ref));
    cpu_vs_golden = std::max(cpu_vs_golden, std::fabs(cv - gv));
  }
  // Same rule as everywhere (SPEC 1b): twice a plain same-precision implementation's error
  // plus one bf16 ulp of the largest output. The golden model is such an implementation,
  // so it must meet the rule against our oracle too — that is the cross-check of the oracle.
  const double bound = 2 * err_seed + 0x1p-8 * max_abs(exact.out);
  EXPECT_LE(err_golden, bound) << "independent PyTorch model disagrees with the oracle";
  EXPECT_LE(err_cpu, bound) << "CPU path";
  EXPECT_LE(cpu_vs_golden, bound) << "CPU path vs the PyTorch model";
  for (int64_t i = g.md.num_tokens * g.mla.hidden_size; i < out.numel(); ++i)
    ASSERT_EQ(out.data<uint16_t>()[i] & 0x7fff, 0) << "padding output " << i;

  // Unwritten cache bytes are untouched; written rows agree within one storage step.
  const StTensor& co = g.file.tensor("cache_out");
  const size_t entry = cache.geometry().entry_bytes();
  const bool fp8 = g.format != CacheFormat::bf16;
  for (int64_t slot = 0; slot < cache.geometry().num_slots(); ++slot) {
    const bool written = std::find(g.md.slot_mapping.begin(), g.md.slot_mapping.end(), slot) != g.md.slot_mapping.end();
    if (!written) {
      ASSERT_EQ(std::memcmp(cache.slot_ptr(slot), co.data + slot * entry, entry), 0) << "slot " << slot;
      continue;
    }
    float a[kLatentDim], b[kLatentDim];
    cache.codec().decode(cache.slot_ptr(slot), a);
    cache.codec().decode(co.data + slot * entry, b);
    double m = 0, d = 0;
    for (int i = 0; i < kLatentDim; ++i) {
      m = std::max(m, double(std::fabs(b[i])));
      d = std::max(d, double(std::fabs(a[i] - b[i])));
    }
    EXPECT_LE(d, m * (fp8 ? 0x1p-3 : 0x1p-7)) << "cache row at slot " << slot;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GoldenTest, ::testing::Values("k3", "dspark", "kimi_linear", "k2_yarn"));

}  // namespace
}  // namespace kmla
