// Pieces shared by the Hopper prefill kernels (prefill_sm90.cu for 16-bit inputs,
// prefill_fp8_sm90.cu for e4m3): the work items and the producer's rounds and tickets, the
// consumers' ping-pong turns, their pass over tiles they do not see, and the epilogue. One
// item is one 128-row query block of one head of one sequence. Both kernels walk the same
// item order, on the 3-D grid (16-bit, one sequence without a work counter), on a 1-D grid
// with one CTA per item, or on persistent CTAs that draw items from
// PrefillParams::work_counter (docs/prefill_sm90.md, "Persistent CTAs").
#pragma once

#include <cstdint>

#include "cuda/attention.cuh"
#include "cuda/common.cuh"
#include "cuda/sm90.cuh"

namespace kmla::cuda::prefill_common {

constexpr int kRows = 128;  // query rows per item (both kernels' kBlockM)
constexpr int kKeys = 128;  // keys per tile of the 16-bit kernel (the fp8 kernel uses 160)

#if KMLA_SM90A

// Keys visible to query row `row` (0-based in its sequence of n queries and m keys).
__device__ __forceinline__ int key_limit(int row, int n, int m, bool causal) {
  return causal ? min(max(m - n + row + 1, 0), m) : m;
}

// Item `lin` of one sequence's nbx query blocks x H heads: heads in groups of G (the last
// group may be smaller; G = 1 is head after head), inside a group blocks slowest and heads
// fastest, the heaviest (last) block first, so that the group's longest blocks start first
// (LPT) while the CTAs in flight share the K/V of ~G heads in L2. Returns {head, block}.
__device__ __forceinline__ int2 group_order(int lin, int nbx, int G, int H) {
  const int g0 = lin / (G * nbx) * G;  // first head of the group
  const int hs = min(G, H - g0);       // heads in this group
  const int r = lin - g0 * nbx;        // in [0, hs * nbx)
  return make_int2(g0 + r % hs, nbx - 1 - r / hs);
}

struct Item {
  int block, head;  // block -1: past the batch's items (the CTA leaves)
  int q_begin, n, k_begin, m;
};
constexpr Item kNoItem{-1, 0, 0, 0, 0, 0};

// Key tiles (of kTileKeys keys) of an item (block >= 0): those with a key that some row of its
// block sees.
template <int kTileKeys = kKeys>
__device__ __forceinline__ int item_tiles(const Item& it, bool causal) {
  const int last_row = min(it.block * kRows + kRows, it.n) - 1;
  return (key_limit(last_row, it.n, it.m, causal) + kTileKeys - 1) / kTileKeys;
}
// Key tiles that some row of consumer warpgroup c (rows 64 c .. 64 c + 63 of the block)
// sees: a prefix of the item's tiles (causal limits grow with the row); 0 past the sequence.
template <int kTileKeys = kKeys>
__device__ __forceinline__ int warpgroup_tiles(const Item& it, int c, bool causal) {
  const int first = it.block * kRows + 64 * c;
  if (first >= it.n) return 0;
  return (key_limit(min(first + 63, it.n - 1), it.n, it.m, causal) + kTileKeys - 1) / kTileKeys;
}

// The 3-D grid's item for this CTA: blockIdx = (rank, head, sequence), gridDim.x the blocks
// of the longest sequence; block -1 for the ranks a shorter sequence lacks. head_group 0
// (blocks fastest, head after head) is the group order with G = 1.
__device__ __forceinline__ Item grid_item(const PrefillParams& p, int head_group) {
  const int nbx = int(gridDim.x);
  const int2 hb =
      group_order(int(blockIdx.y) * nbx + int(blockIdx.x), nbx, max(head_group, 1), p.heads);
  const int seq = int(blockIdx.z);
  Item it;
  it.head = hb.x;
  it.q_begin = p.cu_q[seq];
  it.n = p.cu_q[seq + 1] - it.q_begin;
  it.k_begin = p.cu_k[seq];
  it.m = p.cu_k[seq + 1] - it.k_begin;
  it.block = hb.y - (nbx - (it.n + kRows - 1) / kRows);
  return it;
}

// Item `idx` of the 1-D list: the sequences in the caller's order, each sequence's items in
// the 3-D grid's order, no item for blocks a sequence lacks. Warp-collective (all 32 lanes,
// every shuffle reached by all of them): lane l reads the lengths of sequences l, l + 32, ...;
// an inclusive warp scan of each sequence's item count (blocks x heads) finds the sequence,
// 32 sequences per round (one round up to 32 sequences: two dependent loads of cu_q / cu_k and
// ~10 shuffles, about what a 3-D grid CTA spends on its own two loads).
__device__ inline Item list_item(const PrefillParams& p, int idx, int head_group) {
  const int lane = int(threadIdx.x & 31), S = p.num_seqs, H = p.heads;
  const int G = max(head_group, 1);
  int rest = idx;  // items before this one in the sequences not yet passed
#pragma unroll 1
  for (int s0 = 0; s0 < S; s0 += 32) {
    const int s = s0 + lane;
    int n = 0;
    if (s < S) n = __ldg(p.cu_q + s + 1) - __ldg(p.cu_q + s);
    const int nb = (max(n, 0) + kRows - 1) / kRows;
    const int items = nb * H;
    int incl = items;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += v;
    }
    const int chunk = __shfl_sync(0xffffffffu, incl, 31);
    const unsigned hits = __ballot_sync(0xffffffffu, incl > rest);
    if (hits != 0u) {  // warp-uniform: the item is in this round's sequences
      const int hit = __ffs(int(hits)) - 1;
      const int lin = rest - __shfl_sync(0xffffffffu, incl - items, hit);
      const int nbx = __shfl_sync(0xffffffffu, nb, hit);
      const int seq = s0 + hit;
      const int2 hb = group_order(lin, nbx, G, H);
      Item it;
      it.head = hb.x;
      it.block = hb.y;
      it.q_begin = __ldg(p.cu_q + seq);
      it.n = __ldg(p.cu_q + seq + 1) - it.q_begin;
      it.k_begin = __ldg(p.cu_k + seq);
      it.m = __ldg(p.cu_k + seq + 1) - it.k_begin;
      return it;
    }
    rest -= chunk;
  }
  return kNoItem;  // idx past the batch's items
}

