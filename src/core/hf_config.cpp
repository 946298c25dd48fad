#include "kmla/hf_config.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kmla/error.hpp"

namespace kmla {

using nlohmann::json;

namespace {

template <class T>
T get_or(const json& j, const char* key, T fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  return it->get<T>();
}

// rope_parameters (new spelling) or rope_scaling (old), plus rope_theta beside them.
void read_rope(const json& t, MlaConfig& c, double default_theta) {
  const json* rp = nullptr;
  if (t.contains("rope_parameters") && t["rope_parameters"].is_object()) rp = &t["rope_parameters"];
  else if (t.contains("rope_scaling") && t["rope_scaling"].is_object()) rp = &t["rope_scaling"];
  c.rope = RopeParams{};
  c.rope.theta = get_or<double>(t, "rope_theta", default_theta);
  if (!rp) return;
  const json& p = *rp;
  c.rope.theta = get_or<double>(p, "rope_theta", c.rope.theta);
  std::string type = get_or<std::string>(p, "rope_type", get_or<std::string>(p, "type", "default"));
  c.rope.type = map_rope_type(type, get_or<bool>(p, "apply_yarn_scaling", true));
  if (c.rope.type == RopeType::default_) return;
  c.rope.factor = get_or<double>(p, "factor", 1.0);
  c.rope.original_max_position_embeddings = get_or<int64_t>(p, "original_max_position_embeddings", 4096);
  c.rope.beta_fast = get_or<double>(p, "beta_fast", 32.0);
  c.rope.beta_slow = get_or<double>(p, "beta_slow", 1.0);
  c.rope.mscale = get_or<double>(p, "mscale", 1.0);
  c.rope.mscale_all_dim = get_or<double>(p, "mscale_all_dim", 0.0);
  c.rope.attn_factor = get_or<double>(p, "attn_factor", 1.0);
  c.rope.extrapolation_factor = get_or<double>(p, "extrapolation_factor", 1.0);
}

// A positive int field read through int64, so 2^32 + 256 is an error rather than 256.
int int_field(const json& t, const char* key, const std::string& source) {
  const int64_t v = t[key].get<int64_t>();
  KMLA_CHECK(v > 0 && v <= (int64_t(1) << 30), source, ": ", key, " = ", v, " is out of range");
  return int(v);
}

}  // namespace

HfModelConfig parse_hf_config(const std::string& text, const std::string& source) {
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    KMLA_CHECK(false, source, ": invalid JSON: ", e.what());
  }
  KMLA_CHECK(root.is_object(), source, ": top level is not a JSON object");
  HfModelConfig out;
  // Multimodal wrappers (Kimi-K3) nest the language model in text_config.
  const json& t = root.contains("text_config") && root["text_config"].is_object() ? root["text_config"] : root;
  try {
    out.model_type = get_or<std::string>(root, "model_type", "");
    MlaConfig& c = out.mla;
    c.name = out.model_type.empty() ? get_or<std::string>(t, "model_type", "hf") : out.model_type;
    KMLA_CHECK(t.contains("hidden_size"), source, ": missing hidden_size");
    KMLA_CHECK(t.contains("num_attention_heads"), source, ": missing num_attention_heads");
    c.hidden_size = int_field(t, "hidden_size", source);
    c.num_heads = int_field(t, "num_attention_heads", source);
    if (t.contains("q_lora_rank") && !t["q_lora_rank"].is_null()) c.q_lora_rank = t["q_lora_rank"].get<int>();
    else c.q_lora_rank.reset();
    c.kv_lora_rank = get_or<int>(t, "kv_lora_rank", kKvLoraRank);
    c.qk_nope_head_dim = get_or<int>(t, "qk_nope_head_dim", kNopeDim);
    c.qk_rope_head_dim = get_or<int>(t, "qk_rope_head_dim", kRopeDim);
    c.v_head_dim = get_or<int>(t, "v_head_dim", kVDim);
    c.rms_norm_eps = get_or<double>(t, "rms_norm_eps", 1e-6);
    c.max_position_embeddings = get_or<int64_t>(t, "max_position_embeddings", 4096);
    c.use_output_gate = get_or<bool>(t, "mla_use_output_gate", false);
    // mla_use_nope (Kimi-Linear / K3) turns RoPE off; DeepSeek-style configs always rotate.
    c.use_rope = !get_or<bool>(t, "mla_use_nope", false);
    // The K3 DSpark draft: non-causal decode blocks, default RoPE with theta 50000 unless set.
    const std::string tt = get_or<std::string>(t, "model_type", out.model_type);
    const bool dspark = tt == "k3_dspark" || out.model_type == "k3_dspark";
    read_rope(t, c, dspark ? 50000.0 : 10000.0);
    c.non_causal_multi_token_decode = dspark;
    out.num_hidden_layers = get_or<int>(t, "num_hidden_layers", 0);
    std::vector<int> full;
    if (t.contains("linear_attn_config") && t["linear_attn_config"].is_object())
      full = get_or<std::vector<int>>(t["linear_attn_config"], "full_attn_layers", {});
    if (!full.empty()) {
      for (int l : full) {
        KMLA_CHECK(l >= 1 && l <= out.num_hidden_layers, source, ": full_attn_layers entry ", l,
                   " is outside 1..", out.num_hidden_layers, " (the list is 1-based)");
        KMLA_CHECK(std::find(out.mla_layers.begin(), out.mla_layers.end(), l - 1) == out.mla_layers.end(), source,
                   ": full_attn_layers lists layer ", l, " twice");
        out.mla_layers.push_back(l - 1);
      }
    } else {
      for (int l = 0; l < out.num_hidden_layers; ++l) out.mla_layers.push_back(l);
    }
    const json& q = root.contains("quantization_config") ? root["quantization_config"]
                    : t.contains("quantization_config") ? t["quantization_config"] : json();
    if (q.is_object()) {
      out.quant_method = get_or<std::string>(q, "quant_method", "unknown");
      out.weight_block_size = get_or<std::vector<int>>(q, "weight_block_size", {});
    }
    c.validate();
  } catch (const json::exception& e) {
    KMLA_CHECK(false, source, ": a field has the wrong type: ", e.what());
  }
  return out;
}

HfModelConfig load_hf_config(const std::string& path) {
  std::filesystem::path p(path);
  if (std::filesystem::is_directory(p)) p /= "config.json";
  std::ifstream in(p);
  KMLA_CHECK(in.good(), "cannot open ", p.string());
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_hf_config(ss.str(), p.string());
}

}  // namespace kmla
