// Hugging Face config.json → MlaConfig, for the spellings real checkpoints use.
#include <gtest/gtest.h>

#include "kmla/error.hpp"
#include "kmla/hf_config.hpp"

namespace kmla {
namespace {

// Kimi-K3 nests the language model in text_config; its MLA layers are listed 1-based.
TEST(HfConfig, KimiK3TextConfig) {
  const HfModelConfig c = parse_hf_config(R"({
    "model_type": "kimi_k3",
    "text_config": {"model_type": "kimi_linear", "hidden_size": 7168, "num_attention_heads": 96,
      "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
      "v_head_dim": 128, "mla_use_nope": true, "mla_use_output_gate": true, "rms_norm_eps": 1e-5,
      "max_position_embeddings": 1048576, "num_hidden_layers": 93,
      "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48,
        52, 56, 60, 64, 68, 72, 76, 80, 84, 88, 92, 93]}}})");
  EXPECT_EQ(c.mla.hidden_size, 7168);
  EXPECT_EQ(c.mla.num_heads, 96);
  EXPECT_EQ(c.mla.q_lora_rank.value_or(0), 1536);
  EXPECT_FALSE(c.mla.use_rope);
  EXPECT_TRUE(c.mla.use_output_gate);
  EXPECT_NEAR(c.mla.softmax_scale(), 0.0721688, 1e-7);
  ASSERT_EQ(c.mla_layers.size(), 24u);
  EXPECT_EQ(c.mla_layers.front(), 3);
  EXPECT_EQ(c.mla_layers.back(), 92);
}

// Kimi-K2 (DeepSeek-V3 architecture): rope_scaling of type yarn becomes deepseek_yarn.
TEST(HfConfig, KimiK2RopeScaling) {
  const HfModelConfig c = parse_hf_config(R"({"model_type": "kimi_k2", "hidden_size": 7168,
    "num_attention_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 50000,
    "max_position_embeddings": 131072, "num_hidden_layers": 61,
    "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
      "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}})");
  EXPECT_TRUE(c.mla.use_rope);
  EXPECT_EQ(c.mla.rope.type, RopeType::deepseek_yarn);
  EXPECT_NEAR(c.mla.softmax_scale(), 0.130861, 1e-6);
  EXPECT_EQ(c.mla.rope_table_rows(), 4096 * 32);
  EXPECT_EQ(c.mla_layers.size(), 61u);
}

// The DSpark draft: rope_parameters spelling, non-causal decode blocks; apply_yarn_scaling
// false maps to deepseek_llama_scaling, whose softmax scale has no mscale^2.
TEST(HfConfig, DSparkRopeParameters) {
  const std::string base = R"({"model_type": "k3_dspark", "hidden_size": 7168, "num_attention_heads": 64,
    "q_lora_rank": 1536, "rms_norm_eps": 1e-5, "max_position_embeddings": 1048576, "num_hidden_layers": 5)";
  HfModelConfig c = parse_hf_config(base + "}");
  EXPECT_TRUE(c.mla.non_causal_multi_token_decode);
  EXPECT_EQ(c.mla.rope.type, RopeType::default_);
  EXPECT_EQ(c.mla.rope.theta, 50000);
  c = parse_hf_config(base + R"(, "rope_parameters": {"rope_type": "yarn", "factor": 32,
    "original_max_position_embeddings": 32768, "rope_theta": 50000, "beta_fast": 32, "beta_slow": 1,
    "mscale": 1, "mscale_all_dim": 1, "apply_yarn_scaling": false}})");
  EXPECT_EQ(c.mla.rope.type, RopeType::deepseek_llama_scaling);
  EXPECT_NEAR(c.mla.softmax_scale(), 0.0721688, 1e-7);
}

TEST(HfConfig, KimiLinearHasNoQLora) {
  const HfModelConfig c = parse_hf_config(R"({"model_type": "kimi_linear", "hidden_size": 2304,
    "num_attention_heads": 32, "q_lora_rank": null, "kv_lora_rank": 512, "mla_use_nope": true,
    "rms_norm_eps": 1e-5, "num_hidden_layers": 27,
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27]}})");
  EXPECT_FALSE(c.mla.q_lora_rank.has_value());
  EXPECT_FALSE(c.mla.use_output_gate);
  EXPECT_EQ(c.mla_layers, (std::vector<int>{3, 7, 11, 15, 19, 23, 26}));
}

TEST(HfConfig, BadConfigsNameTheProblem) {
  auto message = [](const std::string& text) {
    try {
      parse_hf_config(text, "cfg.json");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message("{not json").find("invalid JSON"), std::string::npos);
  EXPECT_NE(message(R"({"num_attention_heads": 8})").find("hidden_size"), std::string::npos);
  EXPECT_NE(message(R"({"hidden_size": 64, "num_attention_heads": 8, "kv_lora_rank": 256})").find("kv_lora_rank"),
            std::string::npos);
  EXPECT_NE(message(R"({"hidden_size": 64, "num_attention_heads": 8, "rope_scaling": {"type": "longrope"}})")
                .find("longrope"),
            std::string::npos);
  EXPECT_NE(message(R"({"hidden_size": "wide", "num_attention_heads": 8})").find("wrong type"), std::string::npos);
  EXPECT_NE(message(R"({"hidden_size": 64, "num_attention_heads": 8, "num_hidden_layers": 4,
    "linear_attn_config": {"full_attn_layers": [0]}})").find("1-based"), std::string::npos);
  EXPECT_NE(message(R"({"hidden_size": 64, "num_attention_heads": 8, "num_hidden_layers": 4,
    "linear_attn_config": {"full_attn_layers": [2, 2]}})").find("twice"), std::string::npos);
  EXPECT_NE(message(R"({"model_type": 5, "hidden_size": 64, "num_attention_heads": 8})").find("wrong type"),
            std::string::npos);
  EXPECT_NE(message(R"({"hidden_size": 4294967552, "num_attention_heads": 8})").find("4294967552"),
            std::string::npos);
}

}  // namespace
}  // namespace kmla