// Persistent CTAs (1-D grid of G CTAs, fewer than the items): CTA c takes item c, then item
// G + t for every ticket t it draws from counter[0].
__device__ __forceinline__ int draw_ticket(int32_t* counter) {
  return int(gridDim.x) + atomicAdd(counter, 1);
}
// All 128 producer threads (named barrier 3), at the start of round r: the list index of the
// round's item. Round 0 takes item blockIdx.x; with a counter, round r > 0 takes the ticket
// that producer thread 0 drew during round r - 1 and left in next_idx[r & 1] (shared memory);
// without one, `items` (past the list: one item per CTA).
__device__ __forceinline__ int round_index(int r, const int32_t* counter, int items,
                                           const int* next_idx) {
  if (r == 0) return int(blockIdx.x);
  if (counter == nullptr) return items;
  sm90::named_bar_sync<3, 128>();  // thread 0's ticket of the previous round is in
  return next_idx[r & 1];
}
// One thread of each CTA, once it has found no item left: the launch's last CTA to get here
// (every CTA has drawn its last ticket) leaves the counter at zero for the next launch.
__device__ __forceinline__ void leave_counter(int32_t* counter) {
  __threadfence();
  if (atomicAdd(counter + 1, 1) == int(gridDim.x) - 1) {
    counter[0] = 0;
    counter[1] = 0;
  }
}

