// Checkpoints written by the standard Python `safetensors` library
// (tests/checkpoints/make_checkpoints.py, README.md beside it): kmla must read exactly
// the values the script stored. Every stored value is a closed form of (tensor name, flat
// index); this file recomputes those forms on its own, with its own bf16 / fp16 / e4m3
// arithmetic, so a layout, dtype, offset, sharding or slicing mistake in the reader cannot
// hide behind a shared helper.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "kmla/checkpoint.hpp"
#include "kmla/config.hpp"
#include "kmla/error.hpp"
#include "kmla/weights.hpp"

namespace kmla {
namespace {

// ---- The closed forms (keep in sync with make_checkpoints.py) ---------------------------

uint32_t salt(const std::string& name) {
  uint32_t h = 0x811C9DC5u;  // FNV-1a, 32-bit
  for (unsigned char c : name) {
    h ^= c;
    h *= 0x01000193u;
  }
  return h % 65521u;
}

// x(name, i) = (k - 524286) * 2^-22, k = (7919 i + 104729 salt) mod 1048573: exact in float.
float base_value(uint32_t salt, int64_t i) {
  const int64_t k = (i * 7919 + int64_t(salt) * 104729) % 1048573;
  return std::ldexp(float(k - 524286), -22);
}

uint8_t fp8_code(uint32_t salt, int64_t i) {
  const int64_t c = (i * 131 + int64_t(salt) * 37) % 254;
  return uint8_t(c < 127 ? c : c + 1);  // never 0x7F or 0xFF (NaN)
}

float scale_value(uint32_t salt, int64_t r, int64_t c) {
  const int64_t mant = 9 + (7 * r + 3 * c + salt) % 23;
  return std::ldexp(float(mant), -int(8 + (r + 2 * c) % 3));
}
float scale_value(const std::string& scale_name, int64_t r, int64_t c) { return scale_value(salt(scale_name), r, c); }

// ---- Independent number formats ---------------------------------------------------------

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Round to nearest, ties to even (finite inputs).
uint16_t to_bf16(float f) {
  const uint32_t u = bits_of(f);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

float e4m3(uint8_t c) {
  const int e = (c >> 3) & 15, m = c & 7;
  const float v = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(float(8 + m), e - 10);
  return (c & 0x80) ? -v : v;
}

float bf16_float(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float fp16_float(uint16_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  const float v = e == 0 ? std::ldexp(float(m), -24) : std::ldexp(float(1024 + m), e - 25);
  return (h & 0x8000) ? -v : v;
}

bool is_norm(const std::string& name) {
  const std::string tail = "norm.weight";
  return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// The bf16 bits the script stored for element i of a BF16 tensor.
uint16_t stored_bf16(uint32_t salt, bool norm, int64_t i) {
  const float x = base_value(salt, i);
  return to_bf16(norm ? 1.0f + x : x);
}

// ---- Fixtures -----------------------------------------------------------------------------

std::string fixture_dir(const std::string& name) {
  std::string root;
  if (const char* env = std::getenv("KMLA_SOURCE_DIR")) {
    root = env;
  } else {  // run by hand: this file lives in <root>/tests/
    root = std::filesystem::path(__FILE__).parent_path().parent_path().string();
  }
  return root + "/tests/checkpoints/" + name;
}

Checkpoint open_fixture(const std::string& name) { return Checkpoint::open(fixture_dir(name)); }

const char* const kFixtures[] = {"k3_tiny", "kimi_linear_tiny", "dsv3_fp8_tiny"};

template <class T>
T load_raw(const StTensor& t, int64_t i) {
  T v;
  std::memcpy(&v, t.data + i * int64_t(sizeof(T)), sizeof(T));
  return v;
}

// Counts mismatches over a whole tensor and reports the first, instead of one
// assertion per element.
struct Mismatch {
  int64_t count = 0;
  std::string first;
  void add(const std::string& what, int64_t i, double got, double want) {
    if (count++ == 0) {
      std::ostringstream os;
      os << what << " [" << i << "]: got " << got << ", want " << want;
      first = os.str();
    }
  }
};

#define EXPECT_NO_MISMATCH(m) EXPECT_EQ((m).count, 0) << (m).first

// ---- Config parsing -------------------------------------------------------------------------

TEST(CheckpointFixture, K3ConfigParses) {
  const Checkpoint ck = open_fixture("k3_tiny");
  const HfModelConfig& hf = ck.config();
  EXPECT_EQ(hf.model_type, "kimi_k3");
  EXPECT_EQ(hf.num_hidden_layers, 4);
  EXPECT_EQ(hf.mla_layers, (std::vector<int>{1, 3}));  // full_attn_layers [2, 4] are 1-based
  const MlaConfig& c = hf.mla;
  EXPECT_EQ(c.hidden_size, 256);
  EXPECT_EQ(c.num_heads, 4);
  ASSERT_TRUE(c.q_lora_rank.has_value());
  EXPECT_EQ(*c.q_lora_rank, 96);
  EXPECT_TRUE(c.use_output_gate);
  EXPECT_FALSE(c.use_rope);  // mla_use_nope
  EXPECT_FALSE(c.non_causal_multi_token_decode);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c.softmax_scale(), 1.0 / std::sqrt(192.0));
  EXPECT_EQ(c.rope_table_rows(), 0);
}

TEST(CheckpointFixture, KimiLinearConfigParses) {
  const Checkpoint ck = open_fixture("kimi_linear_tiny");
  const HfModelConfig& hf = ck.config();
  EXPECT_EQ(hf.model_type, "kimi_linear");
  EXPECT_EQ(hf.num_hidden_layers, 2);
  EXPECT_EQ(hf.mla_layers, (std::vector<int>{1}));
  const MlaConfig& c = hf.mla;
  EXPECT_EQ(c.hidden_size, 192);
  EXPECT_EQ(c.num_heads, 3);
  EXPECT_FALSE(c.q_lora_rank.has_value());  // "q_lora_rank": null
  EXPECT_FALSE(c.use_output_gate);          // key absent
  EXPECT_FALSE(c.use_rope);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.softmax_scale(), 1.0 / std::sqrt(192.0));
}

TEST(CheckpointFixture, DeepseekV3Fp8ConfigParses) {
  const Checkpoint ck = open_fixture("dsv3_fp8_tiny");
  const HfModelConfig& hf = ck.config();
  EXPECT_EQ(hf.model_type, "deepseek_v3");
  EXPECT_EQ(hf.num_hidden_layers, 1);
  EXPECT_EQ(hf.mla_layers, (std::vector<int>{0}));  // the MTP layer 1 is not a model layer
  const MlaConfig& c = hf.mla;
  EXPECT_EQ(c.hidden_size, 256);
  EXPECT_EQ(c.num_heads, 2);
  ASSERT_TRUE(c.q_lora_rank.has_value());
  EXPECT_EQ(*c.q_lora_rank, 128);
  EXPECT_FALSE(c.use_output_gate);
  EXPECT_TRUE(c.use_rope);
  EXPECT_EQ(c.rope.type, RopeType::deepseek_yarn);  // "type": "yarn"
  EXPECT_DOUBLE_EQ(c.rope.theta, 10000.0);
  EXPECT_DOUBLE_EQ(c.rope.factor, 40.0);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c.rope.beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(c.rope.beta_slow, 1.0);
  EXPECT_DOUBLE_EQ(c.rope.mscale, 1.0);
  EXPECT_DOUBLE_EQ(c.rope.mscale_all_dim, 1.0);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.max_position_embeddings, 163840);
  const double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_NEAR(c.softmax_scale(), m * m / std::sqrt(192.0), 1e-15);
  EXPECT_NEAR(c.softmax_scale(), 0.135234, 1e-6);  // model_configs.md
  EXPECT_EQ(c.rope_table_rows(), 4096 * 40);
}

// ---- The stored bytes -----------------------------------------------------------------------

TEST(CheckpointFixture, EveryStoredValueMatchesItsFormula) {
  const std::map<std::string, size_t> counts = {{"k3_tiny", 23}, {"kimi_linear_tiny", 12}, {"dsv3_fp8_tiny", 33}};
  for (const char* fx : kFixtures) {
    SCOPED_TRACE(fx);
    const Checkpoint ck = open_fixture(fx);
    EXPECT_EQ(ck.names().size(), counts.at(fx));
    for (const std::string& name : ck.names()) {
      const StTensor& t = ck.tensor(name);
      ASSERT_EQ(t.bytes, size_t(t.numel()) * st_dtype_size(t.dtype)) << name;
      Mismatch m;
      const uint32_t ns = salt(name);
      if (ends_with(name, ".weight_scale_inv")) {
        ASSERT_EQ(t.dtype, StDType::F32) << name;
        ASSERT_EQ(t.shape.size(), 2u) << name;
        // The grid covers the weight's blocks: [ceil(out/128), ceil(in/128)].
        const std::string w = name.substr(0, name.size() - std::string("_scale_inv").size());
        const StTensor& wt = ck.tensor(w);
        EXPECT_EQ(wt.dtype, StDType::F8_E4M3) << w;
        EXPECT_EQ(t.shape, (std::vector<int64_t>{(wt.shape[0] + 127) / 128, (wt.shape[1] + 127) / 128})) << name;
        for (int64_t r = 0; r < t.shape[0]; ++r)
          for (int64_t c = 0; c < t.shape[1]; ++c) {
            const float got = load_raw<float>(t, r * t.shape[1] + c), want = scale_value(ns, r, c);
            if (bits_of(got) != bits_of(want)) m.add(name, r * t.shape[1] + c, got, want);
          }
      } else if (ends_with(name, ".k_scale")) {
        ASSERT_EQ(t.dtype, StDType::F32) << name;
        EXPECT_TRUE(t.shape.empty()) << name;  // a 0-d tensor
        EXPECT_EQ(load_raw<float>(t, 0), 0.5f) << name;
      } else if (t.dtype == StDType::F8_E4M3) {
        for (int64_t i = 0; i < t.numel(); ++i) {
          const uint8_t got = load_raw<uint8_t>(t, i), want = fp8_code(ns, i);
          if (got != want) m.add(name, i, got, want);
        }
      } else if (t.dtype == StDType::BF16) {
        for (int64_t i = 0; i < t.numel(); ++i) {
          const uint16_t got = load_raw<uint16_t>(t, i), want = stored_bf16(ns, is_norm(name), i);
          if (got != want) m.add(name, i, bf16_float(got), bf16_float(want));
        }
      } else {
        ASSERT_EQ(t.dtype, StDType::F32) << name;
        for (int64_t i = 0; i < t.numel(); ++i) {
          const float got = load_raw<float>(t, i), want = base_value(ns, i);
          if (bits_of(got) != bits_of(want)) m.add(name, i, got, want);
        }
      }
      EXPECT_NO_MISMATCH(m);
    }
  }
}

TEST(CheckpointFixture, K3ShardsFollowTheIndex) {
  const Checkpoint ck = open_fixture("k3_tiny");
  std::ifstream in(fixture_dir("k3_tiny") + "/model.safetensors.index.json");
  const nlohmann::json index = nlohmann::json::parse(in);
  const auto& map = index.at("weight_map");
  EXPECT_EQ(map.size(), ck.names().size());
  uint64_t total = 0;
  std::set<std::string> files;
  for (const std::string& name : ck.names()) {
    ASSERT_TRUE(map.contains(name)) << name;
    EXPECT_EQ(std::filesystem::path(ck.file_of(name)).filename().string(), map[name].get<std::string>()) << name;
    files.insert(map[name].get<std::string>());
    total += ck.tensor(name).bytes;
  }
  EXPECT_EQ(files.size(), 2u);
  EXPECT_EQ(index.at("metadata").at("total_size").get<uint64_t>(), total);
  // Layer 1's attention is cut across the two shards, as real shards cut through layers.
  const std::string p = "language_model.model.layers.1.self_attn.";
  EXPECT_NE(ck.file_of(p + "q_a_proj.weight"), ck.file_of(p + "kv_b_proj.weight"));
  // The library's own metadata survives.
  const SafetensorsFile f = SafetensorsFile::open(ck.file_of(p + "q_a_proj.weight"));
  EXPECT_EQ(f.metadata().at("format"), "pt");
}

// ---- Loaded layers --------------------------------------------------------------------------

// One slot of MlaWeights and where its local rows/columns come from in the stored tensor.
struct Part {
  const char* name;
  const HostTensor* t;
  bool needed;
  int64_t row0, col0;  // offset of the local slice in the stored [out, in] tensor
};

std::vector<Part> parts_of(const MlaWeights& w, const MlaConfig& local) {
  const int64_t h0 = local.first_local_head();
  const bool lora = local.q_lora_rank.has_value();
  return {
      {"q_a_proj", &w.q_a_proj, lora, 0, 0},
      {"q_a_layernorm", &w.q_a_layernorm, lora, 0, 0},
      {"q_b_proj", &w.q_b_proj, lora, h0 * 192, 0},
      {"q_proj", &w.q_proj, !lora, h0 * 192, 0},
      {"kv_a_proj_with_mqa", &w.kv_a_proj_with_mqa, true, 0, 0},
      {"kv_a_layernorm", &w.kv_a_layernorm, true, 0, 0},
      {"kv_b_proj", &w.kv_b_proj, true, h0 * 256, 0},
      {"g_proj", &w.g_proj, local.use_output_gate, h0 * 128, 0},
      {"o_proj", &w.o_proj, true, 0, h0 * 128},
  };
}

// The bf16 value the loader must produce for stored element (r, c) of a weight: the stored
// bf16 bits, or for fp8 weights bf16(float(code) * scale_inv[r / 128][c / 128]).
struct Loaded {
  Loaded(const Checkpoint& ck, const std::string& name)
      : fp8(ck.tensor(name).dtype == StDType::F8_E4M3),
        norm(is_norm(name)),
        cols(ck.tensor(name).shape.size() == 2 ? ck.tensor(name).shape[1] : ck.tensor(name).shape[0]),
        s(salt(name)),
        s_scale(salt(name + "_scale_inv")) {}
  uint16_t operator()(int64_t r, int64_t c) const {
    const int64_t i = r * cols + c;
    if (!fp8) return stored_bf16(s, norm, i);
    return to_bf16(e4m3(fp8_code(s, i)) * scale_value(s_scale, r / 128, c / 128));
  }
  bool fp8, norm;
  int64_t cols;
  uint32_t s, s_scale;
};

// Checks every element of every tensor of `w`, loaded for `local` (possibly a
// tensor-parallel slice) from layer `layer`, against the closed forms.
void expect_layer(const Checkpoint& ck, int layer, const MlaConfig& local, const MlaWeights& w) {
  ASSERT_NO_THROW(w.validate(local));
  EXPECT_EQ(w.dtype(), DType::bf16);
  const std::string prefix = ck.attention_prefix(layer);
  for (const Part& p : parts_of(w, local)) {
    SCOPED_TRACE(p.name);
    const std::string name = prefix + p.name + ".weight";
    if (!p.needed) {
      EXPECT_TRUE(p.t->empty());
      EXPECT_FALSE(ck.has(name));
      EXPECT_EQ(w.fp8.count(p.name), 0u);
      continue;
    }
    ASSERT_FALSE(p.t->empty());
    const StTensor& st = ck.tensor(name);
    const bool matrix = st.shape.size() == 2;
    const int64_t rows = matrix ? p.t->dim(0) : 1, cols = matrix ? p.t->dim(1) : p.t->dim(0);
    Mismatch m;
    const auto* got = p.t->data<uint16_t>();
    const Loaded loaded(ck, name);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const uint16_t want = loaded(p.row0 + r, p.col0 + c);
        if (got[r * cols + c] != want) m.add(name, r * cols + c, bf16_float(got[r * cols + c]), bf16_float(want));
      }
    EXPECT_NO_MISMATCH(m);

    if (st.dtype != StDType::F8_E4M3) {
      EXPECT_EQ(w.fp8.count(p.name), 0u);
      continue;
    }
    // fp8: codes bit-exact, the scale grid the slice needs, offsets into the first block.
    ASSERT_EQ(w.fp8.count(p.name), 1u);
    const Fp8BlockWeight& f = w.fp8.at(p.name);
    const std::string sname = name + "_scale_inv";
    const uint32_t sw = salt(name), ss = salt(sname);
    ASSERT_EQ(f.codes.dim(0), rows);
    ASSERT_EQ(f.codes.dim(1), cols);
    EXPECT_EQ(f.row_offset, p.row0 % 128);
    EXPECT_EQ(f.col_offset, p.col0 % 128);
    const int64_t br0 = p.row0 / 128, bc0 = p.col0 / 128;
    ASSERT_EQ(f.scale_inv.dim(0), (p.row0 + rows - 1) / 128 - br0 + 1);
    ASSERT_EQ(f.scale_inv.dim(1), (p.col0 + cols - 1) / 128 - bc0 + 1);
    Mismatch mc, ms;
    for (int64_t i = 0; i < f.scale_inv.numel(); ++i) {
      const int64_t r = i / f.scale_inv.dim(1), c = i % f.scale_inv.dim(1);
      const float want = scale_value(ss, br0 + r, bc0 + c);
      if (f.scale_inv.data<float>()[i] != want) ms.add(sname, i, f.scale_inv.data<float>()[i], want);
    }
    const auto* codes = f.codes.data<uint8_t>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const uint8_t want = fp8_code(sw, (p.row0 + r) * st.shape[1] + p.col0 + c);
        if (codes[r * cols + c] != want) mc.add(name, r * cols + c, codes[r * cols + c], want);
        const float s = scale_value(ss, (p.row0 + r) / 128, (p.col0 + c) / 128);
        if (f.scale(r, c) != s) ms.add(sname + " via scale()", r * cols + c, f.scale(r, c), s);
      }
    EXPECT_NO_MISMATCH(mc);
    EXPECT_NO_MISMATCH(ms);
  }
}

