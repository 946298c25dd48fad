// Internals of cuda::prefill_attention (declared in cuda/attention.cuh) that the tests and
// the benchmark reach past the public entry point: the choice of tiling, and a launch with a
// given tiling so that tests cover both without environment variables.
#pragma once

#include "cuda/attention.cuh"

namespace kmla::cuda {

// Query rows per CTA that prefill_attention uses for `p` on the current device: 64 or 128.
// The environment variable KMLA_PREFILL_ROWS=64|128, read once per process, overrides the
// heuristic (for A/B timing with `kmla bench --only prefill`).
int prefill_rows_per_cta(const PrefillParams& p);

// prefill_attention with the tiling fixed: rows_per_cta 64 (4 warps, 2 CTAs per SM) or 128
// (8 warps, 1 CTA per SM); any other value throws. Same contract otherwise.
void prefill_attention_rows(const PrefillParams& p, int rows_per_cta, cudaStream_t stream);

// ---- the Hopper kernel (prefill_sm90.cu) ----------------------------------------------
// Whether prefill_attention would use the wgmma kernel for `p` on the current device:
// !p.portable, an sm_90 GPU, and KMLA_PREFILL_SM90 (read once per process) not "0". Setting
// KMLA_PREFILL_SM90=0 forces the mma.sync kernel for A/B timing with `kmla bench`.
bool prefill_uses_sm90(const PrefillParams& p);

// Variants of the wgmma kernel, for tests and A/B timing. prefill_attention uses the
// defaults unless the environment (read once per process) says otherwise:
// KMLA_PREFILL_SM90_OVERLAP=0|1, KMLA_PREFILL_SM90_PINGPONG=0|1,
// KMLA_PREFILL_SM90_EARLY_RESCALE=0|1, KMLA_PREFILL_SM90_HEAD_GROUP=N,
// KMLA_PREFILL_SM90_TMA=0|1, KMLA_PREFILL_SM90_COMPACT=0|1, KMLA_PREFILL_SM90_CTAS=N.
struct Sm90Options {
  // The consumer schedule that runs the softmax of a tile under the previous tile's P.V;
  // false: each step waited for in order (simpler; kept for tests and A/B timing).
  bool overlap = true;
  // The two consumer warpgroups take turns issuing their MMAs (named barriers); only with
  // overlap (ignored otherwise). Off by default: FA3's tuning turns its equivalent off for
  // 16-bit inputs at QK head dims above 128 (ours is 192); kept for A/B timing.
  bool pingpong = false;
  // With overlap: O's rescale by a tile's correction runs between the next S issue and the
  // P.V issue (under S) instead of before the next issue.
  bool early_rescale = true;
  // CTA order: 0 = all blocks of a head (heavy first), then the next head (round 1); G > 0 =
  // heads in groups of G, longest blocks of the group first (see prefill_sm90.cu). 2 since
  // 2026-12-04 (H200, persistent CTAs): 32k x 16 heads 8761-8795 us against 8931 with 8,
  // chunked context 4096-4180 against 4265-4463, the rest equal or up to 1 % faster.
  int head_group = 2;
  // Full Q blocks and K/V tiles load with TMA (one producer thread per operand half; a
  // partial tile at a sequence's end still goes through cp.async, which zero-fills); false:
  // 128 producer threads with cp.async for everything. Measured on H200 (round 3): +23% at
  // 8k tokens x 64 heads, +18% at 8k x 16, +17% at 32k x 16.
  bool tma = true;
  // Batches of several sequences run a 1-D grid of their real (query block, head, sequence)
  // items (sequences in the caller's order, each in the 3-D grid's order), sized from
  // total_q (see PrefillParams), instead of (max blocks, heads, sequences), which has a CTA
  // for every block a shorter sequence lacks. One sequence runs the 3-D grid unless
  // PrefillParams::work_counter is set (then the persistent CTAs, see `ctas`).
  // Measured on H200 (varlen16, 16 sequences of 1..8192 tokens x 16 heads): 501.5 -> 550.3
  // TFLOP/s; single-sequence cases unchanged within noise.
  bool compact = true;
  // CTAs of the compact grid when PrefillParams::work_counter is set: 0 = one per SM, n > 0
  // = at most n (tests: many items per CTA), -1 = one per item (as without the counter).
  int ctas = 0;
};

// prefill_attention on the wgmma kernel regardless of the heuristics (same validation and
// contract); throws on a GPU that is not sm_90.
void prefill_attention_sm90(const PrefillParams& p, cudaStream_t stream,
                            const Sm90Options& opt = {});

// Whether the current device runs the wgmma kernel (an sm_90 GPU, and sm_90a code in this
// binary; the operands' alignment needs are the mma.sync kernel's, checked by the validation).
bool prefill_sm90_supported(const PrefillParams& p);

// CTAs of the compact grid for `p` (host only, from the plan: heads x a bound on the query
// blocks; CTAs past the batch's real items leave at once). Throws above 2^31 - 1.
// Shared by the 16-bit and the fp8 wgmma kernels.
int64_t prefill_sm90_compact_items(const PrefillParams& p);

// CTAs that run `items` list items: with p.work_counter, `ctas` persistent ones (0: one per
// SM of the current device, n > 0: at most n), else (or with ctas < 0) one per item.
int64_t prefill_sm90_ctas(const PrefillParams& p, int64_t items, int ctas);

// The launch alone (no validation): for prefill_attention.cu.
void prefill_attention_sm90_launch(const PrefillParams& p, const Sm90Options& opt,
                                   cudaStream_t stream);

// Building-block probe of the wgmma kernel, for tests: one warpgroup loads a [64, 192],
// k [128, 192] and v [128, 128] (dense rows in act) into the kernel's swizzled panels, writes
// s_out = a k^T [64, 128] fp32 (smem-descriptor wgmma and the accumulator layout) and
// o_out = round_act(s_out) v [64, 128] fp32 (register-A wgmma, MN-major V descriptor).
// Device pointers; needs an sm_90 GPU. swap_v_strides exchanges the V descriptor's leading and
// stride byte offsets (a diagnostic: the tests report whether that layout would match).
void prefill_sm90_probe(DType act, const void* a, const void* k, const void* v, float* s_out,
                        float* o_out, cudaStream_t stream, bool swap_v_strides = false);

}  // namespace kmla::cuda
