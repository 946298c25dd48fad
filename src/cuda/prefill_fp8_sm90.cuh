// The fp8 (e4m3) prefill kernel for Hopper (prefill_fp8_sm90.cu), reached from
// cuda::prefill_attention when PrefillParams::fp8 is set. Declared here for the dispatch, the
// tests and the benchmark; the public contract is PrefillParams' (cuda/attention.cuh).
#pragma once

#include "cuda/attention.cuh"

namespace kmla::cuda {

// Variants of the fp8 kernel, for tests and A/B timing with `kmla bench`. prefill_attention
// uses the defaults unless the environment (read once per process) says otherwise:
// KMLA_PREFILL_FP8_PINGPONG=0|1, KMLA_PREFILL_FP8_HEAD_GROUP=N, KMLA_PREFILL_FP8_LAZY=0|1,
// KMLA_PREFILL_FP8_CTAS=N (-1, 0 or positive).
struct Fp8PrefillOptions {
  // The two consumer warpgroups take turns issuing their MMAs (named barriers), so that one
  // warpgroup's softmax runs while the other's GEMMs are on the tensor cores.
  bool pingpong = false;
  // CTA order: heads in groups of this many, the longest query blocks of a group first
  // (0: all blocks of a head, then the next head).
  int head_group = 8;
  // Rescale O only when a row's max rose by more than a factor 2 (base-2 units 1): P is then
  // stored as 128 p with p <= 2 against the stale max, still <= 256 as e4m3. Skips the 64
  // multiplies and most of the rescale decisions on nearly every tile past the first few.
  bool lazy_rescale = true;
  // CTAs when PrefillParams::work_counter is set: 0 = one per SM, n > 0 = at most n (tests:
  // many items per CTA), -1 = one per item (as without the counter).
  int ctas = 0;
};

// Whether the current device can run the fp8 kernel: an sm_90 GPU and sm_90a code in this
// binary (asked once per device).
bool prefill_fp8_supported();

// The launch alone (prefill_attention validated p): for prefill_attention.cu and the tests.
void prefill_attention_fp8_launch(const PrefillParams& p, const Fp8PrefillOptions& opt,
                                  cudaStream_t stream);

// prefill_attention for fp8 inputs with explicit options (same validation as
// prefill_attention, which calls it with the options from the environment).
void prefill_attention_fp8(const PrefillParams& p, cudaStream_t stream,
                           const Fp8PrefillOptions& opt);

// Building-block probe for tests (one CTA, no pipeline; needs an sm_90 GPU): q [64, 192],
// k [160, 192], v [160, 128] dense e4m3 rows (device; one key tile); writes s_out = q k^T
// [64, 160] and o_out = e4m3(s_out) v [64, 128], fp32, computed by the kernel's smem
// layouts, descriptors, V transpose and P fragment packing.
void prefill_fp8_probe(const void* q, const void* k, const void* v, float* s_out, float* o_out,
                       cudaStream_t stream);

}  // namespace kmla::cuda
