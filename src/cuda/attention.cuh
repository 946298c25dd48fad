// The attention kernels of the CUDA backend: absorbed MQA decode over the paged latent
// cache (split-KV + combine) and variable-length prefill attention (qk 192 / v 128).
// Both run on the tensor cores; `portable` forces the sm_80 code path on any GPU.
#pragma once

#include "cuda/common.cuh"

namespace kmla::cuda {

// ---- decode -----------------------------------------------------------------------
// Absorbed MQA for the decode requests [0, batch.num_requests) of `batch` (request r's
// query rows are [query_start[r], query_start[r] + query_lens[r]), its keys the first
// seq_lens[r] cache rows through its block table). Row i (0-based) of a request of n query
// rows sees keys [0, seq_len - (n - 1 - i)) when causal, all seq_len keys otherwise.
//
// q:   [rows, heads, 576] = [ql_nope 512 | q_pe 64] in the activation dtype, or e4m3 codes
//      when q_fp8 (plain fp8 cache: value = code * q_scale).
// out: [rows, heads, 512] in the activation dtype (one rounding of the fp32 result), 8-byte
//      aligned (16 is faster);
// lse: [rows, heads] fp32, natural log of sum(exp(scale * s)); a row with no keys gets
//      zeros and -inf.
// Rows of requests with query_len 0 are not touched.
struct DecodeParams {
  const void* q = nullptr;
  bool q_fp8 = false;
  float q_scale = 1.0f;
  CacheRef cache;
  DeviceBatch batch;
  int heads = 0;
  bool causal = true;
  float softmax_scale = 1.0f;
  DType act = DType::bf16;  // dtype of out (and of q unless q_fp8)
  void* out = nullptr;
  float* lse = nullptr;
  int* error_flag = nullptr;  // raised (kErrBadBlockId) for a block id outside the cache
  // Balanced plans: the device copy of decode_walk_table's table for this batch and the key
  // tile it returned, or nullptr (every CTA then finds its start from the lengths).
  const void* walk_table = nullptr;
  int walk_key_tile = 0;
};

// How the split kernel's CTAs share the work (src/cuda/decode_sched.cuh).
enum class DecodeSchedule {
  per_request,  // grid (row tiles, num_splits, requests): splits from each request's length
  balanced,     // grid (num_workers): every CTA an equal share of the batch's key tiles
};

// Launch configuration fixed at plan time from the batch's *shape*, so a CUDA graph
// captured with one plan replays correctly with other lengths of the same shape.
struct DecodePlan {
  // plan_decode picks balanced unless batch invariant (which keeps per_request: a request's
  // splits must not depend on its batchmates), for one request, or above
  // kDecodeBalancedMaxRequests requests.
  DecodeSchedule schedule = DecodeSchedule::per_request;
  // balanced: CTAs of the split kernel (1..1024): the CTA slots of the GPU, one wave. The
  // share sizes come from the lengths on the device; the three sched_* costs in keys tune
  // them (decode_sched.cuh): a pair's start-up charge, the fewest keys per worker (one key
  // tile in plan_decode's non-portable 16-row plans), and the longest pair never cut.
  int num_workers = 0;
  int sched_pair_keys = 32;
  int sched_min_keys = 256;
  int sched_nosplit_keys = 512;
  // balanced, requests of several row tiles: the walk lists the pairs pass by pass (row tile 0
  // of every request, then row tile 1, ...) instead of request by request. On a uniform batch
  // with the worker count a multiple of the row tiles, each pass then starts on a share
  // boundary, so worker w and worker w + W / tiles run the same keys of the same request at
  // the same time, and the second read of every key tile can hit L2 (request order puts the
  // second row tile a whole pair later, on the same or the next worker). Measured on H100
  // (2026-12-05): (128, 128, 4k) reads 0.63 GB of DRAM against 1.24 and runs in 351 us
  // against 475; (64, 128, 8k) 339 against 358, (64, 64, 8k, q 2) 339 against 367; one-tile
  // shapes unchanged. Batches whose requests have different row tile counts (mixed query
  // lengths) get the same lockstep from the walk table's sections (decode_sched.cuh,
  // balanced_walk_table). KMLA_DECODE_PASS_ORDER=0 gives request order (A/B runs).
  bool pass_major = true;
  // Launch the combine as a programmatic dependent of the split kernel (sm_90), so its
  // launch overlaps the split kernel's tail. plan_decode sets it for balanced 64-row plans,
  // balanced 16-row plans of one worker per SM (small batches) and one-wave per-request grids
  // of several splits (KMLA_DECODE_PDL=0|1 overrides).
  bool programmatic_combine = false;
  // balanced: no combine launch; the split kernel runs as a cooperative grid and, after a
  // grid-wide barrier, each worker merges its share of the rows of the pairs it ran a cut
  // piece of (decode_combine.cuh). Where the grid cannot be resident at once the combine
  // kernel runs as before. plan_decode sets it for balanced plans unless their rows expect
  // more than 32 partials (a few long requests), which the combine's CTA-per-row form merges
  // faster (KMLA_DECODE_FUSED=0|1 overrides).
  bool fused_combine = false;
  int num_splits = 1;     // per_request: KV splits per request (ceil(seq / num_splits) each)
  int max_query_len = 1;  // largest query_len any request may have in this shape
  int rows_per_cta = 16;  // (token, head) rows per CTA tile
  bool portable = false;
  // 16-row tiles as one CTA per SM with a deep cp.async pipeline (needs ~210 KB of shared
  // memory per block: Hopper; ignored for 32 / 64-row tiles). Changes the speed, never the
  // arithmetic. plan_decode leaves it off (measured slower, see decode_attention.cu);
  // callers may set it on a GPU that fits it.
  bool deep_pipeline = false;
  // CTAs per SM of the fp8_ds_mla cache's 16-row kernels under bf16 activations (2 or 3;
  // other kernels ignore it). 3 runs a form with fewer raw stages and registers
  // (decode_attention.cu, decode_fp8_tiles). plan_decode picks 3 for plans made for
  // fp8_ds_mla where it fits (KMLA_FP8_CTAS=2 keeps 2) and 2 otherwise, and sizes the
  // splits / workers for that many CTA slots per SM.
  int fp8_ctas_per_sm = 2;
  // The 16-row kernel over a 16-bit cache (other kernels ignore it) in its warp-own form:
  // each warp copies the key columns it reads and waits for its own copies only, with one CTA
  // barrier per 32-key tile (decode_attention.cu, splitkv_piece's kWarpOwn). The same shared
  // memory and grid as the shared-loader 2-stage form; S is added in another order, so the
  // last bits differ (within the oracle's tolerance). plan_decode sets it for every
  // non-portable plan over a bf16 / fp16 cache (KMLA_DECODE_WARP_OWN=0 keeps the shared
  // loader, for A/B runs); it is read only where the 2-stage 16-row kernel runs.
  bool row16_warp_own = false;
  // Batch-invariant mode: a request's split boundaries, row tiling and combine order depend
  // only on its own length, query length and the head count, so its output and LSE are
  // bitwise the same whatever else is in the batch. num_splits is then the grid's split
  // count (enough for max_seq_len); each request uses the first ceil(seq / keys per split)
  // of them and the combine always runs, even for one split.
  bool batch_invariant = false;
  size_t workspace_bytes = 0;  // partial outputs and LSEs of the splits
};

// The balanced schedule's prologue reads every request's lengths in every CTA; above this
// many requests plans keep the per-request grid (which then has >= this many CTAs anyway).
inline constexpr int kDecodeBalancedMaxRequests = 4096;

// Chooses the split count etc. for `num_requests` decode requests of at most
// `max_query_len` query rows and `max_seq_len` keys, on the current device. Environment
// overrides, for A/B runs of `kmla bench`: KMLA_DECODE_SCHEDULE=per_request|balanced,
// KMLA_DECODE_WORKERS, KMLA_DECODE_PAIR_KEYS, KMLA_DECODE_MIN_KEYS, KMLA_DECODE_NOSPLIT_KEYS,
// KMLA_DECODE_PASS_ORDER=0|1, KMLA_DECODE_FUSED=0|1 (DecodePlan::fused_combine),
// KMLA_DECODE_PDL=0|1, KMLA_DECODE_EVEN_SPLITS=0|1, KMLA_DECODE_SM_SPLIT_TILES (the most
// 32-key tiles a split of a one-wave grid, or a worker of a small balanced 16-row batch, takes
// at one CTA per SM; 0: never one per SM), KMLA_DECODE_SPLITS (splits per request),
// KMLA_FP8_CTAS=2|3, KMLA_DECODE_ROWS=16|32|64 (the row tile; never for batch-invariant plans),
// KMLA_DECODE_SM90_MIN_ROWS (decode_sm90.cuh), and KMLA_DECODE_WARP_OWN=0|1 (all plans: the 16-row
// 16-bit kernel's form, DecodePlan::row16_warp_own). `format` is the cache format the plan will run
// on; fp8_ds_mla's CTAs per SM, the warp-own form and the wgmma tile for 17-32 rows depend on it.
DecodePlan plan_decode(int num_requests, int heads, int max_query_len, int64_t max_seq_len,
                       bool portable, bool batch_invariant = false,
                       CacheFormat format = CacheFormat::bf16);

// Workers of a balanced plan with `slots` CTA slots (SMs x CTAs per SM) for `num_requests`
// requests: the largest multiple of num_requests that leaves at most 1/32 of the slots idle,
// else every slot. A uniform batch then cuts every request into the same number of whole
// pieces, one per worker, instead of pieces that straddle two requests. plan_decode uses it
// for every tile height (64-row tiles since 2026-12-05, eighth session; see plan_decode). Measured on
// H200 (2026-12-03, warp-own kernel, with the walk's nearest-tile cuts, against every slot,
// alternated twice): (128, 16, 4k) 161.5 / 163.1 against 170.0 / 170.4 us; (128, 12, 8k) 308.5 /
// 306.9 against 313.8 / 314.1; (32, 12, 32k) 306.6 / 311.1 against 318.0 / 315.1; plain fp8 (128,
// 12, 8k) 253.2 / 253.1 against 260.3 / 258.0; fp8_ds_mla (396 -> 384 workers) and the mixed-length
// batch within 0.5 %. Fewer workers than the aligned count (248, 232, 200 of 264) were slower.
int64_t decode_balanced_workers(int64_t slots, int num_requests);

// Workspace bytes `plan` needs for `num_requests` requests of `heads` heads (what
// plan_decode stores in plan.workspace_bytes; for callers that edit a plan).
size_t decode_workspace_bytes(const DecodePlan& plan, int num_requests, int heads);

// The balanced walk's starts (decode_sched.cuh, balanced_walk_table) for a batch planned as
// `plan`, made on the host from its lengths (host arrays of num_requests): what every CTA of
// the split kernel would otherwise find by loading all lengths and scanning them before its
// first copy. decode_walk_table_bytes is 0 unless plan is balanced (decode_walk_table then
// writes nothing and returns 0); else decode_walk_table fills `out` with that many bytes and
// returns the key tile the table is for (the kernel the current device runs for `plan`).
// Callers upload it with the lengths and pass its device copy and that tile in
// DecodeParams::walk_table / walk_key_tile. A launch whose kernel has another key tile
// ignores the table.
size_t decode_walk_table_bytes(const DecodePlan& plan, int num_requests);
int decode_walk_table(const DecodePlan& plan, int heads, bool causal, CacheFormat format,
                      int num_requests, const int32_t* seq_lens, const int32_t* query_lens,
                      void* out);

// Runs decode attention. `workspace` holds plan.workspace_bytes (256-byte aligned).
// Never allocates or synchronizes.
void decode_attention(const DecodeParams& p, const DecodePlan& plan, void* workspace,
                      cudaStream_t stream);

// Decode attention followed by the layer's value up-projection and output gate in one
// epilogue launch (in place of the combine, a batched W_UV GEMM and the gate kernel): with
// c = h * 128 + n,
//   attn[t, c] = act(act(sum_k latent[t, h, k] W_UV[h, k, n]) * sigmoid(g[t, c]))
// for tokens t in [0, rows), latent being what decode_attention writes to p.out (rounded to
// act). Without g, no gate. Tokens of no request get a zero latent; with num_tokens (a device
// scalar), rows t >= *num_tokens are written as zeros. p.out and p.lse serve as scratch (the
// rows a single piece computes); neither holds the full result afterwards. Needs
// decode_uv_fits() (~156 KB of shared memory per block: sm_80 and Hopper).
struct DecodeUvParams {
  const void* w_uv = nullptr;  // [heads, 512, 128] act, row-major per head, 16-byte aligned
  void* attn = nullptr;        // [rows, attn_stride] act; head h at columns [128 h, 128 h + 128)
  int64_t attn_stride = 0;     // elements
  const void* g = nullptr;     // [rows, g_stride] act, the gate's input; null: no gate
  int64_t g_stride = 0;
  int64_t rows = 0;
  const int32_t* num_tokens = nullptr;
  // sm_90: the CTAs of a head's token tiles run as clusters of up to 8 and fetch W_UV[h] once
  // for all of them (multicast bulk copies) instead of once each. Ignored elsewhere.
  bool multicast = true;
};
void decode_attention_uv(const DecodeParams& p, const DecodePlan& plan, void* workspace,
                         const DecodeUvParams& uv, cudaStream_t stream);
bool decode_uv_fits();
bool decode_uv_multicast_supported();  // sm_90 GPUs running the sm_90a code

// ---- prefill ------------------------------------------------------------------------
// A [rows, heads, dim] operand with element strides: element (t, h, d) is at
// ptr[t * row_stride + h * head_stride + d]. head_stride may be 0 (shared by all heads).
struct Operand {
  const void* ptr = nullptr;
  int64_t row_stride = 0;
  int64_t head_stride = 0;
};

// Variable-length attention for `heads` heads. Sequence s has queries [cu_q[s], cu_q[s+1])
// and keys [cu_k[s], cu_k[s+1]) (device int32 arrays of num_seqs + 1). The key is
// [k_nope (128) | k_rope (64)], the value 128 wide. causal: bottom-right aligned (query i of
// n sees keys [0, m - n + i]). Inputs in the activation dtype; out [*, heads, 128] in it
// (one rounding); lse fp32 at lse[t * lse_row_stride + h], natural log; a query row that sees
// no keys gets zeros and -inf.
struct PrefillParams {
  Operand q;       // 192 wide
  Operand k_nope;  // 128 wide
  Operand k_rope;  // 64 wide (head_stride 0 when shared by all heads)
  Operand v;       // 128 wide
  void* out = nullptr;
  int64_t out_row_stride = 0, out_head_stride = 0;
  float* lse = nullptr;
  int64_t lse_row_stride = 0;
  int heads = 0;
  const int32_t* cu_q = nullptr;
  const int32_t* cu_k = nullptr;
  int num_seqs = 0;
  int max_q_len = 0;  // host-side bound for the grid
  // Host-side bound on the query rows of all sequences, cu_q[num_seqs] - cu_q[0], for the
  // wgmma prefill's compact grid (which has no CTA for the query blocks a sequence lacks);
  // 0: not known (the grid is then sized from max_q_len alone). Like max_q_len a contract:
  // blocks past a bound that is too small are not computed.
  int64_t total_q = 0;
  // Optional: 2 int32 of device memory, zero before the first launch that uses them. With
  // it the wgmma kernel runs one CTA per SM that takes (query block, head) items from this
  // counter until none is left (the next item's Q and first key tiles load while the
  // current one finishes); the kernel's last CTA sets both back to zero, so launches in one
  // stream may share it, concurrent launches may not. nullptr: one CTA per item.
  int32_t* work_counter = nullptr;
  bool causal = true;
  float softmax_scale = 1.0f;
  DType act = DType::bf16;
  bool portable = false;
  // fp8 inputs (sm_90 only, not with portable): q, k_nope, k_rope and v hold e4m3 codes, one
  // byte each, so their strides (still in elements) are byte counts and must be multiples of
  // 16, with positive row strides and positive head strides (k_rope: or 0). Value = code *
  // scale, one fp32 scale per tensor read from device memory when the kernel runs (a CUDA
  // graph replays with recalibrated scales); k_scale serves k_nope and k_rope. out and lse
  // are as above (out in act). P is rounded to e4m3 (as 256 p) for P.V.
  bool fp8 = false;
  const float* q_scale = nullptr;  // device, 1 float each
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
};

void prefill_attention(const PrefillParams& p, cudaStream_t stream);

}  // namespace kmla::cuda
