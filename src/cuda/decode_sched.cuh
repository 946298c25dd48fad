// The decode scheduler: which keys of which request each CTA of the split-KV kernels works
// on, and where it leaves its partial result for the combine. Shared by the mma.sync kernel
// (decode_attention.cu, 32-key tiles) and the wgmma kernel (decode_sm90.cu, 64-key tiles);
// docs/decode_sm90.md, section "Scheduler", explains the design and its budgets.
//
// Two schedules (DecodePlan::schedule):
//   per_request: grid (row tiles, num_splits, requests); a request's keys are cut into
//     splits from its own length (equal tile ranges, or the batch-invariant sizes). The CTA
//     of the longest request sets the tail, so mixed lengths leave most of the GPU idle.
//   balanced: grid (num_workers); the work is the list of (request, row tile) pairs, each
//     costing its key tiles plus a fixed start-up charge. Every CTA (a "worker") reads the
//     lengths, prefix-sums the costs and takes an equal share [lo, hi) of the total: the
//     pairs inside it whole, the pairs across its ends in part. Short pairs are never cut:
//     the worker whose share holds the pair's midpoint takes all of it. The list runs
//     request by request (r0 t0, r0 t1, r1 t0, ...) or, with DecodeArgs::pass_major when
//     every request with rows has the same number (>= 2) of row tiles, pass by pass (r0 t0,
//     r1 t0, ..., r0 t1, r1 t1, ...). With pass_major and requests of several row tiles, the
//     walk table made on the host (balanced_walk_table) cuts the list into lockstep sections
//     with their own workers instead, so that a request's row tiles read each key tile at the
//     same time on neighbouring CTAs, also when the row tile counts differ (without a table
//     such a batch keeps request order).
// Everything a worker computes comes from seq_lens / query_lens on the device (or from the
// walk table the host made from the same lengths and uploaded with them) and the plan's
// constants, so the launch stays fixed by the plan (CUDA graphs replay any lengths).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cuda/decode_args.cuh"

#ifdef __CUDACC__
#include <cooperative_groups.h>
#endif

