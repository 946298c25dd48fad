// The Hopper wgmma decode kernel (decode_sm90.cu): absorbed MQA for requests with many
// (token, head) rows, where decode is compute bound. decode_attention() in
// decode_attention.cu asks decode_sm90_supports() and launches it in place of the mma.sync
// split-KV kernel; the combine of the splits is shared.
#pragma once

#include "cuda/attention.cuh"
#include "cuda/decode_args.cuh"

namespace kmla::cuda {

// Query rows (token, head pairs of one request) per CTA of the wgmma kernel.
inline constexpr int kDecodeSm90Rows = 64;

// Whether decode_attention runs `p` under `plan` with the wgmma kernel: an sm_90 GPU and a
// binary with sm_90a code, plan not portable and not batch invariant, the plan's 64-row
// tiles with more than 32 rows per request (heads x max_query_len; a tile of 33-63 rows masks
// the missing ones), a 16-bit cache and 16-bit queries (the fp8 formats stay on the mma.sync
// kernel). Cached per device: no sync.
bool decode_sm90_supports(const DecodeParams& p, const DecodePlan& plan);

// Variants of the wgmma kernel that change its speed, never its result (A/B timing). The
// defaults come from the environment, read once per process:
//   KMLA_DECODE_SM90_SKIP_RESCALE=0|1  skip the O rescale of a warp whose rows' running max
//                                      did not move (exact; default 1)
//   KMLA_DECODE_SM90_TMA=0|1           key tiles by bulk tensor copies (TMA) where the block
//                                      size is a multiple of 8, else by cp.async (default 1:
//                                      measured 3-7 % faster on every H200 case)
//   KMLA_DECODE_SM90_WIDE_S=0|1        warpgroup 0 computes all of S as m64n64 (a third less
//                                      shared-memory traffic for S) and the softmax, while
//                                      warpgroup 1 waits (default 1: measured 1-4 % faster
//                                      on every H200 case, 2026-12-03)
//   KMLA_DECODE_SM90_ISSUE_WG1=0|1     with the wide S: the first warp of warpgroup 1 (idle
//                                      during S and the softmax) issues the TMA copies instead
//                                      of warp 0, which then starts S at once (default 0)
//   KMLA_DECODE_SM90_PAIR_ISSUE_WG1=0|1 the same for the CTA-pair kernel, where that warp
//                                      also waits for the peer (default 1: measured 18 %
//                                      faster than warp 0 on H200, 2026-12-03)
//   KMLA_DECODE_SM90_EARLY_ISSUE=0|1   with TMA: issue the copies of tile t + 1 right after
//                                      the tile barrier, before waiting for tile t to land
//                                      (two tiles in flight instead of one; default 0)
// Tests set them through decode_sm90_set_options to run every variant.
struct DecodeSm90Options {
  bool skip_rescale = true;
  bool tma = true;
  bool wide_s = true;
  bool pair_issue_wg1 = true;
  bool issue_wg1 = false;
  bool early_issue = false;
};
DecodeSm90Options decode_sm90_options();
void decode_sm90_set_options(const DecodeSm90Options& o);

// How many keys per bulk tensor copy a launch for `p` under the current options would use:
// 8-64, or 0 for cp.async (TMA off, a block size not a multiple of 8, or a cache geometry
// the driver cannot encode; all compute the same). For tests and diagnostics.
int decode_sm90_tma_keys(const DecodeParams& p);

// Whether decode_attention runs `p` under `plan` (which decode_sm90_supports) as CTA pairs:
// plan.sm90_pair (KMLA_DECODE_PAIR=1), bf16, the wide S, TMA copies, 65..128 rows per
// request (two 64-row tiles), and a GPU that holds clusters of two such CTAs. A pair is a
// cluster of 2 CTAs taking the two row tiles of one request over the same keys, each copying
// half of every key tile into both (TMA multicast): docs/decode_sm90.md, "CTA pairs".
bool decode_sm90_pair_runs(const DecodeParams& p, const DecodePlan& plan);

// Clusters of two pair CTAs the current GPU holds at once (cudaOccupancyMaxActiveClusters;
// 0 if none): the balanced pair grid's size. For tests and diagnostics.
int decode_sm90_pair_clusters();

// Launches the wgmma split-KV kernel on the grid decode_attention builds for 64-row tiles:
// (ceil(max_rows / 64), num_splits, num_requests), or (num_workers) balanced. Writes out /
// lse directly when a.direct_out, else the fp32 partials and LSEs of a.ws_o / a.ws_lse for
// the combine. With `pair` (plan.sm90_pair) it launches CTA pairs where they can run (see
// decode_sm90_pair_runs; the balanced grid then shrinks to the clusters the GPU holds).
void launch_decode_sm90(const DecodeArgs& a, DType act, dim3 grid, bool pair,
                        cudaStream_t stream);

// Test hook for the kernel's building blocks (one CTA, no pipeline): q and k are [64, 576]
// in `act` (dense rows), p [64, 64] fp32. Writes s_out [64, 64] = q k^T (fp32, the kernel's
// two 32-key halves) and o_out [64, 512] = round_act(p) k[:, :512] (fp32), both through the
// kernel's swizzled layouts, descriptors and accumulator mappings.
void decode_sm90_probe(DType act, const void* q, const void* k, const float* p, float* s_out,
                       float* o_out, cudaStream_t stream);

}  // namespace kmla::cuda
