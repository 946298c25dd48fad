// The layer's weights, [out, in] like Hugging Face checkpoints, in the activation
// dtype (bf16 or f16), for the local heads of a tensor-parallel rank.
#pragma once

#include <cstdint>

#include "kmla/config.hpp"
#include "kmla/tensor.hpp"

namespace kmla {

struct MlaWeights {
  HostTensor q_a_proj;            // [q_lora, hidden]           q-LoRA only
  HostTensor q_a_layernorm;       // [q_lora]                   q-LoRA only
  HostTensor q_b_proj;            // [H * 192, q_lora]          q-LoRA only
  HostTensor q_proj;              // [H * 192, hidden]          no q-LoRA
  HostTensor kv_a_proj_with_mqa;  // [576, hidden]              replicated
  HostTensor kv_a_layernorm;      // [512]
  HostTensor kv_b_proj;           // [H * 256, 512]             per head [k_nope 128 | v 128]
  HostTensor g_proj;              // [H * 128, hidden]          output gate only
  HostTensor o_proj;              // [hidden, H * 128]
  float k_scale = 1.0f;           // plain fp8 cache: stored = x / k_scale
  float q_scale = 1.0f;           // plain fp8 cache: decode query = x / q_scale

  DType dtype() const { return kv_b_proj.dtype(); }

  // Checks that every tensor the config needs is present with the local-head shapes,
  // that nothing unexpected is present, and that all share one dtype (bf16 or f16).
  void validate(const MlaConfig& cfg) const;

  // Random weights with realistic scales: N(0, 1/in) matrices, norms 1 + N(0, 0.1^2),
  // rounded to `dtype`. Deterministic in `seed`. Shapes follow cfg's local heads.
  static MlaWeights random(const MlaConfig& cfg, uint64_t seed, DType dtype = DType::bf16);

  // The slice of these (full, tp_size == 1) weights that rank `rank` of `world` holds:
  // rows of q_b/q_proj, kv_b and g_proj and columns of o_proj, by heads.
  MlaWeights tp_slice(const MlaConfig& full, int rank, int world) const;
};

// kv_b_proj [H*256, 512] split for the absorbed decode path (exact copies):
// W_UK_T [H, 128, 512] and W_UV [H, 512, 128].
struct AbsorbedWeights {
  HostTensor w_uk_t;
  HostTensor w_uv;
};
AbsorbedWeights absorb_kv_b(const HostTensor& kv_b_proj, int heads);

}  // namespace kmla