namespace kmla::cuda {

inline constexpr int kMaxSplits = 1024;  // most per-request grid splits, most workers
// Batch-invariant mode: a split covers at least this many keys (16 tiles). Against 512 x
// 1152 B = 590 KB of bf16 keys a 16-row split writes and the combine reads 2 x 32 KB of
// fp32 partials (~11 %); 512 keys reach the 1024-split cap at 512K keys, beyond which the
// split grows with the sequence.
inline constexpr int kInvariantMinKeys = 512;

// Batch-invariant split policy: keys per split for a request of `seq` keys, from its own
// length only: kInvariantMinKeys, or more (a whole number of tiles) so that at most
// kMaxSplits splits cover it. A grid of fewer splits than that (a plan made for shorter
// sequences, e.g. a CUDA graph's DecodeShape::max_seq_len) spreads the keys over the
// grid's splits instead: still exact, no longer batch invariant.
template <int KEY_TILE>
__host__ __device__ inline int invariant_keys_per_split(int seq, int grid_splits) {
  const int64_t tiles_at_cap = (int64_t(seq) + int64_t(kMaxSplits) * KEY_TILE - 1) /
                               (int64_t(kMaxSplits) * KEY_TILE);
  int64_t per = tiles_at_cap * KEY_TILE;
  per = per > kInvariantMinKeys ? per : kInvariantMinKeys;
  if ((int64_t(seq) + per - 1) / per > grid_splits) {
    const int64_t tiles = (int64_t(seq) + KEY_TILE - 1) / KEY_TILE;
    per = (tiles + grid_splits - 1) / grid_splits * KEY_TILE;
  }
  return int(per);
}

// Splits a request of `seq` keys uses in batch-invariant mode (32-key tiles: only the
// mma.sync kernel runs invariant plans).
__host__ __device__ inline int invariant_splits(int seq, int grid_splits) {
  const int per = invariant_keys_per_split<32>(seq, grid_splits);
  return int((int64_t(seq) + per - 1) / per);
}

// One piece of a CTA's work: query rows [row0, row0 + ROWS) of request r (clipped to its
// nrows) against keys [key0, key1) of the range those rows see.
struct DecodeWork {
  int r = 0;
  int row0 = 0;   // first (token * heads + head) row of the tile, counted in the request
  int qlen = 0, seq = 0;
  int nrows = 0;  // rows of the request the grid covers: min(qlen * heads, max_rows)
  int key0 = 0, key1 = 0;  // key0 is tile aligned; key1 <= the tile's last row's keys
  bool direct = false;     // the tile's only piece: write out / lse, no combine
  int64_t part = 0;        // ws_lse index of local row 0 (ws_o: the same times 512)
  int part_stride = 1;     // ws_lse index step from one local row to the next
  // balanced: the pair's pieces run from worker w0 on, `pieces` of them; this is piece
  // `piece` (for a direct piece 1 and 0).
  int w0 = 0, pieces = 1, piece = 0;
};

// Keys visible to request-local row `row` (0 for rows past the request): causal rows are
// bottom-right aligned.
__host__ __device__ inline int decode_row_keys(const DecodeArgs& a, int qlen, int seq, int nrows,
                                               int row) {
  if (row >= nrows) return 0;
  const int k = a.causal ? seq - (qlen - 1 - row / a.heads) : seq;
  return k > 0 ? k : 0;
}

// Rows of a request of qlen query tokens that the grid covers: qlen * heads, at most
// max_rows (rows past plan.max_query_len, a caller breaking the plan, are not computed).
__host__ __device__ inline int covered_rows(const DecodeArgs& a, int qlen) {
  return qlen * a.heads < a.max_rows ? qlen * a.heads : a.max_rows;
}

// ---- per-request schedule -----------------------------------------------------------
// The CTA's piece from blockIdx = (row tile, split, request); false when the tile has no
// rows (a padded slot, or past the request's rows).
template <int ROWS, int KEY_TILE>
__device__ inline bool per_request_work(const DecodeArgs& a, DecodeWork& w) {
  w.r = int(blockIdx.z);
  const int split = int(blockIdx.y);
  w.row0 = int(blockIdx.x) * ROWS;
  // Both lengths are loaded before the branch that needs only the first: one round trip
  // to L2 instead of two at the start of every CTA.
  w.qlen = a.query_lens[w.r];
  w.seq = a.seq_lens[w.r];
  // Rows past plan.max_query_len (a caller breaking the plan) are not computed: the grid
  // and the workspace only cover max_rows per request.
  w.nrows = covered_rows(a, w.qlen);
  if (w.row0 >= w.nrows) return false;
  // The tile's last valid row sees the most keys; split that range into tile-aligned parts.
  // Default: num_splits equal parts. Batch invariant: parts of a size set by the request's
  // own length (never by the batch), so a row's keys fall into the same splits and tiles
  // however the batch around it looks.
  const int kmax = decode_row_keys(a, w.qlen, w.seq, w.nrows, min(w.nrows, w.row0 + ROWS) - 1);
  if (a.batch_invariant) {
    // Split `split` starts at split * per; past the tile's keys it is empty (key0 = kmax).
    const int per = invariant_keys_per_split<KEY_TILE>(w.seq, a.num_splits);
    w.key0 = unsigned(split) < (unsigned(kmax) + unsigned(per) - 1u) / unsigned(per) ? split * per
                                                                                  : kmax;
    w.key1 = min(kmax, w.key0 + per);
  } else {
    const int tiles_all = (kmax + KEY_TILE - 1) / KEY_TILE;
    const int tiles_per_split = (tiles_all + a.num_splits - 1) / a.num_splits;
    w.key0 = split * tiles_per_split * KEY_TILE;
    w.key1 = min(kmax, w.key0 + tiles_per_split * KEY_TILE);
  }
  w.direct = a.direct_out;
  w.part = (int64_t(w.r) * a.max_rows + w.row0) * a.num_splits + split;
  w.part_stride = a.num_splits;
  return true;
}

// ---- balanced schedule ------------------------------------------------------------------
// Costs in key tiles of the kernel that runs (32 or 64 keys).
struct SchedUnits {
  int pair = 1;         // start-up charge of one (request, row tile) pair, >= 1
  int min_worker = 1;   // units a share should hold at least: fewer workers for small
                        // batches, though never fewer than their live pairs (balanced_workers)
  int nosplit = 0;      // pairs of at most this many key tiles are never cut
};

__host__ __device__ inline SchedUnits sched_units(const DecodeArgs& a, int key_tile) {
  SchedUnits u;
  const int pair = (a.sched_pair_keys + key_tile - 1) / key_tile;
  const int minw = (a.sched_min_keys + key_tile - 1) / key_tile;
  u.pair = pair > 1 ? pair : 1;
  u.min_worker = minw > 1 ? minw : 1;
  u.nosplit = a.sched_nosplit_keys / key_tile;
  return u;
}

// Key tiles of row tile `row0` of a request (-1 when the tile has no rows) and its keys.
__host__ __device__ inline int pair_tiles(const DecodeArgs& a, int rows, int key_tile, int qlen,
                                          int seq, int nrows, int row0, int* kmax) {
  if (row0 >= nrows) return -1;
  const int last = row0 + rows < nrows ? row0 + rows - 1 : nrows - 1;
  *kmax = decode_row_keys(a, qlen, seq, nrows, last);
  return (*kmax + key_tile - 1) / key_tile;
}

// Cost of request r: its live row tiles' key tiles plus one start-up charge each.
__host__ __device__ inline int64_t request_units(const DecodeArgs& a, int rows, int key_tile,
                                                 const SchedUnits& u, int r) {
  const int qlen = a.query_lens[r], seq = a.seq_lens[r];
  const int nrows = covered_rows(a, qlen);
  int64_t sum = 0;
  for (int row0 = 0; row0 < nrows; row0 += rows) {
    int kmax = 0;
    sum += pair_tiles(a, rows, key_tile, qlen, seq, nrows, row0, &kmax) + u.pair;
  }
  return sum;
}

// Row tiles of request r that hold rows (0 for a request without query rows).
__host__ __device__ inline int live_row_tiles(const DecodeArgs& a, int rows, int r) {
  const int nrows = covered_rows(a, a.query_lens[r]);
  return nrows > 0 ? (nrows + rows - 1) / rows : 0;
}

// Whether the walk runs in pass order: asked for (DecodeArgs::pass_major), and every request
// with rows has the same number n >= 2 of row tiles, given the fewest and the most of those
// counts (requests without rows left out). Then every pass lists the same requests, so a
// worker never walks long runs of empty pairs, and on a batch whose pairs cost alike the
// passes start on share boundaries (the lockstep DecodePlan::pass_major is for); anything
// else keeps request order.
__host__ __device__ inline bool pass_order(const DecodeArgs& a, int fewest, int most) {
  return a.pass_major && a.row_tiles > 1 && fewest == most && fewest >= 2;
}

// Cost of pair (r, t), 0 when row tile t of request r has no rows.
__host__ __device__ inline int64_t pair_units(const DecodeArgs& a, int rows, int key_tile,
                                              const SchedUnits& u, int r, int t) {
  const int qlen = a.query_lens[r], seq = a.seq_lens[r];
  const int nrows = covered_rows(a, qlen);
  int kmax = 0;
  const int tiles = pair_tiles(a, rows, key_tile, qlen, seq, nrows, t * rows, &kmax);
  return tiles < 0 ? 0 : tiles + u.pair;
}

// Workers that get a share of `total` units over `pairs` live (request, row tile) pairs: the
// grid's, fewer when the shares would drop below u.min_worker, but never fewer than the pairs
// (while the grid has them). A batch of short requests (128 x 64 keys: 2 tiles and a start-up
// charge each, 384 units) would otherwise get 48 workers of ~2.7 whole pairs each, run one
// after another, where a piece costs mostly its start (Q, block table and first keys, each a
// round trip to memory): on H200 30.9 us against 11.5 for the per-request grid's 128 CTAs of
// one pair. Every share is non-empty: a live pair costs at least one unit (the charge), so
// total >= pairs.
//
// Where the shares' minimum leaves fewer workers than the grid's, their count is rounded down
// to a multiple of the pairs when that idles at most 1/8 of them: a uniform batch then gives
// every worker one piece of one pair, where 4 x 12 heads x 4 tokens x 8K keys (516 units at 4
// a share) gave 129 workers a piece of 4 tiles and two of them two pieces. At these sizes a
// piece costs far more than its tiles (its Q, first keys and partial write), so those two
// workers set the call's time. With the exact share ends of next_piece, on an H100
// (2026-12-07, twenty-sixth session, two rounds; docs/PERF.md), us: that batch 47.0 -> 40.2,
// 2 of them 39.5 -> 34.7, 4 x 8 heads x 8 tokens (the DSpark draft's rows) 51.0 -> 45.5,
// 4 x 64 heads x 8K 51.8 -> 45.1, 4 x 128 heads x 4K 51.4 -> 43.3; the bench's shapes the same.
__host__ __device__ inline int balanced_workers(int64_t total, int64_t pairs, int grid,
                                                int min_worker) {
  int64_t w = (total + min_worker - 1) / min_worker;
  if (w < pairs) w = pairs;
  if (w < grid && pairs > 0 && (w % pairs) * 8 <= w) w -= w % pairs;
  if (w > grid) w = grid;
  return int(w > 1 ? w : 1);
}
// Worker w's share is [w * total / W, (w + 1) * total / W); the worker holding unit x is the
// largest w with w * total / W <= x, i.e. ceil((x + 1) W / total) - 1.
__host__ __device__ inline int64_t share_begin(int64_t w, int64_t total, int workers) {
  return w * total / workers;
}
__host__ __device__ inline int worker_of(int64_t x, int64_t total, int workers) {
  return int(((x + 1) * workers + total - 1) / total - 1);
}

// Partial slots: only a piece that crosses an end of its worker's share has company (a
// piece wholly inside one share is its pair's only piece and writes out directly), so a
// worker needs at most two slots: 2w + 1 for the piece that runs past its end (also when it
// starts before its beginning), 2w for the piece that starts before its beginning and ends
// inside. Piece s of a pair cut into n pieces from worker w0 on is therefore in slot
// 2 (w0 + s) + (s < n - 1).
__host__ __device__ inline int64_t balanced_slot(int w0, int n, int s) {
  return 2 * int64_t(w0 + s) + (s < n - 1 ? 1 : 0);
}
// The ws_lse index (ws_o: times 512) of that piece's partial for tile-local row `row`.
__host__ __device__ inline int64_t balanced_partial(int w0, int n, int s, int rows, int row) {
  return balanced_slot(w0, n, s) * rows + row;
}

// A worker's share and where its walk over the pairs stands. The walk runs over one
// *section* of the list: the whole list, or (walk tables with sections, balanced_walk_table)
// one part of it with its own workers. Units (lo, hi, off) count from the section's start.
enum WalkMode : int {
  kWalkRequests = 0,   // request order: every row tile of a request, then the next request
  kWalkPass = 1,       // one pass: row tile `tile` of every request of the list
  kWalkAllPasses = 2,  // pass order over the whole list: at its end the next row tile from 0
};
struct WalkState {
  int64_t lo = 0, hi = 0, total = 0;  // the share [lo, hi) of the section's `total` units
  int worker = 0;                     // the CTA's worker id (partial slots are per worker)
  int w0 = 0, workers = 1;            // the section's workers [w0, w0 + workers)
  int r = 0, tile = 0;  // the next pair to look at: list position r (request order[r], or r
                        // without an order) and row tile
  int r_end = 0;        // the list's end
  int64_t off = 0;      // the pair's first unit
  SchedUnits u;
  int mode = kWalkRequests;        // WalkMode
  const int32_t* order = nullptr;  // the list's requests (nullptr: 0, 1, ..., r_end - 1)
};

// The worker's state at the start of its walk: its share of a section of `total` units over
// `workers` workers from w0 on, the walk starting at list position r, row tile `tile`, whose
// pair's first unit is `off`.
__host__ __device__ inline WalkState start_walk(const SchedUnits& u, int worker, int w0,
                                                int workers, int64_t total, int r, int r_end,
                                                int64_t off, int tile, int mode,
                                                const int32_t* order) {
  WalkState st;
  st.u = u;
  st.lo = share_begin(worker - w0, total, workers);
  st.hi = share_begin(worker - w0 + 1, total, workers);
  st.total = total;
  st.worker = worker;
  st.w0 = w0;
  st.workers = workers;
  st.r = r;
  st.r_end = r_end;
  st.tile = tile;
  st.off = off;
  st.mode = mode;
  st.order = order;
  return st;
}

// The key tile nearest to where share k of `total` units over `workers` ends, k * total /
// workers exactly, inside a pair of `units` units (`tiles` key tiles) from unit `off` on, for
// an end strictly inside the pair (next_piece). Out of line: inlined, its 64-bit arithmetic
// made ptxas serialize the wgmma kernel's MMAs for want of registers.
__host__ __device__ __noinline__ inline int share_end_tile(int64_t k, int64_t total, int workers,
                                                           int64_t off, int64_t units, int tiles) {
  const uint64_t d = uint64_t(k * total - off * workers);  // (end - off) * workers
  const uint64_t den = uint64_t(units) * uint64_t(workers);
  return int((2 * d * uint64_t(tiles) + den) / (2 * den));
}

// Moves st past the worker's next piece and describes it in w; false when the worker has no
// more. The worker that takes a pair's first piece records (first worker, pieces) in
// a.pair_table (when write_table: one thread of the CTA) for the combine. Pure integer
// arithmetic over the lengths: the CPU test replays it for every worker.
template <int ROWS, int KEY_TILE>
__host__ __device__ inline bool next_piece(const DecodeArgs& a, WalkState& st, bool write_table,
                                           DecodeWork& w) {
  const SchedUnits& u = st.u;
  // Pairs at most 1/8 of a share long are never cut either: cutting them saves at most a
  // few % of a worker's time and costs a partial write and a combine read.
  const int64_t short_units = (st.total / st.workers) / 8;
  for (;;) {
    if (st.r == st.r_end) {  // the list is over, or in pass order the pass: the next one
      if (st.mode != kWalkAllPasses) return false;
      st.r = 0;
      ++st.tile;
    }
    if ((st.mode != kWalkRequests && st.tile >= a.row_tiles) || st.off >= st.hi) return false;
    w.r = st.order != nullptr ? st.order[st.r] : st.r;
    w.qlen = a.query_lens[w.r];
    w.seq = a.seq_lens[w.r];
    w.nrows = covered_rows(a, w.qlen);
    w.row0 = st.tile * ROWS;
    int kmax = 0;
    const int tiles = pair_tiles(a, ROWS, KEY_TILE, w.qlen, w.seq, w.nrows, w.row0, &kmax);
    if (tiles < 0) {  // past the request's rows: on to the next request
      ++st.r;
      if (st.mode == kWalkRequests) st.tile = 0;
      continue;
    }
    const int64_t pair = int64_t(w.r) * a.row_tiles + st.tile;
    const int64_t off = st.off, units = tiles + u.pair, end = off + units;
    st.off = end;
    if (st.mode == kWalkRequests)
      ++st.tile;
    else
      ++st.r;
    if (tiles <= u.nosplit || units <= short_units) {
      const int64_t mid = off + units / 2;  // whole, to the worker holding the midpoint
      if (st.lo <= mid && mid < st.hi) {
        w.key0 = 0;
        w.key1 = kmax;
        w.direct = true;
        w.part = 0;
        w.part_stride = 0;
        w.w0 = st.worker;
        w.pieces = 1;
        w.piece = 0;
        if (write_table) a.pair_table[pair] = make_int2(st.worker, 1);
        return true;
      }
    } else if (end > st.lo) {
      const int first = worker_of(off, st.total, st.workers);
      const int w0 = st.w0 + first;
      const int n = worker_of(end - 1, st.total, st.workers) - first + 1, s = st.worker - w0;
      // The shares' ends inside the pair map onto its key tiles proportionally (the start-up
      // charge spread over them), rounded to the nearest tile, so neighbouring pieces meet on
      // the same tile. The ends are taken exactly, k * total / workers, not as share_begin
      // rounds them down: a pair cut into n equal shares then gets n equal pieces (with the
      // rounded ends, 2 x 128 heads x 4K keys on 64 workers got pieces of 3 to 5 tiles for
      // 4 each, 8 x 12 heads x 4K on 128 workers 7 to 9 for 8: 29.9 -> 29.3 us on an H100,
      // and 128-tile pairs once got 63 + 65). Interior ends lie strictly inside the pair
      // (worker_of), so only the first piece's start and the last one's end are clamped.
      const int t0 =
          s == 0 ? 0 : share_end_tile(first + s, st.total, st.workers, off, units, tiles);
      const int t1 = s == n - 1
                         ? tiles
                         : share_end_tile(first + s + 1, st.total, st.workers, off, units, tiles);
      w.key0 = t0 * KEY_TILE;
      w.key1 = t1 * KEY_TILE < kmax ? t1 * KEY_TILE : kmax;
      if (w.key1 < w.key0) w.key1 = w.key0;
      w.direct = n == 1;
      w.part = balanced_partial(w0, n, s, ROWS, 0);
      w.part_stride = 1;
      w.w0 = w0;
      w.pieces = n;
      w.piece = s;
      if (s == 0 && write_table) a.pair_table[pair] = make_int2(w0, n);
      return true;
    }
  }
}

// ---- the walk's starts, made on the host --------------------------------------------------
// Every caller plans a batch on the host from lengths it also uploads, so the host can do the
// prologue's work (below) once per batch: per CTA of the grid, the section of the list it
// walks and the pair its walk starts at. A kernel given one (DecodeArgs::walk_table) reads its
// entry instead of loading every length and scanning them: one load in place of a chain of
// loads and barriers before its first copy.
//
// The table can also order the walk in ways the device prologue does not: a batch with
// requests of several row tiles runs in *lockstep sections*, also when the requests have
// different numbers of row tiles (mixed query lengths over 64-row tiles: 12 heads x 2..6
// tokens), where the device keeps request order. The requests of n >= 2 row tiles form a
// group; each of its n passes (row tile t of every member) is a section with the same number
// of workers, so worker j of pass t walks worker j of pass 0's pieces (same requests, same
// keys, up to a tile) at the same time, and the second read of a key tile hits L2; the passes'
// CTAs are interleaved, so those workers are neighbours. The requests of one row tile form the
// last section, in request order. In request order a request's second row tile runs a whole
// pair after its first, on the next worker ~25 tiles apart (mixed bench batch), so both reads
// of every key tile came from DRAM.
struct WalkTableHead {
  int32_t rows = 0, key_tile = 0;  // the kernel tiles the table was made for
  int32_t workers = 0;             // the workers with a share (0: no request has rows)
  int32_t sections = 0;            // 0: the whole list is one section; else lockstep sections
  int64_t total = 0;               // units of the batch
};
inline constexpr int kWalkOrdered = 4;  // WalkStart::mode flag: the list is the table's order
struct WalkStart {
  int64_t off = 0;          // the first unit of the pair holding the share's first unit (counted
                            // from the section's start)
  int64_t total = 0;        // the section's units
  int32_t r = 0, tile = 0;  // that pair: list position and row tile
  int32_t w0 = 0, workers = 0;  // the section's workers (0: this CTA has no share)
  int32_t r_end = 0, mode = 0;  // the section's list end; WalkMode | kWalkOrdered
  int32_t worker = 0;           // the CTA's worker id (its share and partial slots)
  // Pieces of cut pairs in the whole walk, the same in every entry: with none, the fused combine
  // (for_each_decode_work) skips its grid-wide barrier, as nothing is left to merge.
  int32_t cuts = 0;
};
// Layout: the head, a WalkStart per CTA, then the order of the requests (int32 each).
inline size_t walk_table_bytes(int grid, int requests) {
  return sizeof(WalkTableHead) + size_t(grid) * sizeof(WalkStart) + size_t(requests) * 4;
}

// The walk of the list [r0, r_end) of `order` (r itself without one) in `mode` that starts
// worker w0 + j (j < workers) on the pair holding unit share_begin(j, total, workers), run by
// CTA c0 + j * stride: starts[c0 + j * stride] for every j.
inline void walk_section_starts(const DecodeArgs& a, int rows, int key_tile, const SchedUnits& u,
                                const int32_t* order, int r0, int r_end, int mode, int tile,
                                int64_t total, int w0, int workers, int c0, int stride,
                                WalkStart* starts) {
  int r = r0, t = tile;
  int64_t off = 0;
  for (int j = 0; j < workers; ++j) {
    const int64_t lo = share_begin(j, total, workers);
    for (;;) {
      const int req = order != nullptr ? order[r] : r;
      const int64_t n = mode == kWalkRequests ? request_units(a, rows, key_tile, u, req)
                                              : pair_units(a, rows, key_tile, u, req, t);
      if (lo < off + n) break;
      off += n;
      if (++r == r_end && mode == kWalkAllPasses) r = 0, ++t;
    }
    starts[c0 + j * stride] = WalkStart{
        off,    total, r, t, w0, workers, r_end, mode | (order != nullptr ? kWalkOrdered : 0),
        w0 + j, 0};
  }
}

// Lockstep sections (above) for `workers` workers, written to `starts` and `order`; returns
// how many, or 0 (nothing written) when the batch has no request of several row tiles, or when no
// split of the workers keeps every share within 1/16 of total / workers (a group needs a worker per
// pass; a lone long request among many short ones would get one worker per pass).
// `most`: the most row tiles of a request.
inline int lockstep_walk_table(const DecodeArgs& a, int rows, int key_tile, const SchedUnits& u,
                               int workers, int64_t total, int most, bool interleave,
                               WalkStart* starts, int32_t* order) {
  if (most < 2) return 0;
  // Section kinds: n = 1 (the one-tile requests, one section in request order) and every n >= 2
  // with members (n passes). cost / least: the kind's costliest / cheapest section; m: workers
  // per section (never more than `least`: no worker gets an empty share).
  struct Kind {
    int n = 0, members = 0, m = 0;
    int64_t cost = 0, least = 0;
  };
  std::vector<Kind> kinds(size_t(most) + 1);
  std::vector<std::vector<int64_t>> pass_units(size_t(most) + 1);
  for (int n = 1; n <= most; ++n)
    kinds[size_t(n)].n = n, pass_units[size_t(n)].assign(size_t(n), 0);
  std::vector<int> row_tiles(size_t(a.num_requests));  // per request
  for (int r = 0; r < a.num_requests; ++r) {
    const int n = row_tiles[size_t(r)] = live_row_tiles(a, rows, r);
    if (n == 0) continue;
    ++kinds[size_t(n)].members;
    for (int t = 0; t < n; ++t)
      pass_units[size_t(n)][size_t(t)] += pair_units(a, rows, key_tile, u, r, t);
  }
  int used = 0;
  for (Kind& k : kinds) {
    if (k.members == 0) continue;
    k.least = pass_units[size_t(k.n)][0];
    for (int64_t c : pass_units[size_t(k.n)]) {
      k.cost = c > k.cost ? c : k.cost;
      k.least = c < k.least ? c : k.least;
    }
    k.m = 1;
    used += k.n;
  }
  if (used > workers) return 0;
  // Workers one section at a time (n at once for a group) to the kind whose shares are the
  // largest, while they fit.
  for (;;) {
    Kind* best = nullptr;
    for (Kind& k : kinds)
      if (k.members > 0 && k.n <= workers - used && k.m < k.least &&
          (best == nullptr || k.cost * best->m > best->cost * k.m))
        best = &k;
    if (best == nullptr) break;
    ++best->m;
    used += best->n;
  }
  for (const Kind& k : kinds)
    if (k.members > 0 && 16 * k.cost * workers > 17 * total * k.m) return 0;
  // The order: every group's members, fewest row tiles first, then the one-tile requests.
  int pos = 0, w = 0, sections = 0;
  for (int g = 2; g <= most + 1; ++g) {
    const int n = g <= most ? g : 1;  // the one-tile requests last
    const Kind& k = kinds[size_t(n)];
    if (k.members == 0) continue;
    const int r0 = pos;
    for (int r = 0; r < a.num_requests; ++r)
      if (row_tiles[size_t(r)] == n) order[pos++] = r;
    // A group's passes run on interleaved CTAs (pass t, share j on CTA w + j n + t) if
    // `interleave`, so a request's row tiles run on neighbouring CTAs; else each pass on its
    // own run of CTAs.
    for (int t = 0; t < n; ++t) {
      const bool pass = n > 1;
      const int c0 = interleave ? w - t * k.m + t : w, stride = interleave ? n : 1;
      walk_section_starts(a, rows, key_tile, u, order, r0, pos, pass ? kWalkPass : kWalkRequests,
                          pass ? t : 0, pass_units[size_t(n)][size_t(t)], w, k.m, c0, stride,
                          starts);
      w += k.m;
      ++sections;
    }
  }
  return sections;
}

// Which batches balanced_walk_table gives lockstep sections (KMLA_DECODE_LOCKSTEP, A/B runs).
enum LockstepRule : int {
  kLockstepOff = 0,        // none: request order, or pass order for uniform row tile counts
  kLockstepMixedRuns = 1,  // mixed row tile counts, each pass on its own run of CTAs
  kLockstepMixed = 2,      // mixed row tile counts, a group's passes on interleaved CTAs
  kLockstepAll = 3,        // also uniform counts of >= 2 row tiles (instead of pass order)
};

// CTA `cta`'s walk from a table made for a `grid`-CTA launch; false when it has no share.
// *cuts (if given): WalkStart::cuts.
__host__ __device__ inline bool table_walk(const void* table, int grid, int cta,
                                           const SchedUnits& u, WalkState& st,
                                           int* cuts = nullptr) {
  const auto* starts =
      reinterpret_cast<const WalkStart*>(static_cast<const WalkTableHead*>(table) + 1);
  const WalkStart s = starts[cta];
  if (cuts != nullptr) *cuts = s.cuts;
  if (s.workers <= 0) return false;
  const auto* order = reinterpret_cast<const int32_t*>(starts + grid);
  st = start_walk(u, s.worker, s.w0, s.workers, s.total, s.r, s.r_end, s.off, s.tile,
                  s.mode & ~kWalkOrdered, (s.mode & kWalkOrdered) != 0 ? order : nullptr);
  return true;
}

// Fills `out` (walk_table_bytes(grid, a.num_requests) bytes) with every CTA's start for a
// `grid`-CTA launch, a's seq_lens / query_lens pointing to host memory: the lockstep sections
// when a.pass_major asks for pass order and `lockstep` (a LockstepRule) takes the batch, else
// what balanced_prologue finds on the device.
inline void balanced_walk_table(const DecodeArgs& a, int rows, int key_tile, int grid, void* out,
                                int lockstep = kLockstepAll) {
  auto* head = static_cast<WalkTableHead*>(out);
  auto* starts = reinterpret_cast<WalkStart*>(head + 1);
  auto* order = reinterpret_cast<int32_t*>(starts + grid);
  const SchedUnits u = sched_units(a, key_tile);
  int64_t total = 0, pairs = 0;
  int fewest = 0x7fffffff, most = 0;
  for (int r = 0; r < a.num_requests; ++r) {
    total += request_units(a, rows, key_tile, u, r);
    const int n = live_row_tiles(a, rows, r);
    pairs += n;
    if (n > 0) fewest = n < fewest ? n : fewest, most = n > most ? n : most;
  }
  *head = WalkTableHead{};
  head->rows = rows;
  head->key_tile = key_tile;
  head->total = total;
  for (int w = 0; w < grid; ++w) starts[w] = WalkStart{};
  for (int r = 0; r < a.num_requests; ++r) order[r] = r;
  if (total == 0) return;
  const int workers = balanced_workers(total, pairs, grid, u.min_worker);
  head->workers = workers;
  if (a.pass_major && a.row_tiles > 1 && lockstep != kLockstepOff &&
      (fewest != most || lockstep == kLockstepAll))
    head->sections = lockstep_walk_table(a, rows, key_tile, u, workers, total, most,
                                         lockstep != kLockstepMixedRuns, starts, order);
  if (head->sections == 0) {
    const bool by_pass = a.pass_major && a.row_tiles > 1 && pass_order(a, fewest, most);
    walk_section_starts(a, rows, key_tile, u, nullptr, 0, a.num_requests,
                        by_pass ? kWalkAllPasses : kWalkRequests, 0, total, 0, workers, 0, 1,
                        starts);
  }
  // The walk's pieces of cut pairs, replayed here (a few steps per worker).
  int cuts = 0;
  auto count = [&]<int ROWS, int KEY_TILE>() {
    for (int b = 0; b < grid; ++b) {
      WalkState st;
      DecodeWork w;
      if (table_walk(out, grid, b, u, st))
        while (next_piece<ROWS, KEY_TILE>(a, st, false, w)) cuts += w.direct ? 0 : 1;
    }
  };
  if (rows == 64 && key_tile == 64)
    count.template operator()<64, 64>();
  else if (rows == 64)
    count.template operator()<64, 32>();
  else if (rows == 32)
    count.template operator()<32, 32>();
  else
    count.template operator()<16, 32>();
  for (int b = 0; b < grid; ++b) starts[b].cuts = cuts;
}

#ifdef __CUDACC__
// The exclusive prefix sum of `mine` over the CTA's threads in thread order, and the CTA's
// total. Every thread calls it (one barrier; blockDim a multiple of 32); warp_sum_s ([32])
// may be reused only after another barrier.
__device__ __forceinline__ int64_t block_exclusive_sum(int64_t mine, int64_t* warp_sum_s,
                                                       int64_t& total) {
  const int tid = int(threadIdx.x), nthreads = int(blockDim.x);
  const int lane = tid & 31, warp = tid >> 5;
  int64_t incl = mine;  // inclusive scan within the warp
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int64_t v = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += v;
  }
  if (lane == 31) warp_sum_s[warp] = incl;
  __syncthreads();
  int64_t before = incl - mine;
  total = 0;
#pragma unroll 1
  for (int i = 0; i < nthreads / 32; ++i) {
    const int64_t v = warp_sum_s[i];
    if (i < warp) before += v;
    total += v;
  }
  return before;
}