TEST(CheckpointFixture, K3LayersLoadExactly) {
  const Checkpoint ck = open_fixture("k3_tiny");
  const MlaConfig& cfg = ck.config().mla;
  for (int layer : ck.config().mla_layers) {
    SCOPED_TRACE(layer);
    EXPECT_EQ(ck.attention_prefix(layer), "language_model.model.layers." + std::to_string(layer) + ".self_attn.");
    const MlaWeights w = load_layer_weights(ck, layer, cfg, DType::bf16);
    expect_layer(ck, layer, cfg, w);
    EXPECT_TRUE(w.fp8.empty());
    EXPECT_TRUE(w.q_proj.empty());
    EXPECT_EQ(w.k_scale, 1.0f);
    EXPECT_EQ(w.q_scale, 1.0f);
  }
}

TEST(CheckpointFixture, KimiLinearLayerLoadsExactlyWithKScale) {
  const Checkpoint ck = open_fixture("kimi_linear_tiny");
  const MlaConfig& cfg = ck.config().mla;
  const MlaWeights w = load_layer_weights(ck, 1, cfg, DType::bf16);
  expect_layer(ck, 1, cfg, w);
  EXPECT_FALSE(w.q_proj.empty());
  EXPECT_TRUE(w.q_a_proj.empty());
  EXPECT_TRUE(w.q_b_proj.empty());
  EXPECT_TRUE(w.g_proj.empty());
  EXPECT_EQ(w.k_scale, 0.5f);  // model.layers.1.self_attn.k_scale, an F32 0-d tensor
  EXPECT_EQ(w.q_scale, 1.0f);
}

