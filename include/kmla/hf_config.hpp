// Reading a Hugging Face config.json (Kimi-K3, Kimi-Linear, the K3 DSpark draft,
// Kimi-K2 / DeepSeek-V3 / V2) into an MlaConfig, the way vLLM builds the layer.
#pragma once

#include <string>
#include <vector>

#include "kmla/config.hpp"

namespace kmla {

struct HfModelConfig {
  MlaConfig mla;
  std::string model_type;
  int num_hidden_layers = 0;
  std::vector<int> mla_layers;  // 0-based indices of the layers that are MLA
  // quantization_config: its method ("fp8", "compressed-tensors", ...; empty if none) and,
  // for block-fp8 recipes, weight_block_size. Which tensors it covers is read off their dtypes:
  // recipes that quantize only experts (Kimi-K3, K2-Thinking) leave attention in bf16.
  std::string quant_method;
  std::vector<int> weight_block_size;
};

// Parses the JSON text of a config.json. `source` names it in error messages.
HfModelConfig parse_hf_config(const std::string& json_text, const std::string& source = "config.json");
// Reads and parses a config.json file, or the config.json inside a model directory.
HfModelConfig load_hf_config(const std::string& path);

}  // namespace kmla
