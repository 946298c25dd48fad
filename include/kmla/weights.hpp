// The layer's weights, [out, in] like Hugging Face checkpoints, in the activation
// dtype (bf16 or f16), for the local heads of a tensor-parallel rank.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kmla/config.hpp"
#include "kmla/tensor.hpp"

namespace kmla {

// A projection stored as e4m3 codes with 128x128 block scales (the DeepSeek-V3 / Kimi-K2 fp8
// recipe). Backends run it as W8A8: activations are quantized per token and per 128 inputs
// (scale = max(amax, 1e-10) / 448, code = e4m3(x / scale)), and y = sum over blocks of
// (x8 . w8) * x_scale * w_scale. After tensor-parallel slicing a weight may start inside a
// block: local row r belongs to block row (r + row_offset) / 128 (columns likewise).
struct Fp8BlockWeight {
  static constexpr int kBlock = 128;
  HostTensor codes;      // e4m3 [out, in]
  HostTensor scale_inv;  // f32 [ceil((row_offset + out) / 128), ceil((col_offset + in) / 128)], a multiplier
  int row_offset = 0;
  int col_offset = 0;

  float scale(int64_t row, int64_t col) const {
    const int64_t cols = scale_inv.dim(1);
    return scale_inv.data<float>()[((row + row_offset) / kBlock) * cols + (col + col_offset) / kBlock];
  }
  // The dequantized weight in the activation dtype: float(code) * scale in fp32, one rounding.
  HostTensor dequantize(DType activation) const;
  // Rows [r0, r0 + n) or columns [c0, c0 + n), scales and offsets adjusted.
  Fp8BlockWeight slice_rows(int64_t r0, int64_t n) const;
  Fp8BlockWeight slice_cols(int64_t c0, int64_t n) const;
  void validate(const char* name) const;
};

// The activation quantization of the W8A8 recipe, for one token's row of `n` inputs:
// writes the dequantized values x8 * scale (exactly representable in fp32).
void quantize_activation_fp8(const float* x, int64_t n, float* dequantized);

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
  // fp8 block-quantized projections by name ("q_a_proj", "q_b_proj", "q_proj",
  // "kv_a_proj_with_mqa", "kv_b_proj", "g_proj", "o_proj"). Those listed run as W8A8; the
  // HostTensor of the same name holds their dequantized copy (used for the absorbed
  // W_UK_T / W_UV, which are bf16 by the recipe).
  std::map<std::string, Fp8BlockWeight> fp8;

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

  // A copy in which the named 16-bit projections (names as in `fp8`) are fp8 block weights,
  // as an fp8 checkpoint would hold them: per 128x128 block, scale = amax / 448 of the block
  // in fp32 (1 for an all-zero block) and code = e4m3_sat(w / scale); the 16-bit tensor is
  // replaced by the dequantized copy. Blocks start at this tensor's row and column 0. Throws
  // for a name that is not a projection, is absent or is already fp8.
  MlaWeights to_fp8_blocks(const std::vector<std::string>& names) const;
};

// kv_b_proj [H*256, 512] split for the absorbed decode path (exact copies):
// W_UK_T [H, 128, 512] and W_UV [H, 512, 128].
struct AbsorbedWeights {
  HostTensor w_uk_t;
  HostTensor w_uv;
};
AbsorbedWeights absorb_kv_b(const HostTensor& kv_b_proj, int heads);

}  // namespace kmla
