// The layer's configuration: the model's MLA geometry, RoPE and gate switches, the
// tensor-parallel slice, and the values derived from them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kmla {

// MLA fixes these in every real model; kmla checks them at the API edge and
// specialises on them everywhere else.
inline constexpr int kKvLoraRank = 512;
inline constexpr int kRopeDim = 64;
inline constexpr int kNopeDim = 128;
inline constexpr int kVDim = 128;
inline constexpr int kLatentDim = kKvLoraRank + kRopeDim;  // 576: one cache row
inline constexpr int kQkHeadDim = kNopeDim + kRopeDim;     // 192
inline constexpr int kKvBOut = kNopeDim + kVDim;            // 256: kv_b rows per head

enum class RopeType : uint8_t { default_, deepseek_yarn, deepseek_llama_scaling };

const char* rope_type_name(RopeType t);

struct RopeParams {
  RopeType type = RopeType::default_;
  double theta = 10000.0;
  // YaRN (deepseek_yarn / deepseek_llama_scaling) only:
  double factor = 1.0;
  int64_t original_max_position_embeddings = 4096;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 0.0;  // the seed reads a missing key as False, i.e. 0
  double attn_factor = 1.0;
  double extrapolation_factor = 1.0;
};

// Maps a checkpoint's rope type the way the seed does: "default" stays; any other
// accepted type becomes deepseek_yarn, or deepseek_llama_scaling when
// apply_yarn_scaling is false. Unknown types throw kmla::Error.
RopeType map_rope_type(std::string_view hf_type, bool apply_yarn_scaling);

struct MlaConfig {
  std::string name = "custom";
  int hidden_size = 7168;
  int num_heads = 96;                 // total heads, before tensor parallelism
  std::optional<int> q_lora_rank;     // none: q_proj path (Kimi-Linear)
  int kv_lora_rank = kKvLoraRank;
  int qk_nope_head_dim = kNopeDim;
  int qk_rope_head_dim = kRopeDim;
  int v_head_dim = kVDim;
  double rms_norm_eps = 1e-5;
  bool use_rope = false;
  RopeParams rope;
  bool use_output_gate = false;
  bool non_causal_multi_token_decode = false;
  int64_t max_position_embeddings = 1 << 20;
  int tp_rank = 0;
  int tp_size = 1;

  // Throws kmla::Error naming the first bad field.
  void validate() const;

  int local_heads() const { return num_heads / tp_size; }
  int first_local_head() const { return tp_rank * local_heads(); }
  static constexpr int latent_dim() { return kLatentDim; }
  static constexpr int qk_head_dim() { return kQkHeadDim; }
  // 192^-0.5, times mscale^2 for deepseek_yarn (RoPE on): mscale = 0.1*mscale_all_dim*ln(factor)+1.
  double softmax_scale() const;
  // Rows of the RoPE table: original_max_position_embeddings * factor for the YaRN
  // types, max_position_embeddings for default. 0 when RoPE is off.
  int64_t rope_table_rows() const;

  // The same layer seen by one rank of a tensor-parallel group.
  MlaConfig tp_slice(int rank, int world_size) const;

  static MlaConfig preset(std::string_view name);
  static std::vector<std::string> preset_names();
};

}  // namespace kmla
