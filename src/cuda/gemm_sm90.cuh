// Hopper (sm_90a) GEMM for few tokens: the decode step's projections, where cuBLASLt's
// 128-row output tiles leave most SMs idle (q_b at 128 tokens: 18 tiles on 132 SMs) and its
// split-K forms lose to their separate reduction.
//
// For b < batch: C_b[M, N] = A_b[M, K] . W_b^T with M <= 128 tokens, fp32 accumulation and one
// rounding. W_b is [N, K] (K-major: a Hugging Face [out, in] weight, Blas::linear) or [K, N]
// (N-major: Blas::batched_nn's B operand). The work, (tile of 256 outputs, 64-deep k block)
// units, is cut into one contiguous range per CTA (stream-K): every SM streams the same number
// of weight bytes whatever the shape. A tile whose k range spans several CTAs is summed from fp32
// partials in a workspace by a second kernel, in CTA order, so results do not depend on timing.
// Measurements: docs/PERF.md (2026-12-05, fifth session).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/common.cuh"

namespace kmla::cuda {

struct SkinnyGemm {
  int batch = 1;
  int64_t M = 0, N = 0, K = 0;
  const void* A = nullptr;  // A_b = A + b * stride_a, rows lda apart (elements)
  int64_t lda = 0, stride_a = 0;
  const void* W = nullptr;  // W_b = W + b * stride_w, rows ldw apart
  int64_t ldw = 0, stride_w = 0;
  bool w_n_major = false;  // W_b is [K, N] (true) or [N, K] (false)
  void* C = nullptr;       // C_b = C + b * stride_c, rows ldc apart
  int64_t ldc = 0, stride_c = 0;
  DType act = DType::bf16;
};

// Output tiles of one launch, at most.
inline constexpr int kSkinnyMaxTiles = 4096;
// CTAs of one launch, at most.
inline constexpr int kSkinnyMaxCtas = 1024;

// Why the kernel cannot take `g` on the current device (null: it can): shape (M in 1..128),
// type, the 16-byte rules of its bulk copies (A, W addresses and strides), 4-byte C stores
// (C, N, ldc, stride_c even), the tile count. Host checks only, no device work.
const char* skinny_refusal(const SkinnyGemm& g);

// CTAs for `g` on `sms` SMs: the work split so that each CTA has at least `min_units` units,
// at most one per SM, and the partials of all split tiles fit `workspace_bytes`. 0: they
// cannot fit.
int skinny_ctas(const SkinnyGemm& g, int sms, int min_units, size_t workspace_bytes);

// Launches the kernel on `stream` with `ctas` CTAs (skinny_ctas), and the reduction of split
// tiles after it (`pdl`: as a programmatic dependent launch, which hides its launch behind
// the GEMM's tail). `workspace` (at least workspace_bytes, as passed to skinny_ctas) holds the
// partials; calls sharing it must be stream-ordered. False if the driver cannot encode the
// tensor maps (nothing launched).
bool skinny_gemm(const SkinnyGemm& g, int ctas, void* workspace, cudaStream_t stream,
                 bool pdl = true);

}  // namespace kmla::cuda