TEST(CheckpointFixture, KimiLinearLoadsAsFp16) {
  // Every stored bf16 value here is exactly representable in fp16 (8 significant bits,
  // magnitude between 2^-22 and 1.125), so the one rounding to fp16 must be exact.
  const Checkpoint ck = open_fixture("kimi_linear_tiny");
  const MlaWeights w = load_layer_weights(ck, 1, ck.config().mla, DType::f16);
  EXPECT_EQ(w.dtype(), DType::f16);
  for (const Part& p : parts_of(w, ck.config().mla)) {
    if (!p.needed) continue;
    const std::string name = ck.attention_prefix(1) + p.name + ".weight";
    Mismatch m;
    const uint32_t ns = salt(name);
    for (int64_t i = 0; i < p.t->numel(); ++i) {
      const float got = fp16_float(p.t->data<uint16_t>()[i]), want = bf16_float(stored_bf16(ns, is_norm(name), i));
      if (got != want) m.add(name, i, got, want);
    }
    EXPECT_NO_MISMATCH(m);
  }
}

TEST(CheckpointFixture, DeepseekFp8LayersLoadExactly) {
  const Checkpoint ck = open_fixture("dsv3_fp8_tiny");
  const MlaConfig& cfg = ck.config().mla;
  // Layer 0 is the model's MLA layer; layer 1 (MTP) has the same tensors and loads the same way.
  for (int layer : {0, 1}) {
    SCOPED_TRACE(layer);
    const MlaWeights w = load_layer_weights(ck, layer, cfg, DType::bf16);
    expect_layer(ck, layer, cfg, w);
    std::vector<std::string> fp8;
    for (const auto& [name, f] : w.fp8) fp8.push_back(name);
    EXPECT_EQ(fp8, (std::vector<std::string>{"kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"}));
    // kv_a_proj_with_mqa has 576 rows: its last block row is half full.
    EXPECT_EQ(w.fp8.at("kv_a_proj_with_mqa").scale_inv.dim(0), 5);
    EXPECT_EQ(w.k_scale, 1.0f);
  }
}