// The CTA's smallest `lo` and largest `hi` (non-negative) over its threads, in warp_s ([32],
// reused: a barrier first, then one after the writes).
__device__ __forceinline__ int2 block_min_max(int lo, int hi, int64_t* warp_s) {
  const int tid = int(threadIdx.x), nthreads = int(blockDim.x);
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, d));
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, d));
  }
  __syncthreads();  // the previous use of warp_s is read
  if ((tid & 31) == 0) warp_s[tid >> 5] = int64_t(uint64_t(uint32_t(lo)) << 32 | uint32_t(hi));
  __syncthreads();
#pragma unroll 1
  for (int i = 0; i < nthreads / 32; ++i) {
    const uint64_t v = uint64_t(warp_s[i]);
    lo = min(lo, int(v >> 32));
    hi = max(hi, int(uint32_t(v)));
  }
  return make_int2(lo, hi);
}

// The balanced schedule's prologue. With a.walk_table (made by balanced_walk_table on the
// host) thread 0 reads the worker's entry. Without one, every thread sums the units (and
// counts the live pairs) of a contiguous run of requests, a block-wide scan turns those into
// offsets (a second one totals the pairs, for the worker count), and the thread whose run
// holds this worker's first unit finds the request there; thread 0 stores the worker's
// WalkState in walk_s. False when the worker has nothing to do. Cost per CTA without a table:
// ceil(R / threads) length loads per thread (R <= kDecodeBalancedMaxRequests, from L2) and
// five barriers; with pass order asked for and several row tiles, a min / max of the
// requests' row tile counts (two barriers) and, in pass order, one more scan (and barrier
// pair) per pass up to the one that holds the worker's first unit.
// Its loops, and those of the block scans above, run once per CTA from a cold instruction
// cache, so none is unrolled (213 KB less code in the binary). Measured (2026-12-06,
// alternated; the results are bitwise the same): the K3 layer decode step 347.3 / 345.8 ->
// 340.0 / 340.0 us and 353.0 / 352.4 / 352.8 -> 346.1 / 346.1 / 346.5 on two H200s (and
// -5 us on an H100, with two once-per-piece loops in decode_attention.cu also not unrolled);
// the other decode cases within +-1.5 us but plain fp8, 1-4 us slower on both H200s.
template <int ROWS, int KEY_TILE>
__device__ __forceinline__ bool balanced_prologue(const DecodeArgs& a, int64_t* walk_s,
                                                  int* merge_s) {
  __shared__ int64_t warp_sum_s[32];
  __shared__ int64_t start_s[3];  // the first pair (request, first unit, row tile)
  const int tid = int(threadIdx.x), nthreads = int(blockDim.x);
  const SchedUnits u = sched_units(a, KEY_TILE);
  if (a.walk_table != nullptr) {  // the host's table, made for this kernel's tiles
    __shared__ int live_s;
    if (tid == 0) {
      WalkState st;
      int cuts = 1;
      live_s = table_walk(a.walk_table, int(gridDim.x), int(blockIdx.x), u, st, &cuts) ? 1 : 0;
      if (live_s != 0) memcpy(walk_s, &st, sizeof(st));
      *merge_s = cuts != 0 ? 1 : 0;
    }
    __syncthreads();
    return live_s != 0;
  }
  const int per = (a.num_requests + nthreads - 1) / nthreads;
  const int rb = min(a.num_requests, tid * per), re = min(a.num_requests, rb + per);
  int64_t mine = 0, mine_pairs = 0;
#pragma unroll 1
  for (int r = rb; r < re; ++r) {
    mine += request_units(a, ROWS, KEY_TILE, u, r);
    mine_pairs += live_row_tiles(a, ROWS, r);
  }
  // The list's head: overwritten below by the thread that finds the worker's first pair (a
  // walk from the head would also be right, only longer).
  if (tid == 0) start_s[0] = start_s[1] = start_s[2] = 0;
  int64_t total = 0, pairs = 0;
  const int64_t before = block_exclusive_sum(mine, warp_sum_s, total);
  if (total == 0) return false;  // no request has rows (uniform: every thread has the total)
  // The live pairs, for the worker count; the barrier first lets the scan's reads of
  // warp_sum_s finish.
  __syncthreads();
  block_exclusive_sum(mine_pairs, warp_sum_s, pairs);
  const int workers = balanced_workers(total, pairs, int(gridDim.x), u.min_worker);
  const int worker = int(blockIdx.x);
  if (worker >= workers) return false;
  const int64_t lo = share_begin(worker, total, workers);
  bool by_pass = false;
  if (a.pass_major && a.row_tiles > 1) {  // the fewest and most row tiles of requests with rows
    int fewest = 0x7fffffff, most = 0;
#pragma unroll 1
    for (int r = rb; r < re; ++r) {
      const int n = live_row_tiles(a, ROWS, r);
      if (n > 0) fewest = min(fewest, n), most = max(most, n);
    }
    const int2 mm = block_min_max(fewest, most, warp_sum_s);
    by_pass = pass_order(a, mm.x, mm.y);
  }
  if (!by_pass) {  // request order
    if (mine > 0 && before <= lo && lo < before + mine) {
      int64_t off = before;
#pragma unroll 1
      for (int r = rb; r < re; ++r) {
        const int64_t units = request_units(a, ROWS, KEY_TILE, u, r);
        if (lo < off + units) {
          start_s[0] = r;
          start_s[1] = off;
          start_s[2] = 0;
          break;
        }
        off += units;
      }
    }
  } else {
    int64_t cum = 0;  // units of the passes before t
#pragma unroll 1
    for (int t = 0; t < a.row_tiles; ++t) {
      int64_t mine_t = 0;
#pragma unroll 1
      for (int r = rb; r < re; ++r) mine_t += pair_units(a, ROWS, KEY_TILE, u, r, t);
      __syncthreads();  // the previous scan's reads of warp_sum_s are done
      int64_t total_t = 0;
      const int64_t before_t = block_exclusive_sum(mine_t, warp_sum_s, total_t);
      if (lo < cum + total_t) {  // the same answer in every thread
        if (mine_t > 0 && cum + before_t <= lo && lo < cum + before_t + mine_t) {
          int64_t off = cum + before_t;
#pragma unroll 1
          for (int r = rb; r < re; ++r) {
            const int64_t units = pair_units(a, ROWS, KEY_TILE, u, r, t);
            if (lo < off + units) {
              start_s[0] = r;
              start_s[1] = off;
              start_s[2] = t;
              break;
            }
            off += units;
          }
        }
        break;
      }
      cum += total_t;
    }
  }
  __syncthreads();
  if (tid == 0) {
    const WalkState st =
        start_walk(u, worker, 0, workers, total, int(start_s[0]), a.num_requests, start_s[1],
                   int(start_s[2]), by_pass ? kWalkAllPasses : kWalkRequests, nullptr);
    memcpy(walk_s, &st, sizeof(st));
  }
  __syncthreads();
  return true;
}

