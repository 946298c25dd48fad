// The flattened launch arguments of the decode kernels (decode_attention.cu's mma.sync
// kernel and combine, decode_sm90.cu's wgmma kernel): one plain struct built on the host
// from DecodeParams / DecodePlan and passed by value to every decode kernel.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/common.cuh"
#include "kmla/config.hpp"

namespace kmla::cuda {

// What the kernel needs, flattened from DecodeParams / DecodePlan on the host.
struct DecodeArgs {
  const void* q;  // [rows, heads, 576] T, or e4m3 codes when q_fp8
  bool q_fp8;
  const std::byte* cache_base;  // block b at cache_base + b * block_stride
  int64_t block_stride;         // bytes
  int64_t num_blocks;
  int block_size;
  int block_shift;  // log2(block_size) for a power of two (16, 64, 256, ...), else -1
  int entry_bytes;  // 1152, 576 or 656
  CacheFormat format;
  const int32_t* block_tables;  // [num_requests, max_blocks]
  const int32_t* seq_lens;      // [num_requests]
  const int32_t* query_lens;    // [num_requests]
  const int32_t* query_start;   // [num_requests + 1]
  int max_blocks;
  int num_requests;
  int heads;
  bool causal;
  float score_scale_log2;  // softmax_scale (* q_scale * k_scale on plain fp8) * log2(e)
  float v_scale;           // k_scale on the plain fp8 cache, else 1
  void* out;               // [rows, heads, 512] T
  float* lse;              // [rows, heads]
  int* error_flag;
  int num_splits;        // per-request schedule: grid splits per request
  bool batch_invariant;  // split boundaries from each request's own length
  bool direct_out;       // per-request, one split, not invariant: write out / lse, no combine
  int max_rows;   // plan.max_query_len * heads: rows per request the grid covers
  // Scheduler (decode_sched.cuh). balanced: grid (num_workers), every CTA takes an equal
  // share of the batch's key tiles; else the per-request grid (row tiles, num_splits, R).
  bool balanced;
  int num_workers;
  int rows_per_cta;        // the plan's row tile
  int row_tiles;           // ceil(max_rows / rows_per_cta): pairs per request
  int sched_pair_keys;     // start-up charge of a (request, row tile) pair, in keys
  int sched_min_keys;      // fewest keys per worker
  int sched_nosplit_keys;  // pairs of at most this many keys are never cut
  // balanced: the pairs in pass order (every request's row tile 0, then every row tile 1, ...)
  // instead of request order (DecodePlan::pass_major); with mixed row tile counts, the walk
  // table's lockstep sections.
  bool pass_major;
  // Partials. per-request: ws_o [num_requests, max_rows, num_splits, 512] fp32 (normalised),
  // ws_lse [num_requests, max_rows, num_splits]. balanced: ws_o [2 num_workers, rows_per_cta,
  // 512], ws_lse [2 num_workers, rows_per_cta] (two slots per worker, see balanced_slot).
  // Natural log; -inf = the piece saw no key (its ws_o is then never read).
  float* ws_o;
  float* ws_lse;
  int2* pair_table;  // balanced: [num_requests * row_tiles] (first worker, pieces)
  // balanced: the walk's starts (and sections) made on the host for this kernel's tiles
  // (decode_sched.cuh, WalkTableHead), or nullptr: every CTA finds its own from the lengths.
  const void* walk_table;
  // balanced, launched cooperatively: the split kernel merges the cut pairs itself after a
  // grid-wide barrier and no combine runs (decode_combine.cuh, DecodePlan::fused_combine).
  bool fused_combine;
  // The fused merge's partial rows per batch (merge_cut_pieces): 0, as many as the kernel's
  // shared memory holds; else at most this many (KMLA_DECODE_MERGE_ROWS, for the tests:
  // small batches, and a piece with more partials than that merged by merge_cut_piece).
  int merge_rows;
};

// log2(block_size) for a power of two, else -1 (DecodeArgs::block_shift).
inline int decode_block_shift(int block_size) {
  for (int s = 0; s < 31; ++s)
    if (block_size == 1 << s) return s;
  return -1;
}

#ifdef __CUDACC__
// Key `pos`'s block (its index in the request's block table) and its row in that block. A
// power-of-two block size takes a shift and a mask (kShift): the division by a run-time
// divisor costs ~30 instructions per lookup. Measured on H200 (2026-12-03, (128, 12, 8k)
// unless stated): fp8_ds_mla 302.7 against 310.9 us, plain fp8 241.4 against 251.2,
// (64, 128, 8k) 338.7 against 354.2, q = 4 344.4 against 356.7, DSpark 196.4 against 202.2.
// The warp-own bf16 kernel got 1-3 % slower with it (memory bound: the lookups cost nothing
// there, the code around them moved) and keeps the division (kShift = false).
template <bool kShift = true>
__device__ __forceinline__ int decode_block_of(const DecodeArgs& a, int pos) {
  if constexpr (!kShift) return pos / a.block_size;
  return a.block_shift >= 0 ? pos >> a.block_shift : pos / a.block_size;
}
template <bool kShift = true>
__device__ __forceinline__ int decode_row_in_block(const DecodeArgs& a, int pos) {
  if constexpr (!kShift) return pos % a.block_size;
  return a.block_shift >= 0 ? pos & (a.block_size - 1) : pos % a.block_size;
}

// The cache address of key `pos` of a request, whose block id (read from the block table one
// tile ahead) is `block`; `ok` is false for keys at or past key1 and for block ids outside the
// cache, which are never read (the kernels mask the key and zero its row) and, with `report`,
// raise kErrBadBlockId. Shared by the decode kernels' key loaders.
template <bool kShift = true>
__device__ __forceinline__ const std::byte* decode_key_src(const DecodeArgs& a, int pos, int key1,
                                                           int block, int entry_bytes, bool report,
                                                           bool& ok) {
  ok = pos < key1;
  if (!ok) return a.cache_base;
  if (block < 0 || int64_t(block) >= a.num_blocks) {
    ok = false;
    if (report) raise_error(a.error_flag, kErrBadBlockId);
    return a.cache_base;
  }
  return a.cache_base + int64_t(block) * a.block_stride +
         int64_t(decode_row_in_block<kShift>(a, pos)) * entry_bytes;
}
#endif

}  // namespace kmla::cuda