TEST(CheckpointFixture, AbsorbedKvBFollowsTheHeadInterleave) {
  // kv_b_proj rows per head: [k_nope 128 | v 128]. W_UK_T[h][p][l] = kv_b[h*256 + p][l],
  // W_UV[h][l][v] = kv_b[h*256 + 128 + v][l].
  for (const char* fx : {"k3_tiny", "dsv3_fp8_tiny"}) {
    SCOPED_TRACE(fx);
    const Checkpoint ck = open_fixture(fx);
    const MlaConfig& cfg = ck.config().mla;
    const int layer = ck.config().mla_layers.front();
    const MlaWeights w = load_layer_weights(ck, layer, cfg, DType::bf16);
    const AbsorbedWeights a = absorb_kv_b(w.kv_b_proj, cfg.num_heads);
    const std::string name = ck.attention_prefix(layer) + "kv_b_proj.weight";
    const auto* uk = a.w_uk_t.data<uint16_t>();
    const auto* uv = a.w_uv.data<uint16_t>();
    const Loaded kv_b(ck, name);
    Mismatch m;
    for (int64_t h = 0; h < cfg.num_heads; ++h)
      for (int64_t l = 0; l < 512; ++l) {
        for (int64_t p = 0; p < 128; ++p) {
          const uint16_t want = kv_b(h * 256 + p, l), got = uk[(h * 128 + p) * 512 + l];
          if (got != want) m.add("W_UK_T", (h * 128 + p) * 512 + l, bf16_float(got), bf16_float(want));
        }
        for (int64_t v = 0; v < 128; ++v) {
          const uint16_t want = kv_b(h * 256 + 128 + v, l), got = uv[(h * 512 + l) * 128 + v];
          if (got != want) m.add("W_UV", (h * 512 + l) * 128 + v, bf16_float(got), bf16_float(want));
        }
      }
    EXPECT_NO_MISMATCH(m);
  }
}