// Runs `run(work)` for each piece of this CTA's work, with a barrier between pieces (the
// pieces reuse the CTA's shared memory). Every thread of the CTA must call it. ROWS and
// KEY_TILE are the calling kernel's row tile and key tile.
// With a.fused_combine (balanced plans launched cooperatively, decode_combine.cuh) the pieces
// of cut pairs are merged here instead of by a combine launch: after a grid-wide barrier,
// `merge(pieces, n)` gets this worker's pieces of cut pairs (n <= 2: a piece that starts
// before the worker's share and one that runs past its end, since every pair inside the
// share is whole).
template <int ROWS, int KEY_TILE, class Run, class Merge>
__device__ __forceinline__ void for_each_decode_work(const DecodeArgs& a, Run&& run,
                                                     Merge&& merge) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Let the combine (launched as a programmatic dependent) get on the GPU now: it waits
  // for this grid's completion before it reads anything (griddepcontrol.wait).
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  // The walk's state and the piece live in shared memory (thread 0 writes them), so no
  // register holds them while a piece runs: the 32 / 64-row kernels have none to spare (128
  // per thread, 64 of them accumulators); the piece reads its fields where it needs them.
  // One call site of run() for both schedules, so the piece's code is inlined once.
  static_assert(sizeof(WalkState) % sizeof(int64_t) == 0 && sizeof(DecodeWork) % 8 == 0);
  __shared__ int64_t walk_s[sizeof(WalkState) / sizeof(int64_t)];
  __shared__ int64_t work_s[sizeof(DecodeWork) / sizeof(int64_t)];
  const DecodeWork& work = *reinterpret_cast<const DecodeWork*>(work_s);
  __shared__ int64_t cut_s[2][sizeof(DecodeWork) / sizeof(int64_t)];  // fused_combine
  __shared__ int cuts_s;
  __shared__ int merge_s;  // 0: the walk table says no pair is cut anywhere (no grid barrier)
  const int tid = int(threadIdx.x);
  if (tid == 0) cuts_s = 0, merge_s = 1;  // (read after the barriers below)
  const bool live = !a.balanced || balanced_prologue<ROWS, KEY_TILE>(a, walk_s, &merge_s);
  while (live) {
    DecodeWork w;
    bool more;
    if (!a.balanced) {
      more = per_request_work<ROWS, KEY_TILE>(a, w);
    } else {
      WalkState st;
      memcpy(&st, walk_s, sizeof(st));  // (a barrier is between every write and read)
      more = next_piece<ROWS, KEY_TILE>(a, st, tid == 0, w);
      if (more) __syncthreads();  // everyone has read the state (uniform)
      if (more && tid == 0) memcpy(walk_s, &st, sizeof(st));
    }
    if (!more) break;
    if (tid == 0) {
      memcpy(work_s, &w, sizeof(w));
      if (a.fused_combine && !w.direct && cuts_s < 2) memcpy(cut_s[cuts_s++], &w, sizeof(w));
    }
    __syncthreads();
    run(work);
    if (!a.balanced) break;  // one piece per CTA
    __syncthreads();  // the next piece reuses shared memory; the state is read after this
  }
  if (a.fused_combine && merge_s != 0) {
    // Every worker's partials (and the grid's ws writes) are visible after the barrier.
    cooperative_groups::this_grid().sync();
    merge(reinterpret_cast<const DecodeWork*>(cut_s), cuts_s);
  }
}
#endif

}  // namespace kmla::cuda
