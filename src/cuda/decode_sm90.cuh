// The Hopper wgmma decode kernel (decode_sm90.cu): absorbed MQA for requests with many
// (token, head) rows, where decode is compute bound. decode_attention() in
// decode_attention.cu asks decode_sm90_supports() and launches it in place of the mma.sync
// split-KV kernel; the combine of the splits is shared.
#pragma once

#include "cuda/attention.cuh"
#include "cuda/decode_args.cuh"

namespace kmla::cuda {

// Query rows (token, head pairs of one request) per CTA of the wgmma kernel, and its key tile.
inline constexpr int kDecodeSm90Rows = 64;
inline constexpr int kDecodeSm90Keys = 64;

// Whether decode_attention runs `p` under `plan` with the wgmma kernel: an sm_90 GPU and a
// binary with sm_90a code, plan not portable and not batch invariant, the plan's 64-row
// tiles (plan_decode gives them to fewer rows per request through decode_sm90_takes_rows: a
// thin tile at 32 rows or fewer, else a 64-row one that masks the missing rows), a 16-bit cache
// and 16-bit queries (the fp8 formats stay on the mma.sync kernel). Cached per device: no sync.
bool decode_sm90_supports(const DecodeParams& p, const DecodePlan& plan);

// Whether plan_decode gives requests of `rows` (<= 32) rows the wgmma kernel's 64-row plan
// instead of the mma.sync kernel's 16 / 32-row one: more than min_rows rows, or a thin tile's
// rows in a batch of at least small_min_requests requests of at most small_max_keys keys; a
// 16-bit `format`, not portable, and the wgmma kernel runs on the current device.
bool decode_sm90_takes_rows(int rows, int num_requests, int64_t max_seq_len, CacheFormat format,
                            bool portable);

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
//   KMLA_DECODE_SM90_ISSUE_WG1=0|1     with the wide S, the first warp of warpgroup 1 (idle
//                                      during S and the softmax) issues the TMA copies, not
//                                      warp 0, which starts S at once (default 1: with the
//                                      early issue 15-19 % faster on every H200 case,
//                                      2026-12-03)
//   KMLA_DECODE_SM90_EARLY_ISSUE=0|1   with TMA, issue tile t + 1 right after the tile
//                                      barrier, before waiting for tile t: two tiles in
//                                      flight (default 1; alone +-1 %, with the above 1-2 %)
//   KMLA_DECODE_SM90_ONE_COPY=0|1      with TMA and 64-key groups, a tile in one 4-D copy
//                                      instead of one copy per 64-column panel (default 1:
//                                      2-3 % on the 128 / 64-head shapes, H100, 2026-12-06)
//   KMLA_DECODE_SM90_SPLIT_P=0|1       with the wide S, P in two halves, each half's P V
//                                      issued as it lands (default 1)
//   KMLA_DECODE_SM90_MIN_ROWS=n        plans give requests of more than n rows (0..63) the
//                                      wgmma kernel's 64-row tile (a 16-bit cache on sm_90);
//                                      fewer keep the mma.sync kernel's 16 / 32-row tiles
//                                      (default 16, see plan_decode)
//   KMLA_DECODE_SM90_THIN_ROWS=0..32   launches of at most this many rows per request run
//                                      thin tiles (keys in the MMAs' M, 16 or 32 rows in N)
//                                      instead of the masked 64-row tile (default 32)
//   KMLA_DECODE_SM90_SMALL_REQUESTS=n  batches of at least n requests give min_rows rows or
//                                      fewer the 64-row plan too, as thin tiles (default 64;
//                                      0: never)
//   KMLA_DECODE_SM90_SMALL_MAX_KEYS=n  ... where no request has more than n keys, on GPUs
//                                      with more than 30 GB/s of DRAM per SM (default 2048)
// Tests set them through decode_sm90_set_options to run every variant.
struct DecodeSm90Options {
  bool skip_rescale = true;
  bool tma = true;
  bool wide_s = true;
  bool issue_wg1 = true;
  bool early_issue = true;
  bool one_copy = true;  // block sizes that 64 divides: a tile in one 4-D tensor copy
  // The wide S's P in two halves of 32 keys, each half's P V issued as soon as it is in (the
  // exponentials of the second half run under the first's P V).
  bool split_p = true;
  int min_rows = 16;     // requests of more rows (heads x max_query_len) take 64-row tiles
  // Requests of at most min(16, thin_rows) rows, and launches of at most thin_rows (0..32) rows
  // per request, run as thin tiles (the wide S only): keys in the MMAs' M, rows in N (16 or 32),
  // a quarter or half of the 64-row tile's MMA work.
  int thin_rows = 32;
  // Requests of min_rows rows or fewer take the 64-row plan too (as thin tiles) in batches of at
  // least this many requests (0: never). Measured on an H100 (2026-12-06, nineteenth session):
  // (128, 16, 4k) 209.0 -> 202.8 us, (128, 12, 8k) 399.3 -> 392.3, but (32, 12, 32k) +0.7 % and
  // (1, 12, 64k) +2.4 %, where the 16-row kernel's two CTAs per SM start short pieces faster.
  int small_min_requests = 64;
  // ... and, on a GPU that streams more than 30 GB/s of DRAM per SM (an H200: 37; an H100 SXM:
  // 25), only where no request is longer than this many keys. Measured (2026-12-06, twentieth
  // session, (128, 12, s), 16-row kernel / thin tiles, us): on an H200 s = 512 39.9 / 29.5, 1k
  // 51.6 / 48.5, 2k 87.0 / 85.4, 4k 157.5 / 158.7, 8k 295.5 / 302.9 (the thin tile's compute
  // chain, one tile at a time on one CTA per SM, shows once the DRAM streams a tile in ~2 us;
  // the 16-row kernel's two CTAs per SM overlap theirs); on an H100 the thin tile wins at every
  // length (4k 218.6 / 216.5, 8k 413.0 / 392.0).
  int64_t small_max_keys = 2048;
};
DecodeSm90Options decode_sm90_options();
void decode_sm90_set_options(const DecodeSm90Options& o);

// How many keys per bulk tensor copy a launch for `p` under the current options would use:
// 8-64, or 0 for cp.async (TMA off, a block size not a multiple of 8, or a cache geometry
// the driver cannot encode; all compute the same); *one_copy (if given): whether a 64-key
// group is one 4-D copy per tile (DecodeSm90Options::one_copy). For tests and diagnostics.
int decode_sm90_tma_keys(const DecodeParams& p, bool* one_copy = nullptr);

// The longest request (keys) with which a batch of small requests takes thin tiles on the
// current device (DecodeSm90Options::small_max_keys, or no limit where the GPU streams at most
// 30 GB/s of DRAM per SM). For tests and diagnostics.
int64_t decode_sm90_small_max_keys();

// The thin tile (16 or 32 rows) a launch of at most max_rows rows per request runs under the
// current options, or 0 for the 64-row tile. (In a launch of longer requests, those of at most
// 16 rows run as 16-row thin tiles too.)
int decode_sm90_thin_tile(int max_rows);

// Launches the wgmma split-KV kernel on the grid decode_attention builds for 64-row tiles
// (per-request (ceil(max_rows / 64), num_splits, num_requests), balanced (num_workers)).
// Writes out / lse directly when a.direct_out, else the fp32 partials and LSEs of a.ws_o /
// a.ws_lse for the combine; with a.fused_combine it merges cut pairs itself, or clears the
// flag where the grid cannot run cooperatively (launch_split_kernel).
void launch_decode_sm90(DecodeArgs& a, DType act, dim3 grid, cudaStream_t stream);

// Test hook for the kernel's building blocks (one CTA, no pipeline): q and k are [64, 576]
// in `act` (dense rows), p [64, 64] fp32. Writes s_out [64, 64] = q k^T (fp32, the kernel's
// two 32-key halves) and o_out [64, 512] = round_act(p) k[:, :512] (fp32), both through the
// kernel's swizzled layouts, descriptors and accumulator mappings.
void decode_sm90_probe(DType act, const void* q, const void* k, const float* p, float* s_out,
                       float* o_out, cudaStream_t stream);

}  // namespace kmla::cuda