// Ping-pong between the two consumer warpgroups (cw 0, 1) over one item's "slots" (S(0);
// S(j) + P.V(j - 1) for j = 1 .. T - 1; P.V(T - 1)), on named barriers 1 and 2: consumer 0
// waits on barrier 1 and passes barrier 2, consumer 1 the reverse. Only the first
// min(T0, T1) + 1 slots alternate (both consumers compute the same count), so each bar.sync
// meets exactly one bar.arrive; consumer 1 opens with a pass on 1 (open()) and skips its last
// pass. Each item's turns balance, and consumer 1 opens the next item only after its last
// wait of this one, which follows consumer 0's last wait on barrier 1. No cycle with the
// mbarriers: a slot waits for loads that need the other consumer's releases of tiles two
// back, and a release never waits for a turn.
struct Turns {
  int slots, cw;
  // t0, t1: the tiles each consumer computes; on: ping-pong wanted.
  __device__ __forceinline__ Turns(bool on, int t0, int t1, int consumer)
      : slots(on && t0 > 0 && t1 > 0 ? min(t0, t1) + 1 : 0), cw(consumer) {}
  __device__ __forceinline__ void open() const {
    if (cw == 1 && slots > 0) sm90::named_bar_arrive<1, 256>();  // consumer 0 goes first
  }
  __device__ __forceinline__ void begin(int slot) const {
    if (slot < slots) {
      if (cw == 0)
        sm90::named_bar_sync<1, 256>();
      else
        sm90::named_bar_sync<2, 256>();
    }
  }
  __device__ __forceinline__ void end(int slot) const {
    if (slot < slots) {
      if (cw == 0)
        sm90::named_bar_arrive<2, 256>();
      else if (slot + 1 < slots)
        sm90::named_bar_arrive<1, 256>();
    }
  }
};

// A consumer warp's pass over the item's tiles [from, to) that none of its warpgroup's rows
// see (the causal tail of the first warpgroup, or all tiles for a warpgroup past the
// sequence): wait for each tile's K and V and release them at once, which keeps the rings'
// barrier phases in step. done: the tiles of the CTA's previous items (the ring position).
template <int kStages>
__device__ __forceinline__ void pass_tiles(int from, int to, int done, uint64_t* k_full,
                                           uint64_t* k_empty, uint64_t* v_full, uint64_t* v_empty) {
  const bool lane0 = (threadIdx.x & 31) == 0;
  for (int j = from; j < to; ++j) {
    const int gj = done + j, s = gj % kStages;
    const uint32_t parity = uint32_t((gj / kStages) & 1);
    sm90::mbar_wait(&k_full[s], parity);
    __syncwarp();
    if (lane0) sm90::mbar_arrive(&k_empty[s]);
    sm90::mbar_wait(&v_full[s], parity);
    __syncwarp();
    if (lane0) sm90::mbar_arrive(&v_empty[s]);
  }
}

// A consumer thread's epilogue (the accumulator layout of sm90.cuh: rows row0 and row0 + 8
// of its sequence, columns 8i + 2t, + 1): out = O * out_scale / l rounded once to T, lse =
// (max * scale_log2 + log2 l - lse_offset) ln 2; a row without a visible key gets 0 and -inf,
// rows past n nothing. row_sum is this lane's share of l; the four lanes of a row add theirs
// here (all 32 lanes must call it).
template <class T>
__device__ __forceinline__ void store_rows(const PrefillParams& p, const float (&o)[64],
                                           const float (&row_sum)[2], const float (&row_max)[2],
                                           float scale_log2, float out_scale, float lse_offset,
                                           int row0, int n, int q_begin, int head) {
  const int t = int(threadIdx.x & 3);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + 8 * h;
    float l = row_sum[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (row >= n) continue;
    const bool any = l > 0.f;
    const float f = any ? out_scale / l : 0.f;
    const int64_t grow = int64_t(q_begin) + row;
    T* out = static_cast<T*>(p.out) + grow * p.out_row_stride + int64_t(head) * p.out_head_stride;
#pragma unroll
    for (int i = 0; i < 16; ++i)
      *reinterpret_cast<uint32_t*>(out + 8 * i + 2 * t) =
          pack2<T>(o[4 * i + 2 * h] * f, o[4 * i + 2 * h + 1] * f);
    if (t == 0)
      p.lse[grow * p.lse_row_stride + head] =
          any ? (row_max[h] * scale_log2 + log2f(l) - lse_offset) * 0.69314718055994531f
              : -INFINITY;
  }
}

#endif  // KMLA_SM90A

}  // namespace kmla::cuda::prefill_common
