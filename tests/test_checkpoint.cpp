// Checkpoints written with kmla's writer under real key names: read back exactly, run the
// same layer as the weights given directly, and fail loudly on every malformed input.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "kmla/checkpoint.hpp"
#include "kmla/layer.hpp"
#include "kmla/numeric.hpp"
#include "verify/cases.hpp"

namespace kmla {
namespace {

namespace fs = std::filesystem;

std::string fresh_dir(const std::string& name) {
  const fs::path p = fs::path(::testing::TempDir()) / ("kmla_ck_" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

void write_text(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

// A K3-style config (q-LoRA, gate, NoPE) with MLA layers 1 and 3 (1-based 2 and 4).
const char* kK3Config = R"({"model_type": "kimi_k3", "text_config": {"model_type": "kimi_linear",
  "hidden_size": 256, "num_attention_heads": 4, "q_lora_rank": 96, "kv_lora_rank": 512,
  "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": true,
  "mla_use_output_gate": true, "rms_norm_eps": 1e-5, "num_hidden_layers": 4,
  "max_position_embeddings": 4096, "linear_attn_config": {"full_attn_layers": [2, 4]}}})";

struct Named {
  std::string name;
  const HostTensor* t;
};

std::vector<Named> named(const MlaWeights& w, const std::string& prefix) {
  std::vector<Named> out;
  auto add = [&](const char* n, const HostTensor& t) {
    if (!t.empty()) out.push_back({prefix + n + ".weight", &t});
  };
  add("q_a_proj", w.q_a_proj);
  add("q_a_layernorm", w.q_a_layernorm);
  add("q_b_proj", w.q_b_proj);
  add("q_proj", w.q_proj);
  add("kv_a_proj_with_mqa", w.kv_a_proj_with_mqa);
  add("kv_a_layernorm", w.kv_a_layernorm);
  add("kv_b_proj", w.kv_b_proj);
  add("g_proj", w.g_proj);
  add("o_proj", w.o_proj);
  return out;
}

StWriteTensor st(const std::string& name, const HostTensor& t) {
  StWriteTensor s{name, t.dtype() == DType::bf16 ? StDType::BF16 : StDType::F16, {}, t.data<void>()};
  for (int i = 0; i < t.view().ndim; ++i) s.shape.push_back(t.dim(i));
  return s;
}

// Writes layers 1 and 3 of a K3-style model, sharded over two files with an index.
struct K3Checkpoint {
  std::string dir;
  MlaConfig cfg;
  MlaWeights w1, w3;
};

K3Checkpoint write_k3(const std::string& name) {
  K3Checkpoint k;
  k.dir = fresh_dir(name);
  write_text(k.dir + "/config.json", kK3Config);
  k.cfg = load_hf_config(k.dir).mla;
  k.w1 = MlaWeights::random(k.cfg, 11);
  k.w3 = MlaWeights::random(k.cfg, 13);
  std::vector<StWriteTensor> a, b;
  for (const Named& n : named(k.w1, "language_model.model.layers.1.self_attn.")) a.push_back(st(n.name, *n.t));
  for (const Named& n : named(k.w3, "language_model.model.layers.3.self_attn.")) b.push_back(st(n.name, *n.t));
  HostTensor mlp(DType::bf16, {8, 8});
  a.push_back(st("language_model.model.layers.1.mlp.up.weight", mlp));
  write_safetensors(k.dir + "/model-00001-of-00002.safetensors", a);
  write_safetensors(k.dir + "/model-00002-of-00002.safetensors", b);
  std::string index = R"({"metadata": {}, "weight_map": {)";
  bool first = true;
  for (const auto& [list, file] : {std::pair{&a, "model-00001-of-00002.safetensors"},
                                   std::pair{&b, "model-00002-of-00002.safetensors"}})
    for (const StWriteTensor& t : *list) {
      index += std::string(first ? "" : ", ") + "\"" + t.name + "\": \"" + file + "\"";
      first = false;
    }
  write_text(k.dir + "/model.safetensors.index.json", index + "}}");
  return k;
}

bool same(const HostTensor& a, const HostTensor& b) {
  return a.empty() == b.empty() && a.bytes() == b.bytes() &&
         (a.empty() || std::memcmp(a.data<void>(), b.data<void>(), a.bytes()) == 0);
}

TEST(Checkpoint, RoundTripEveryDtype) {
  const std::string dir = fresh_dir("dtypes");
  const uint8_t u8[3] = {1, 2, 255};
  const float f32[2] = {1.5f, -0.0f};
  const double f64[2] = {3.25, -1e300};
  const uint16_t b16[2] = {0x3f80, 0xc000};
  const int64_t i64[2] = {-5, int64_t(1) << 40};
  const int32_t i32[1] = {-7};
  const uint8_t e4m3[2] = {0x38, 0xfe};
  write_safetensors(dir + "/t.safetensors",
                    {{"u8", StDType::U8, {3}, u8}, {"f32", StDType::F32, {1, 2}, f32},
                     {"f64", StDType::F64, {2}, f64}, {"bf16", StDType::BF16, {2}, b16},
                     {"f16", StDType::F16, {2, 1}, b16}, {"i64", StDType::I64, {2}, i64},
                     {"i32", StDType::I32, {1}, i32}, {"fp8", StDType::F8_E4M3, {2}, e4m3},
                     {"empty", StDType::F32, {0, 4}, nullptr}},
                    {{"format", "pt"}});
  const SafetensorsFile f = SafetensorsFile::open(dir + "/t.safetensors");
  EXPECT_EQ(f.metadata().at("format"), "pt");
  auto check = [&](const char* n, StDType dt, std::vector<int64_t> shape, const void* data, size_t bytes) {
    const StTensor& t = f.tensor(n);
    EXPECT_EQ(t.dtype, dt) << n;
    EXPECT_EQ(t.shape, shape) << n;
    ASSERT_EQ(t.bytes, bytes) << n;
    EXPECT_EQ(bytes == 0 || std::memcmp(t.data, data, bytes) == 0, true) << n;
  };
  check("u8", StDType::U8, {3}, u8, 3);
  check("f32", StDType::F32, {1, 2}, f32, 8);
  check("f64", StDType::F64, {2}, f64, 16);
  check("bf16", StDType::BF16, {2}, b16, 4);
  check("f16", StDType::F16, {2, 1}, b16, 4);
  check("i64", StDType::I64, {2}, i64, 16);
  check("i32", StDType::I32, {1}, i32, 4);
  check("fp8", StDType::F8_E4M3, {2}, e4m3, 2);
  check("empty", StDType::F32, {0, 4}, nullptr, 0);
}

TEST(Checkpoint, ShardedK3LayersLoadExactly) {
  const K3Checkpoint k = write_k3("k3");
  const Checkpoint ck = Checkpoint::open(k.dir);
  EXPECT_EQ(ck.config().mla_layers, (std::vector<int>{1, 3}));
  EXPECT_EQ(ck.attention_prefix(3), "language_model.model.layers.3.self_attn.");
  EXPECT_TRUE(check_layer_tensors(ck, 1, k.cfg).empty());
  EXPECT_TRUE(extra_attention_layers(ck).empty());
  for (auto [layer, want] : {std::pair{1, &k.w1}, std::pair{3, &k.w3}}) {
    const MlaWeights got = load_layer_weights(ck, layer, k.cfg, DType::bf16);
    EXPECT_TRUE(same(got.q_a_proj, want->q_a_proj));
    EXPECT_TRUE(same(got.q_a_layernorm, want->q_a_layernorm));
    EXPECT_TRUE(same(got.q_b_proj, want->q_b_proj));
    EXPECT_TRUE(same(got.kv_a_proj_with_mqa, want->kv_a_proj_with_mqa));
    EXPECT_TRUE(same(got.kv_a_layernorm, want->kv_a_layernorm));
    EXPECT_TRUE(same(got.kv_b_proj, want->kv_b_proj));
    EXPECT_TRUE(same(got.g_proj, want->g_proj));
    EXPECT_TRUE(same(got.o_proj, want->o_proj));
    EXPECT_TRUE(got.q_proj.empty());
  }
}

// The layer built from the checkpoint computes exactly what the same weights given directly
// compute; and a TP rank's slice equals slicing the loaded weights.
TEST(Checkpoint, LayerFromCheckpointMatchesDirectWeights) {
  const K3Checkpoint k = write_k3("k3_layer");
  const Checkpoint ck = Checkpoint::open(k.dir);
  verify::Case c = verify::mixed_case(k.cfg, CacheFormat::bf16, 16, 3);
  const verify::Inputs in = verify::make_inputs(c);
  auto run = [&](const MlaConfig& cfg, const MlaWeights& w) {
    LayerOptions lo;
    lo.partial_output = cfg.tp_size > 1;
    MlaLayer layer(cfg, w, lo);
    HostTensor out(DType::bf16, {in.md.num_rows, cfg.hidden_size});
    LatentCache cache = in.cache.clone();
    layer.forward(in.positions.view(), in.hidden.view(), &in.md, cache, out.view());
    return out;
  };
  EXPECT_TRUE(same(run(k.cfg, load_layer_weights(ck, 3, k.cfg, DType::bf16)), run(k.cfg, k.w3)));
  const MlaConfig rank1 = k.cfg.tp_slice(1, 2);
  EXPECT_TRUE(same(run(rank1, load_layer_weights(ck, 3, rank1, DType::bf16)), run(rank1, k.w3.tp_slice(k.cfg, 1, 2))));
}

std::string load_error(const std::string& dir, int layer = 1) {
  try {
    const Checkpoint ck = Checkpoint::open(dir);
    load_layer_weights(ck, layer, ck.config().mla, DType::bf16);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(Checkpoint, MalformedCheckpointsNameFileAndTensor) {
  const K3Checkpoint k = write_k3("bad");
  const std::string shard1 = k.dir + "/model-00001-of-00002.safetensors";
  const std::string prefix = "language_model.model.layers.1.self_attn.";
  HostTensor mlp(DType::bf16, {8, 8});
  auto rewrite_shard1 = [&](const MlaWeights& w, std::vector<StWriteTensor> extra = {}) {
    std::vector<StWriteTensor> a;
    for (const Named& n : named(w, prefix)) a.push_back(st(n.name, *n.t));
    for (auto& e : extra) a.push_back(e);
    a.push_back(st("language_model.model.layers.1.mlp.up.weight", mlp));
    write_safetensors(shard1, a);
  };
  // A missing tensor (the index still lists it: the index check names it).
  MlaWeights w = k.w1;
  w.g_proj = HostTensor();
  rewrite_shard1(w);
  std::string e = load_error(k.dir);
  EXPECT_NE(e.find(prefix + "g_proj.weight"), std::string::npos) << e;
  // A wrong shape, named with its file.
  w = k.w1;
  w.kv_b_proj = HostTensor(DType::bf16, {3 * 256, 512});
  rewrite_shard1(w);
  e = load_error(k.dir);
  EXPECT_NE(e.find("kv_b_proj.weight' has shape [768, 512], the config needs [1024, 512]"), std::string::npos) << e;
  EXPECT_NE(e.find("model-00001-of-00002.safetensors"), std::string::npos) << e;
  // A wrong dtype.
  {
    std::vector<StWriteTensor> a;
    for (const Named& n : named(k.w1, prefix))
      a.push_back(n.name == prefix + "kv_a_layernorm.weight" ? StWriteTensor{n.name, StDType::I16, {512}, n.t->data<void>()}
                                                             : st(n.name, *n.t));
    a.push_back(st("language_model.model.layers.1.mlp.up.weight", mlp));
    write_safetensors(shard1, a);
  }
  e = load_error(k.dir);
  EXPECT_NE(e.find("kv_a_layernorm.weight' has dtype I16"), std::string::npos) << e;
  // An fp8 weight without its scales.
  {
    std::vector<StWriteTensor> a;
    HostTensor codes(DType::e4m3, {k.cfg.hidden_size, 4 * 128});
    for (const Named& n : named(k.w1, prefix))
      a.push_back(n.name == prefix + "o_proj.weight"
                      ? StWriteTensor{n.name, StDType::F8_E4M3, {k.cfg.hidden_size, 4 * 128}, codes.data<void>()}
                      : st(n.name, *n.t));
    a.push_back(st("language_model.model.layers.1.mlp.up.weight", mlp));
    write_safetensors(shard1, a);
  }
  e = load_error(k.dir);
  EXPECT_NE(e.find("o_proj.weight_scale_inv' is missing"), std::string::npos) << e;
  // A tensor the config does not use (q_proj in a q-LoRA model); without an index.
  const std::string index = k.dir + "/model.safetensors.index.json";
  fs::rename(index, index + ".saved");
  HostTensor q(DType::bf16, {4 * 192, 256});
  rewrite_shard1(k.w1, {st(prefix + "q_proj.weight", q)});
  e = load_error(k.dir);
  EXPECT_NE(e.find("q_proj.weight' exists but the config"), std::string::npos) << e;
  // The index names a tensor the file does not hold, or a file outside the directory.
  rewrite_shard1(k.w1);
  fs::rename(index + ".saved", index);
  EXPECT_EQ(load_error(k.dir), "no error");
  write_text(k.dir + "/model.safetensors.index.json",
             R"({"weight_map": {"language_model.model.layers.1.self_attn.ghost.weight": "model-00001-of-00002.safetensors"}})");
  e = load_error(k.dir);
  EXPECT_NE(e.find("ghost.weight' is listed in"), std::string::npos) << e;
  write_text(k.dir + "/model.safetensors.index.json", R"({"weight_map": {"x": "../etc/passwd"}})");
  EXPECT_NE(load_error(k.dir).find("outside the directory"), std::string::npos);
  write_text(k.dir + "/model.safetensors.index.json", "{oops");
  EXPECT_NE(load_error(k.dir).find("invalid JSON"), std::string::npos);
  // A layer the checkpoint does not have.
  fs::remove(index);
  EXPECT_NE(load_error(k.dir, 2).find("no attention tensors for layer 2"), std::string::npos);
  // A truncated shard.
  fs::resize_file(shard1, fs::file_size(shard1) - 100);
  e = load_error(k.dir);
  EXPECT_NE(e.find("outside the"), std::string::npos) << e;
  // A config that contradicts the weights.
  write_text(k.dir + "/config.json", std::string(kK3Config).replace(std::string(kK3Config).find("\"num_attention_heads\": 4"), 24, "\"num_attention_heads\": 8"));
  fs::remove(shard1);
  EXPECT_NE(load_error(k.dir, 3).find("the config needs"), std::string::npos);
}

// A tensor stored in two shards is ambiguous: refuse it.
TEST(Checkpoint, DuplicateTensorAcrossShardsIsAnError) {
  const std::string dir = fresh_dir("dup");
  write_text(dir + "/config.json", kK3Config);
  const float x = 1;
  write_safetensors(dir + "/a.safetensors", {{"t", StDType::F32, {1}, &x}});
  write_safetensors(dir + "/b.safetensors", {{"t", StDType::F32, {1}, &x}});
  try {
    Checkpoint::open(dir);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("appears in both"), std::string::npos) << e.what();
  }
}

// fp8 block weights: kept as codes + scales for W8A8, dequantized once for the bf16 copy,
// and sliced exactly even when a rank's rows start inside a 128-row block.
TEST(Checkpoint, Fp8BlockWeightsDequantizeOnceAndSliceExactly) {
  Fp8BlockWeight f;
  f.codes = HostTensor(DType::e4m3, {384, 200});
  f.scale_inv = HostTensor(DType::f32, {3, 2});
  for (int64_t i = 0; i < f.codes.numel(); ++i) f.codes.data<uint8_t>()[i] = uint8_t((i * 37) % 126);
  for (int i = 0; i < 6; ++i) f.scale_inv.data<float>()[i] = 0.001f * float(i + 1) * (i % 2 ? 1.5f : 1.0f);
  f.validate("w");
  const HostTensor d = f.dequantize(DType::bf16);
  for (int64_t r = 0; r < 384; r += 7)
    for (int64_t c = 0; c < 200; c += 3) {
      const float want = e4m3_to_float(f.codes.data<uint8_t>()[r * 200 + c]) * f.scale_inv.data<float>()[(r / 128) * 2 + c / 128];
      ASSERT_EQ(d.data<uint16_t>()[r * 200 + c], float_to_bf16(want)) << r << "," << c;
    }
  const Fp8BlockWeight s = f.slice_rows(192, 192);  // starts half-way into block 1
  EXPECT_EQ(s.row_offset, 64);
  EXPECT_EQ(s.scale_inv.dim(0), 2);
  const Fp8BlockWeight t = f.slice_cols(100, 100);
  EXPECT_EQ(t.col_offset, 100);
  for (int64_t r = 0; r < 192; ++r)
    for (int64_t c = 0; c < 200; c += 13) ASSERT_EQ(s.scale(r, c), f.scale(r + 192, c));
  for (int64_t r = 0; r < 384; r += 11)
    for (int64_t c = 0; c < 100; ++c) ASSERT_EQ(t.scale(r, c), f.scale(r, c + 100));
}

}  // namespace
}  // namespace kmla
