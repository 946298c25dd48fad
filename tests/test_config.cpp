// MlaConfig presets, derived values (softmax scale, local heads, rope rows) and the
// validation errors, each of which must name the bad value.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "kmla/config.hpp"
#include "kmla/error.hpp"
#include "test_util.hpp"

using namespace kmla;

namespace {

using kmla::testing_util::expect_error_naming;

std::string six_digits(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

}  // namespace

TEST(Config, EveryPresetValidates) {
  const auto names = MlaConfig::preset_names();
  EXPECT_EQ(names.size(), 7u);
  for (const auto& n : names) {
    const MlaConfig c = MlaConfig::preset(n);
    EXPECT_EQ(c.name, n);
    EXPECT_NO_THROW(c.validate()) << n;
    EXPECT_EQ(c.kv_lora_rank, 512);
    EXPECT_EQ(c.tp_size, 1);
  }
}

TEST(Config, PresetShapes) {
  const MlaConfig k3 = MlaConfig::preset("kimi-k3");
  EXPECT_EQ(k3.hidden_size, 7168);
  EXPECT_EQ(k3.num_heads, 96);
  EXPECT_EQ(k3.q_lora_rank, 1536);
  EXPECT_FALSE(k3.use_rope);
  EXPECT_TRUE(k3.use_output_gate);
  EXPECT_EQ(k3.rms_norm_eps, 1e-5);
  const MlaConfig ds = MlaConfig::preset("kimi-k3-dspark");
  EXPECT_EQ(ds.num_heads, 64);
  EXPECT_TRUE(ds.use_rope);
  EXPECT_TRUE(ds.non_causal_multi_token_decode);
  EXPECT_FALSE(ds.use_output_gate);
  EXPECT_EQ(ds.rope.type, RopeType::default_);
  EXPECT_EQ(ds.rope.theta, 50000.0);
  const MlaConfig kl = MlaConfig::preset("kimi-linear-48b");
  EXPECT_FALSE(kl.q_lora_rank.has_value());
  EXPECT_EQ(kl.num_heads, 32);
  EXPECT_EQ(kl.hidden_size, 2304);
  const MlaConfig lite = MlaConfig::preset("deepseek-v2-lite");
  EXPECT_FALSE(lite.q_lora_rank.has_value());
  EXPECT_EQ(lite.rope.mscale, 0.707);
  EXPECT_EQ(lite.rope.mscale_all_dim, 0.707);
}

TEST(Config, SoftmaxScales) {
  // 192^-0.5 = 0.0721688; times (0.1 * mscale_all_dim * ln(factor) + 1)^2 for deepseek_yarn.
  const struct {
    const char* name;
    const char* want;
  } cases[] = {
      {"kimi-k3", "0.0721688"},          {"kimi-k2", "0.130861"},
      {"deepseek-v3", "0.135234"},       {"deepseek-v2-lite", "0.114721"},
      {"kimi-k3-dspark", "0.0721688"},   {"kimi-k3-dspark-yarn", "0.130861"},
      {"kimi-linear-48b", "0.0721688"},
  };
  for (const auto& c : cases) EXPECT_EQ(six_digits(MlaConfig::preset(c.name).softmax_scale()), c.want) << c.name;
  // The closed form, to double precision.
  const double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_DOUBLE_EQ(MlaConfig::preset("deepseek-v3").softmax_scale(), m * m / std::sqrt(192.0));
  // Only mscale_all_dim enters the softmax scale (the table uses mscale / mscale_all_dim).
  MlaConfig all0 = MlaConfig::preset("deepseek-v3");
  all0.rope.mscale = 1.0;
  all0.rope.mscale_all_dim = 0.0;
  EXPECT_DOUBLE_EQ(all0.softmax_scale(), 1.0 / std::sqrt(192.0));
  all0.rope.mscale = 0.5;
  all0.rope.mscale_all_dim = 2.0;
  const double m2 = 0.2 * std::log(40.0) + 1.0;
  EXPECT_DOUBLE_EQ(all0.softmax_scale(), m2 * m2 / std::sqrt(192.0));
  // No mscale when RoPE is off, even with yarn parameters present.
  MlaConfig off = MlaConfig::preset("deepseek-v3");
  off.use_rope = false;
  EXPECT_DOUBLE_EQ(off.softmax_scale(), 1.0 / std::sqrt(192.0));
  // factor <= 1: m = 1.
  MlaConfig f1 = MlaConfig::preset("deepseek-v3");
  f1.rope.factor = 1.0;
  EXPECT_DOUBLE_EQ(f1.softmax_scale(), 1.0 / std::sqrt(192.0));
}

TEST(Config, LlamaScalingHasNoMscale) {
  EXPECT_EQ(map_rope_type("yarn", true), RopeType::deepseek_yarn);
  EXPECT_EQ(map_rope_type("deepseek_yarn", true), RopeType::deepseek_yarn);
  EXPECT_EQ(map_rope_type("yarn", false), RopeType::deepseek_llama_scaling);
  EXPECT_EQ(map_rope_type("deepseek_yarn", false), RopeType::deepseek_llama_scaling);
  EXPECT_EQ(map_rope_type("default", false), RopeType::default_);
  EXPECT_EQ(map_rope_type("default", true), RopeType::default_);
  MlaConfig c = MlaConfig::preset("deepseek-v3");
  c.rope.type = map_rope_type("yarn", /*apply_yarn_scaling=*/false);
  EXPECT_NO_THROW(c.validate());
  EXPECT_DOUBLE_EQ(c.softmax_scale(), 1.0 / std::sqrt(192.0));
  // The table is still the YaRN one.
  EXPECT_EQ(c.rope_table_rows(), 4096 * 40);
  expect_error_naming([] { map_rope_type("linear", true); }, {"linear"});
  expect_error_naming([] { map_rope_type("llama3", false); }, {"llama3"});
  EXPECT_STREQ(rope_type_name(RopeType::deepseek_llama_scaling), "deepseek_llama_scaling");
}

TEST(Config, LocalHeads) {
  const MlaConfig k3 = MlaConfig::preset("kimi-k3");
  EXPECT_EQ(k3.local_heads(), 96);
  const MlaConfig t8 = k3.tp_slice(3, 8);
  EXPECT_EQ(t8.local_heads(), 12);
  EXPECT_EQ(t8.first_local_head(), 36);
  EXPECT_EQ(t8.tp_rank, 3);
  EXPECT_EQ(t8.tp_size, 8);
  const MlaConfig t16 = k3.tp_slice(15, 16);
  EXPECT_EQ(t16.local_heads(), 6);
  EXPECT_EQ(t16.first_local_head(), 90);
  // A slice of a slice is refused.
  expect_error_naming([&] { t8.tp_slice(0, 2); }, {"8"});
  // 128 heads per rank is the limit.
  MlaConfig big = k3;
  big.num_heads = 256;
  expect_error_naming([&] { big.validate(); }, {"256"});
  EXPECT_EQ(big.tp_slice(1, 2).local_heads(), 128);
}

TEST(Config, BadValuesNameTheValue) {
  const MlaConfig k3 = MlaConfig::preset("kimi-k3");
  expect_error_naming([&] { k3.tp_slice(0, 5); }, {"96", "5"});
  expect_error_naming([&] { k3.tp_slice(8, 8); }, {"rank 8"});
  expect_error_naming([&] { k3.tp_slice(-1, 8); }, {"-1"});
  expect_error_naming([&] { k3.tp_slice(0, 0); }, {"got 0"});
  {
    MlaConfig c = k3;
    c.kv_lora_rank = 256;
    expect_error_naming([&] { c.validate(); }, {"kv_lora_rank", "256"});
  }
  {
    MlaConfig c = k3;
    c.qk_rope_head_dim = 32;
    expect_error_naming([&] { c.validate(); }, {"qk_rope_head_dim", "32"});
  }
  {
    MlaConfig c = k3;
    c.v_head_dim = 192;
    expect_error_naming([&] { c.validate(); }, {"v_head_dim", "192"});
  }
  {
    MlaConfig c = k3;
    c.hidden_size = -7;
    expect_error_naming([&] { c.validate(); }, {"hidden_size", "-7"});
  }
  {
    MlaConfig c = k3;
    c.q_lora_rank = 0;
    expect_error_naming([&] { c.validate(); }, {"q_lora_rank"});
  }
  {
    MlaConfig c = k3;
    c.rms_norm_eps = 0;
    expect_error_naming([&] { c.validate(); }, {"rms_norm_eps"});
  }
  {
    MlaConfig c = MlaConfig::preset("deepseek-v3");
    c.rope.factor = -2;
    expect_error_naming([&] { c.validate(); }, {"factor", "-2"});
  }
  {
    MlaConfig c = MlaConfig::preset("kimi-k3-dspark");
    c.rope.theta = 0;
    expect_error_naming([&] { c.validate(); }, {"rope_theta", "0"});
  }
  expect_error_naming([] { MlaConfig::preset("kimi-k9"); }, {"kimi-k9", "kimi-k3"});
}

TEST(Config, RopeTableRows) {
  EXPECT_EQ(MlaConfig::preset("kimi-k3").rope_table_rows(), 0);  // NoPE
  EXPECT_EQ(MlaConfig::preset("kimi-linear-48b").rope_table_rows(), 0);
  EXPECT_EQ(MlaConfig::preset("deepseek-v3").rope_table_rows(), 163840);
  EXPECT_EQ(MlaConfig::preset("kimi-k2").rope_table_rows(), 131072);
  EXPECT_EQ(MlaConfig::preset("kimi-k3-dspark-yarn").rope_table_rows(), 1048576);
  EXPECT_EQ(MlaConfig::preset("kimi-k3-dspark").rope_table_rows(), 1048576);
}