// ---- Layers that are not MLA, and what the checks report ------------------------------------

TEST(CheckpointFixture, ExtraLayersAndTensorChecks) {
  {
    const Checkpoint ck = open_fixture("dsv3_fp8_tiny");
    EXPECT_EQ(extra_attention_layers(ck), (std::vector<int>{1}));  // the MTP layer
    EXPECT_EQ(check_layer_tensors(ck, 0, ck.config().mla), std::vector<std::string>{});
    EXPECT_EQ(check_layer_tensors(ck, 1, ck.config().mla), std::vector<std::string>{});
  }
  // Kimi models' KDA layers keep other tensors under self_attn (A_log, dt_bias, ...): they
  // are not MLA layers and not extra MLA layers either.
  {
    const Checkpoint ck = open_fixture("k3_tiny");
    EXPECT_EQ(extra_attention_layers(ck), std::vector<int>{});
    for (int layer : ck.config().mla_layers)
      EXPECT_EQ(check_layer_tensors(ck, layer, ck.config().mla), std::vector<std::string>{}) << layer;
    EXPECT_FALSE(check_layer_tensors(ck, 0, ck.config().mla).empty());  // the KDA layer
    EXPECT_FALSE(check_layer_tensors(ck, 2, ck.config().mla).empty());  // no tensors at all
    EXPECT_THROW(load_layer_weights(ck, 0, ck.config().mla, DType::bf16), Error);
  }
  {
    const Checkpoint ck = open_fixture("kimi_linear_tiny");
    EXPECT_EQ(extra_attention_layers(ck), std::vector<int>{});
    EXPECT_EQ(check_layer_tensors(ck, 1, ck.config().mla), std::vector<std::string>{});
  }
}

