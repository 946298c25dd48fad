// Hugging Face model directories: config.json plus one safetensors file or a sharded set
// (model.safetensors.index.json), and a safetensors writer so tests and users can make them.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kmla/hf_config.hpp"
#include "kmla/safetensors.hpp"

namespace kmla {

struct StWriteTensor {
  std::string name;
  StDType dtype = StDType::F32;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // numel * dtype size bytes
};

// Writes a safetensors file (header padded to 8 bytes, payload in the given order).
void write_safetensors(const std::string& path, const std::vector<StWriteTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

class Checkpoint {
 public:
  // Opens a model directory: config.json, then model.safetensors.index.json (sharded) or
  // every *.safetensors file in it. Every file's header is validated; a tensor named in two
  // files, or an index entry whose file or tensor is missing, is an error.
  static Checkpoint open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const HfModelConfig& config() const { return config_; }
  bool has(const std::string& name) const { return where_.count(name) != 0; }
  // Throws kmla::Error naming the directory and tensor when absent.
  const StTensor& tensor(const std::string& name) const;
  const std::string& file_of(const std::string& name) const;
  std::vector<std::string> names() const;
  // Tensors of one layer's attention block: "model.layers.{i}.self_attn." or the same under
  // "language_model." (multimodal wrappers such as Kimi-K3). Throws if neither exists.
  std::string attention_prefix(int layer) const;

 private:
  std::string dir_;
  HfModelConfig config_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, std::pair<size_t, std::string>> where_;  // name -> (file index, path)
};

}  // namespace kmla

namespace kmla {

struct MlaWeights;
struct MlaConfig;
enum class DType : uint8_t;

// The tensor names of one attention layer, as Hugging Face checkpoints spell them
// (without the "model.layers.{i}.self_attn." prefix and the ".weight" suffix).
const std::vector<std::string>& mla_projection_names();

// Loads layer `layer`'s attention weights for `cfg` (which may be a tensor-parallel slice:
// the full tensors are read, checked against the unsliced shapes, then sliced). 16-bit and
// f32 tensors are converted to `activation` with one rounding; F8_E4M3 projections with
// 128x128 `weight_scale_inv` stay fp8 for W8A8 and are also dequantized once (fp32 multiply,
// one rounding). k_scale / q_scale are read when present. Errors name the file and tensor.
MlaWeights load_layer_weights(const Checkpoint& ck, int layer, const MlaConfig& cfg, DType activation);

// What `load_layer_weights` would object to, without loading: missing, unexpected or
// mis-shaped tensors and unsupported dtypes, one message each (empty when the layer is fine).
std::vector<std::string> check_layer_tensors(const Checkpoint& ck, int layer, const MlaConfig& cfg);

// Layer indices that hold MLA attention tensors (kv_a_proj_with_mqa) in the checkpoint but are
// not MLA layers of the model (e.g. DeepSeek-V3's multi-token-prediction layer 61). Kimi's KDA
// layers, whose self_attn tensors are of another kind, are not listed.
std::vector<int> extra_attention_layers(const Checkpoint& ck);

}  // namespace kmla