TEST(CheckpointFixture, WrongConfigIsRejectedNamingTheTensor) {
  const Checkpoint ck = open_fixture("kimi_linear_tiny");
  MlaConfig lora = ck.config().mla;  // claims q-LoRA: q_a_proj is missing, q_proj unexpected
  lora.q_lora_rank = 96;
  try {
    load_layer_weights(ck, 1, lora, DType::bf16);
    ADD_FAILURE() << "loading with a q-LoRA config did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.1.self_attn.q_"), std::string::npos) << e.what();
  }
  const std::vector<std::string> problems = check_layer_tensors(ck, 1, lora);
  EXPECT_EQ(problems.size(), 4u) << ::testing::PrintToString(problems);  // 3 missing, q_proj unexpected

  MlaConfig heads = ck.config().mla;  // wrong head count: q_proj, kv_b, o_proj mis-shaped
  heads.num_heads = 6;
  EXPECT_THROW(load_layer_weights(ck, 1, heads, DType::bf16), Error);
  EXPECT_EQ(check_layer_tensors(ck, 1, heads).size(), 3u);
}

// ---- Tensor parallelism -----------------------------------------------------------------------

TEST(CheckpointFixture, TensorParallelSlicesHoldTheirHeads) {
  struct Case {
    const char* fixture;
    int world;
  };
  // k3: 4 heads over 2 and 4 ranks; Kimi-Linear: 3 heads over 3; DeepSeek fp8: 2 heads over 2,
  // where rank 1's q_b rows start at 192, inside the second 128-row block.
  for (const Case& k : {Case{"k3_tiny", 2}, Case{"k3_tiny", 4}, Case{"kimi_linear_tiny", 3}, Case{"dsv3_fp8_tiny", 2}}) {
    const Checkpoint ck = open_fixture(k.fixture);
    const int layer = ck.config().mla_layers.back();
    for (int rank = 0; rank < k.world; ++rank) {
      SCOPED_TRACE(std::string(k.fixture) + " rank " + std::to_string(rank) + "/" + std::to_string(k.world));
      const MlaConfig local = ck.config().mla.tp_slice(rank, k.world);
      const MlaWeights w = load_layer_weights(ck, layer, local, DType::bf16);
      expect_layer(ck, layer, local, w);
      EXPECT_EQ(w.kv_b_proj.dim(0), int64_t(local.local_heads()) * 256);
      EXPECT_EQ(w.o_proj.dim(1), int64_t(local.local_heads()) * 128);
    }
  }
  // The case the fp8 slicing exists for, spelled out.
  const Checkpoint ck = open_fixture("dsv3_fp8_tiny");
  const MlaWeights w = load_layer_weights(ck, 0, ck.config().mla.tp_slice(1, 2), DType::bf16);
  const Fp8BlockWeight& qb = w.fp8.at("q_b_proj");
  EXPECT_EQ(qb.codes.dim(0), 192);
  EXPECT_EQ(qb.row_offset, 64);         // stored row 192 = block row 1, row 64 within it
  EXPECT_EQ(qb.scale_inv.dim(0), 2);    // stored block rows 1 and 2
  const std::string s = "model.layers.0.self_attn.q_b_proj.weight_scale_inv";
  EXPECT_EQ(qb.scale(0, 0), scale_value(s, 1, 0));
  EXPECT_EQ(qb.scale(63, 0), scale_value(s, 1, 0));
  EXPECT_EQ(qb.scale(64, 0), scale_value(s, 2, 0));  // stored row 256
  EXPECT_EQ(qb.scale(191, 0), scale_value(s, 2, 0));
}

}  // namespace
}  // namespace kmla
