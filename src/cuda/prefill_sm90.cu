// Variable-length prefill attention for Hopper (sm_90a): the same contract as the mma.sync
// kernel in prefill_attention.cu (see there and cuda/attention.cuh), computed with warpgroup
// MMA (wgmma) instructions that read their operands from 128-byte-swizzled shared memory, fed
// by a producer warpgroup through an mbarrier pipeline. Design and budgets:
// docs/prefill_sm90.md.
//
// Only the sm_90a compile of this file holds the kernels; the sm_80 compile of the same
// source gets empty bodies (the host never launches them on anything but sm_90).
//
// Numerics match the mma.sync kernel: fp32 scores and softmax (exp2 with the scale folded in),
// P rounded to the activation dtype as the register A operand of P.V, the row sum l from the
// unrounded p, the output rounded once after the division by l, LSE in natural log.
#include <cuda.h>  // CUtensorMap (encoded through the runtime's driver entry point)
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda/attention.cuh"
#include "cuda/prefill_attention.cuh"
#include "cuda/prefill_sm90_common.cuh"
#include "cuda/sm90.cuh"

// The device code below needs wgmma and setmaxnreg, which exist only in the sm_90a target.
#define KMLA_SM90_DEVICE KMLA_SM90A

namespace kmla::cuda {
namespace {

constexpr int kNopeDim = 128;
constexpr int kRopeDim = 64;
constexpr int kQkDim = kNopeDim + kRopeDim;  // 192
constexpr int kVDim = 128;
static_assert(kQkDim == 192 && kVDim == 128, "the MLA head dims the tiles are built for");

// Query rows per item (one CTA's block): two consumer warpgroups of 64.
constexpr int kBlockM = prefill_common::kRows;
constexpr int kBlockN = prefill_common::kKeys;  // keys per pipeline stage
constexpr int kStages = 2;
constexpr int kThreads = 384;  // warpgroup 0: producer; 1 and 2: consumers

// Every operand tile is stored as "panels" of 64 elements (128 bytes) per row: a [rows, 192]
// tile is 3 panels [rows][64], a [keys, 128] V tile 2. Inside a panel, 16-byte chunk c of row
// r sits at r * 128 + ((c ^ (r & 7)) * 16): the hardware's 128-byte swizzle, whose pattern
// repeats every 8 rows = 1024 bytes, so every panel starts 1024-byte aligned.
constexpr int kPanelRowBytes = 128;
constexpr int kQPanelBytes = kBlockM * kPanelRowBytes;  // 16384
constexpr int kKPanelBytes = kBlockN * kPanelRowBytes;  // 16384
constexpr int kQBytes = 3 * kQPanelBytes;               // 49152
constexpr int kKBytes = 3 * kKPanelBytes;               // 49152
constexpr int kVBytes = 2 * kKPanelBytes;               // 32768
constexpr int kStageBytes = kKBytes + kVBytes;          // 81920

// Shared-memory plan (dynamic, from a 1024-byte-aligned base):
//   [0, 49152)              Q: 3 panels x 128 rows (consumer warpgroup w reads rows 64w..)
//   49152 + s * 81920       stage s = 0, 1: K 3 panels x 128 keys, then V 2 panels x 128 keys
//   total 212992 bytes (208 KiB) + 1024 of alignment slack = 214016 <= 227 KiB opt-in.
// The 9 mbarriers live in static shared memory (72 bytes; ptxas reports 80 with padding).
constexpr int kSmemBytes = kQBytes + kStages * kStageBytes;  // 212992
constexpr int kSmemAlloc = kSmemBytes + 1024;
static_assert(kSmemAlloc <= 227 * 1024, "fits the sm_90 per-block opt-in");

// Register budget (65536 per SM, one CTA of 384 threads): the kernel starts at <= 168 per
// thread (__launch_bounds__(384, 1)); the producer gives registers back (setmaxnreg 40) and the
// consumers take them (232): 128 x 40 + 256 x 232 = 64512. A consumer thread holds O (64 fp32),
// S (64 fp32) and P (32 packed pairs) plus softmax state and addresses: ~180. ptxas allocates
// each region within its setmaxnreg limit (the producer's copy loop is kept rolled for that).
// The producer's item loop (work counter, list_item) spills 28-40 bytes at 40: local
// memory touched a few times per item. 56 / 224 has no spill but ran single sequences 1-3 %
// slower (H200, 2026-12-04: 8k x 64 heads 2154-2206 against 2101 us).
// The increase only succeeds within what the CTA was launched with (168 x 384 = 64512):
// asking for more would leave the consumers waiting for registers nobody frees.
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= kThreads * 168);

// TMA descriptors of the four inputs, each a 3-D view [rows][heads][width] of a 16-bit
// operand (dims innermost first: width, heads, rows) with a box of 64 x 1 x 128 = one
// 128-byte-swizzled panel of 128 rows (16 KiB). Used only with Sm90Options::tma; passed as a
// __grid_constant__ kernel parameter (4 x 128 bytes), so the device reads them in place.
struct Sm90Maps {
  CUtensorMap q;     // [rows][heads][192]
  CUtensorMap nope;  // [rows][heads][128]
  CUtensorMap rope;  // [rows][heads or 1 when shared][64]
  CUtensorMap v;     // [rows][heads][128]
};

// ---- PTX wrappers (sm_90a) -----------------------------------------------------------
#if KMLA_SM90_DEVICE

// The item list (prefill_sm90_common.cuh, shared with the fp8 kernel) and the mbarrier, TMA,
// descriptor and wgmma-group primitives (sm90.cuh, shared with the decode kernel).
using prefill_common::draw_ticket;
using prefill_common::grid_item;
using prefill_common::Item;
using prefill_common::item_tiles;
using prefill_common::key_limit;
using prefill_common::kNoItem;
using prefill_common::leave_counter;
using prefill_common::list_item;
using prefill_common::pass_tiles;
using prefill_common::round_index;
using prefill_common::store_rows;
using prefill_common::Turns;
using prefill_common::warpgroup_tiles;
using sm90::desc_k_major;
using sm90::fence_proxy_async;
using sm90::fence_regs;
using sm90::make_desc;
using sm90::make_desc_halves;
using sm90::mbar_arrive;
using sm90::mbar_arrive_expect_tx;
using sm90::mbar_init;
using sm90::mbar_wait;
using sm90::named_bar_sync;
using sm90::scale_acc_rows;
using sm90::smem_u32;
using sm90::tma_load_3d;
using sm90::wgmma_commit;
using sm90::wgmma_fence;
using sm90::wgmma_wait;

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// MN-major V (rows = keys, the reduction dim; 64 dims per panel row): the leading byte offset
// is the distance between the two 64-dim panels, the stride byte offset between 8-key groups.
__device__ __forceinline__ uint64_t desc_mn_major(uint32_t addr) {
  return make_desc(addr, kKPanelBytes, 1024);
}

// Named barriers (sm90::named_bar_sync / named_bar_arrive): 1 and 2 order the two consumer
// warpgroups' MMA issue (ping-pong): a warpgroup waits on its own barrier (bar.sync, 128 of the
// 256 threads) and releases the other's (bar.arrive, the other 128), so each completes once per
// handoff. 3-5 are the producer's: 3 all 128 producer threads (Q of a partial block, the
// persistent CTAs' tickets), 4 the K half (warps 0-1), 5 the V half (warps 2-3); with TMA
// a partial tile copied by cp.async is announced by one thread once every copying thread has
// fenced its copies (the full barrier's count is 1 in that mode).

#define KMLA_ACC8(i)                                                                          \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define KMLA_OUT8(i)                                                                          \
  "=f"(d[i]), "=f"(d[i + 1]), "=f"(d[i + 2]), "=f"(d[i + 3]), "=f"(d[i + 4]), "=f"(d[i + 5]), \
      "=f"(d[i + 6]), "=f"(d[i + 7])
#define KMLA_OUT64                                                                        \
  KMLA_OUT8(0), KMLA_OUT8(8), KMLA_OUT8(16), KMLA_OUT8(24), KMLA_OUT8(32), KMLA_OUT8(40), \
      KMLA_OUT8(48), KMLA_OUT8(56)
#define KMLA_ACC64                                                                        \
  KMLA_ACC8(0), KMLA_ACC8(8), KMLA_ACC8(16), KMLA_ACC8(24), KMLA_ACC8(32), KMLA_ACC8(40), \
      KMLA_ACC8(48), KMLA_ACC8(56)
#define KMLA_D64                                                                           \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
  "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "  \
  "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "  \
  "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// d (64 x 128, fp32) = (accumulate ? d : 0) + A (64 x 16, smem, K-major) * B (16 x 128, smem,
// K-major, i.e. stored as 128 rows of k).
template <class T>
__device__ __forceinline__ void wgmma_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                         bool accumulate) {
#define KMLA_WGMMA_SS(TY)                                                    \
  asm volatile(                                                              \
      "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"                         \
      " wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " KMLA_D64 \
      ", %64, %65, p, 1, 1, 0, 0;\n}\n"                                      \
      : KMLA_ACC64                                                           \
      : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)))
  if constexpr (std::is_same_v<T, bf16>)
    KMLA_WGMMA_SS("bf16");
  else
    KMLA_WGMMA_SS("f16");
#undef KMLA_WGMMA_SS
}

// d (64 x 128, fp32) += A (64 x 16, registers: the mma.sync m16n8k16 A fragment of each
// warp's 16 rows) * B (16 x 128, smem, MN-major: stored as 16 rows of 128 outputs).
template <class T>
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) {
#define KMLA_WGMMA_RS(TY)                                                    \
  asm volatile(                                                              \
      "{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"                         \
      " wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " KMLA_D64 \
      ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                        \
      : KMLA_ACC64                                                           \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1))
  if constexpr (std::is_same_v<T, bf16>)
    KMLA_WGMMA_RS("bf16");
  else
    KMLA_WGMMA_RS("f16");
#undef KMLA_WGMMA_RS
}
#undef KMLA_D64
#undef KMLA_OUT64
#undef KMLA_ACC64
#undef KMLA_OUT8
#undef KMLA_ACC8

// Copies 64 columns (8 chunks of 16 bytes) of kRows rows into one swizzled panel with
// kCopyThreads threads: thread i takes chunk i % 8 of rows i / 8 + (kCopyThreads / 8) k, so 8
// consecutive threads read one 128-byte row segment, and (row & 7) is the same for all k.
// Rows >= valid_rows are zero-filled (src-size 0) from a valid address without reading it.
template <int kRows, int kCopyThreads, class T>
__device__ __forceinline__ void copy_panel(uint32_t panel, const T* src, int64_t row_stride,
                                           int valid_rows, int tid) {
  constexpr int kRowStep = kCopyThreads / 8;
  static_assert(kRowStep % 8 == 0 && kRows % kRowStep == 0);
  const int c = tid & 7, r0 = tid >> 3;
  const T* thread_src = src + int64_t(r0) * row_stride + c * 8;
  const int64_t step = kRowStep * row_stride;
  uint32_t dst = panel + r0 * kPanelRowBytes + ((c ^ (r0 & 7)) << 4);
  // Not unrolled: the producer runs on 40 registers, and one cp.async per iteration is far
  // below what the consumers' MMAs take per byte.
#pragma unroll 1
  for (int r = r0; r < kRows; r += kRowStep) {
    const bool valid = r < valid_rows;
    cp_async_16(dst, valid ? thread_src : src, valid);
    thread_src += step;
    dst += kRowStep * kPanelRowBytes;
  }
}

#endif  // KMLA_SM90_DEVICE

// ---- the kernel ---------------------------------------------------------------------
// Grid: (max query blocks, heads, sequences); CTAs start in about linear order (x fastest).
// The linear index within a sequence maps to (head, rank), rank r taking query block
// num_blocks - 1 - r (rank 0: the last block, for causal the most expensive one):
// * head_group 0 (round 1): head = y, rank = x: all blocks of one head, heavy first, then the
//   next head. Good L2 reuse (the ~132 CTAs in flight share one or two heads' K/V), but a
//   head's heaviest block starts as late as the previous heads' work allows, so the last
//   head's heavy blocks run past the others: ~12% idle tail at 8k tokens x 16 heads, 15% at
//   12 heads, 3% at 64 (list-scheduling model, work proportional to the block's keys).
// * head_group G > 0: heads in groups of G (the last group may be smaller); inside a group
//   ranks slowest, heads fastest, so the group's blocks start longest first (LPT): the
//   model's tail drops below 0.5% at every size above. With G = 8 the CTAs in flight still
//   cover only ~8 heads (~16 CTAs per head, roughly in step along the keys), so each K/V
//   tile is read from HBM once per ~16 CTAs: at 8k x 64 heads ~0.7 GB over ~2.5 ms. The
//   default G = 2 keeps the K/V of the heads in flight inside L2 up to 32k keys (2 x 20 MB).
//
// With PrefillParams::work_counter the compact grid (also for one sequence) has one CTA per
// SM instead, each taking items in turn (item blockIdx.x, then one per ticket drawn from
// the counter), so that the next item's Q and first tiles load under the current item's
// last tiles and epilogue: q_empty (every consumer thread, after its warpgroup's last S)
// releases Q and the item slot, and the stages' barrier phases run on from item to item.
//
// Warpgroup 0 (producer, 40 registers): loads each item's Q (all 128 threads; its latency
// overlaps that of tile 0, which is issued before Q is waited for), then K and V tiles of
// 128 keys into a two-stage ring with cp.async: warps 0-1 the K tiles, warps 2-3 the V tiles.
// Per tile, each half waits until both consumers are done with the stage's K (mbarrier
// `k_empty`: their S of the tile two back) or V (`v_empty`: their P.V two tiles back), copies
// (K 3 panels, V 2), waits for its own copies, fences them to the async proxy and arrives on
// `k_full` / `v_full`. So K is refilled while V is still being read, and S of a tile can start
// while its V is in flight.
// With `tma` (the default) one thread per half issues a bulk tensor copy per panel instead
// and arrives with the byte count (partial boxes still go by cp.async, see produce_tma).
//
// Warpgroups 1 and 2 (consumers, 232 registers): query rows [64(w-1), 64w) of the block. Per
// tile: S = Q K^T as 12 wgmma m64n128k16 (Q and K from smem); mask (diagonal and last tile
// only); online softmax on S in registers; P rounded to T in registers; O += P V as 8 wgmma
// m64n128k16 (P from registers, V from smem, MN-major). kOverlap = false runs these strictly
// in order; kOverlap = true issues S of tile j with P.V of tile j - 1 and does the softmax of
// tile j while that P.V runs (FA3's intra-warpgroup overlap). On top, with `pingpong` the
// two consumers take turns issuing their MMAs (named barriers), so that one's softmax runs
// under the other's MMAs rather than at the same time as the other's softmax.
//
// Accumulator layout (m64nN, fp32): warp v of the warpgroup holds rows 16v..16v+15; lane
// (g = lane / 4, t = lane % 4) holds, for each 8-column block i, d[4i + 0, 1] = row g, columns
// 8i + 2t, +1 and d[4i + 2, 3] = row g + 8, same columns (as mma.sync m16n8).
//
// kSchedule: 0 in order, 1 overlapped, 2 overlapped with the early rescale of O (a template
// parameter, not a runtime flag: with a runtime branch between the S and P.V issues, ptxas
// inserts an extra warpgroup fence (C7519) before the P.V).
template <class T, int kSchedule>
__global__ void __launch_bounds__(kThreads, 1)
    prefill_attention_sm90_kernel(const PrefillParams p, const __grid_constant__ Sm90Maps maps,
                                  float scale_log2, int head_group, bool pingpong, bool tma,
                                  bool compact, int compact_items) {
#if KMLA_SM90_DEVICE
  constexpr bool kOverlap = kSchedule == 1 || kSchedule == 2;
  constexpr bool early_rescale = kSchedule == 2;
  static_assert(kSchedule >= 0 && kSchedule <= 2);
  __shared__ __align__(8) uint64_t q_full, q_empty, k_full[kStages], v_full[kStages];
  __shared__ __align__(8) uint64_t k_empty[kStages], v_empty[kStages];
  extern __shared__ uint8_t smem_raw[];
  const uint32_t smem_base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t q_smem = smem_base;
  auto stage_smem = [&](int s) { return smem_base + kQBytes + s * kStageBytes; };

  // The 3-D grid's CTAs past their sequence's query blocks leave at once (uniform: the
  // whole CTA); the compact grid's items are found round by round by the producer.
  if (!compact && grid_item(p, head_group).block < 0) return;

  const int tid = threadIdx.x;
  const int wg = tid / 128;  // 0: producer
  const int wtid = tid & 127;

  if (tid == 0) {
    // cp.async producer: every copying thread arrives; TMA producer: one arrival per load
    // (with the bytes expected), or one after a named barrier for a partial tile.
    mbar_init(&q_full, tma ? 1 : 128);
    // Every consumer thread arrives once it has read the item and its warpgroup's S products
    // (the wgmma reads of Q) have completed.
    mbar_init(&q_empty, 256);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&k_full[s], tma ? 1 : 64);  // the K half of the producer
      mbar_init(&v_full[s], tma ? 1 : 64);  // the V half
      mbar_init(&k_empty[s], 8);            // one arrival per consumer warp
      mbar_init(&v_empty[s], 8);
    }
  }
  __syncthreads();
  const bool causal = p.causal;
  // The item of round r (compact grid: the index `idx` in list_item's order), and the
  // tiles it loads (0 for a block whose rows see no key). The producer finds it and passes it
  // to the consumers with Q (item_smem, below).
  auto round_item = [&](int r, int idx) {
    if (!compact) return r == 0 ? grid_item(p, head_group) : kNoItem;
    return idx < compact_items ? list_item(p, idx, head_group) : kNoItem;
  };
  __shared__ Item item_smem;
  // Compact grid with a work counter (G CTAs, fewer than the items): CTA c takes item c,
  // then G + the tickets it draws from p.work_counter[0], one per item, drawn by producer
  // thread 0 once the item's loads are issued and passed to the other producer threads in
  // next_idx[r & 1].
  __shared__ int next_idx[2];

  // TMA producer (Sm90Options::tma). A full box (128 rows inside the sequence) is one TMA
  // per panel, issued by one thread that also arrives with the byte count: Q 3 panels
  // (48 KiB), K 3 (48 KiB), V 2 (32 KiB). A partial box is copied with cp.async as in the
  // other producer, because TMA zero-fills only outside the whole tensor: rows past this
  // sequence would be the next sequence's (or NaN padding), and 0 x NaN in V poisons P.V.
  // That is at most the last key tile and the last query block of each sequence. The map's
  // row extent is therefore never what bounds a load, and the host sets it to 2^31.
  // Row `row` of head `h` of an operand (computed where a copy needs it: the producer has
  // 40 registers).
  auto rows_of = [&](const Operand& o, int64_t row, int h) {
    return static_cast<const T*>(o.ptr) + row * o.row_stride + int64_t(h) * o.head_stride;
  };
  // cp.async copies (both producers): Q rows [q_row, q_row + 128) of head h by all 128
  // threads, and one key tile's half by its 64 threads (warps 0-1: K, 3 panels; warps 2-3:
  // V, 2 panels); rows past `valid` are zero-filled.
  auto copy_q = [&](int64_t q_row, int valid, int h) {
    for (int pn = 0; pn < 3; ++pn)
      copy_panel<kBlockM, 128>(q_smem + pn * kQPanelBytes, rows_of(p.q, q_row, h) + pn * 64,
                               p.q.row_stride, valid, wtid);
  };
  auto copy_kv_half = [&](int s, int64_t key_row, int valid, int h) {
    const uint32_t k_smem = stage_smem(s), v_smem = k_smem + kKBytes;
    const int ctid = wtid & 63;
    if (wtid < 64) {
      const T* nope = rows_of(p.k_nope, key_row, h);
      const int64_t ks = p.k_nope.row_stride;
      copy_panel<kBlockN, 64>(k_smem, nope, ks, valid, ctid);
      copy_panel<kBlockN, 64>(k_smem + kKPanelBytes, nope + 64, ks, valid, ctid);
      copy_panel<kBlockN, 64>(k_smem + 2 * kKPanelBytes, rows_of(p.k_rope, key_row, h),
                              p.k_rope.row_stride, valid, ctid);
    } else {
      const T* v = rows_of(p.v, key_row, h);
      copy_panel<kBlockN, 64>(v_smem, v, p.v.row_stride, valid, ctid);
      copy_panel<kBlockN, 64>(v_smem + kKPanelBytes, v + 64, p.v.row_stride, valid, ctid);
    }
  };
  // The item's Q block and its `tiles` key tiles; g0: tiles this CTA loaded before.
  auto produce_tma = [&](const Item& it, int tiles, int g0) {
    const int h = it.head, q_row = it.q_begin + it.block * kBlockM;
    const int q_valid = it.n - it.block * kBlockM, k_row0 = it.k_begin, keys = it.m;
    const int rope_head = p.k_rope.head_stride == 0 ? 0 : h;
    if (q_valid >= kBlockM) {
      if (wtid == 0) {
        tma_prefetch_map(&maps.q);
        tma_prefetch_map(&maps.nope);
        tma_prefetch_map(&maps.rope);
        tma_prefetch_map(&maps.v);
        mbar_arrive_expect_tx(&q_full, kQBytes);
        for (int pn = 0; pn < 3; ++pn)
          tma_load_3d(q_smem + pn * kQPanelBytes, &maps.q, 64 * pn, h, q_row, &q_full);
      }
    } else {
      copy_q(q_row, q_valid, h);
      cp_async_commit();
      cp_async_wait<0>();
      fence_proxy_async();
      named_bar_sync<3, 128>();
      if (wtid == 0) mbar_arrive(&q_full);
    }
    const bool loads_k = wtid < 64;
    const int ctid = wtid & 63;
#pragma unroll 1
    for (int j = 0; j < tiles; ++j) {
      const int gj = g0 + j;  // tiles this CTA loaded before
      const int s = gj % kStages;
      const int key0 = j * kBlockN;
      const int rows = keys - key0;  // >= 1
      const uint32_t k_smem = stage_smem(s), v_smem = k_smem + kKBytes;
      if (gj >= kStages)  // the consumers' release of tile gj - kStages
        mbar_wait(loads_k ? &k_empty[s] : &v_empty[s], uint32_t((gj / kStages - 1) & 1));
      if (rows >= kBlockN) {
        if (ctid == 0) {
          if (loads_k) {
            mbar_arrive_expect_tx(&k_full[s], kKBytes);
            tma_load_3d(k_smem, &maps.nope, 0, h, k_row0 + key0, &k_full[s]);
            tma_load_3d(k_smem + kKPanelBytes, &maps.nope, 64, h, k_row0 + key0, &k_full[s]);
            tma_load_3d(k_smem + 2 * kKPanelBytes, &maps.rope, 0, rope_head, k_row0 + key0,
                        &k_full[s]);
          } else {
            mbar_arrive_expect_tx(&v_full[s], kVBytes);
            tma_load_3d(v_smem, &maps.v, 0, h, k_row0 + key0, &v_full[s]);
            tma_load_3d(v_smem + kKPanelBytes, &maps.v, 64, h, k_row0 + key0, &v_full[s]);
          }
        }
      } else {
        copy_kv_half(s, k_row0 + key0, rows, h);
        cp_async_commit();
        cp_async_wait<0>();
        fence_proxy_async();
        if (loads_k)
          named_bar_sync<4, 64>();
        else
          named_bar_sync<5, 64>();
        if (ctid == 0) mbar_arrive(loads_k ? &k_full[s] : &v_full[s]);
      }
    }
  };

  if (wg == 0) {
    // ---- producer ----
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    int done = 0;  // tiles loaded for the previous items (their stages and phases run on)
    int32_t* const counter = compact ? p.work_counter : nullptr;
#pragma unroll 1
    for (int r = 0;; ++r) {
      const int idx = round_index(r, counter, compact_items, next_idx);
      // Each warp finds the item itself (a few dependent loads, under the consumers' work on
      // the previous item), then waits until the consumers are done with the previous Q.
      const Item it = round_item(r, idx);
      if (r > 0) mbar_wait(&q_empty, uint32_t((r - 1) & 1));
      if (wtid == 0) item_smem = it;  // published by the q_full arrival below
      const int num_tiles = it.block < 0 ? 0 : item_tiles(it, causal);
      if (num_tiles == 0) {
        // No more items, or a block whose rows see no key: no Q to load, only the item.
        if (!tma || wtid == 0) mbar_arrive(&q_full);
        if (it.block < 0) {
          if (counter != nullptr && wtid == 0) leave_counter(counter);
          return;
        }
      } else if (tma) {
        produce_tma(it, num_tiles, done);
      } else {
        const int q0 = it.block * kBlockM;
        copy_q(it.q_begin + q0, it.n - q0, it.head);
        cp_async_commit();  // Q's group; waited for after tile 0's copies are issued (below)
        // Warps 0-1 load K tiles, warps 2-3 V tiles, each at its own pace: K of tile j only
        // waits for the consumers' S of tile j - 2, V for their P.V of tile j - 2.
        const bool loads_k = wtid < 64;
        for (int j = 0; j < num_tiles; ++j) {
          const int gj = done + j;
          const int s = gj % kStages;
          if (gj >= kStages)  // the consumers' release of tile gj - kStages
            mbar_wait(loads_k ? &k_empty[s] : &v_empty[s], uint32_t((gj / kStages - 1) & 1));
          // rows past the keys are zero-filled
          copy_kv_half(s, int64_t(it.k_begin) + j * kBlockN, it.m - j * kBlockN, it.head);
          cp_async_commit();
          if (j == 0) {
            // Q and tile 0 load at the same time (one latency instead of two before the first
            // MMA of every item): Q's group is the older one, so at most one pending means Q
            // is in.
            cp_async_wait<1>();
            fence_proxy_async();
            mbar_arrive(&q_full);
          }
          cp_async_wait<0>();  // this thread's copies have landed
          fence_proxy_async();
          mbar_arrive(loads_k ? &k_full[s] : &v_full[s]);
        }
      }
      done += num_tiles;
      // The next item's ticket, drawn once this item's loads are issued: about when the SM
      // finishes this item, as a grid hands its next CTA to the first SM that frees up. Drawn
      // at the start of the item instead, single sequences ran 1-4 % slower (the heavy-first
      // list's tail balances worse when CTAs commit to an item one item early).
      if (counter != nullptr && wtid == 0) next_idx[(r + 1) & 1] = draw_ticket(counter);
    }
  }

  // ---- consumers ----
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
  const int cw = wg - 1;  // consumer warpgroup 0 or 1
  const int warp = wtid / 32, lane = wtid & 31, g = lane >> 2, t = lane & 3;
  // Done with a stage's K or V: one arrival per warp (its wgmma reads completed at the
  // warpgroup's wait).
  auto release = [&](uint32_t bar) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
  };
  // Shared addresses and descriptor halves the tile loop needs, computed once (sm90::desc_lo):
  // K-major Q and K (leading offset 16), MN-major V (leading offset kKPanelBytes).
  const uint32_t k_full_a = smem_u32(k_full), k_empty_a = smem_u32(k_empty);
  const uint32_t v_full_a = smem_u32(v_full), v_empty_a = smem_u32(v_empty);
  const uint32_t q_empty_a = smem_u32(&q_empty);
  constexpr uint32_t kDescHi = sm90::desc_hi(1024, 1);
  const uint32_t q_lo = sm90::desc_lo(q_smem + cw * 64 * kPanelRowBytes, 16);
  const uint32_t k_lo = sm90::desc_lo(stage_smem(0), 16);  // stage s: + s * kStageBytes / 16
  const uint32_t v_lo = sm90::desc_lo(stage_smem(0) + kKBytes, kKPanelBytes);
  int done = 0;  // tiles consumed for the previous items (the producer's count)
#pragma unroll 1
  for (int r = 0;; ++r) {
    mbar_wait(&q_full, uint32_t(r & 1));  // Q and the item of round r (Q: when it has keys)
    const Item it = item_smem;
    if (it.block < 0) return;  // no more items
    const int head = it.head, q_begin = it.q_begin, n = it.n, m = it.m;
    const int q0 = it.block * kBlockM;
    const int num_tiles = item_tiles(it, causal);
    const int wg_first = q0 + 64 * cw;  // first row of this warpgroup (in the sequence)
    const bool wg_active = wg_first < n;
    const int wg_min_limit = key_limit(wg_first, n, m, causal);
    const int wg_tiles = warpgroup_tiles(it, cw, causal);
    const int row0 = wg_first + 16 * warp + g;  // this thread's rows: row0 and row0 + 8
    const int row_limit[2] = {key_limit(row0, n, m, causal), key_limit(row0 + 8, n, m, causal)};

    float o[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY};  // raw score units
    float row_sum[2] = {0.f, 0.f};              // this thread's share of l
    float sc[64];                               // S, then P in fp32
    uint32_t pa[8][4];                          // P rounded to T: the A operand of P.V
    float correction[2];

    // Tile j of this item: its stage and the phase of that stage's barriers.
    // (Unsigned, so that the modulo is a mask for 2 stages.)
    auto stage = [&](int j) { return uint32_t(done + j) % kStages; };
    auto parity = [&](int j) { return (uint32_t(done + j) / kStages) & 1u; };
    // S = Q K^T of tile j: 12 k-steps of 16 over the 3 panels (issued, not waited for).
    auto issue_s = [&](int j) {
      const uint32_t k = k_lo + stage(j) * (kStageBytes >> 4);
#pragma unroll
      for (int kk = 0; kk < 12; ++kk) {
        const uint32_t off = ((kk / 4) * kQPanelBytes + (kk % 4) * 32) >> 4;
        wgmma_ss<T>(sc, make_desc_halves(q_lo + off, kDescHi), make_desc_halves(k + off, kDescHi),
                    kk > 0);
      }
      wgmma_commit();
    };
    // O += P V of tile j: 8 k-steps of 16 keys, each two whole 8-key swizzle groups (2048 B).
    auto issue_pv = [&](int j) {
      const uint32_t v = v_lo + stage(j) * (kStageBytes >> 4);
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk)
        wgmma_rs<T>(o, pa[kk], make_desc_halves(v + ((kk * 16 * kPanelRowBytes) >> 4), kDescHi));
      wgmma_commit();
    };
    // Mask and online softmax of tile j in place on sc (base 2, online_softmax_rows);
    // sets correction[] and returns whether any row of the warp moved its max (O needs it).
    auto softmax = [&](int j) {
      const int key0 = j * kBlockN;
      if (key0 + kBlockN > wg_min_limit) {  // some key of this tile is hidden from some row
#pragma unroll
        for (int i = 0; i < 16; ++i) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = key0 + 8 * i + 2 * t + (e & 1);
            if (key >= row_limit[e >> 1]) sc[4 * i + e] = -INFINITY;
          }
        }
      }
      const bool max_moved = online_softmax_rows<16>(sc, row_max, row_sum, correction, scale_log2);
      return __any_sync(0xffffffffu, max_moved);
    };
    auto rescale_o = [&] { scale_acc_rows(o, correction); };
    // P as the register A operand: k-step kk covers keys 16kk..16kk+15 = column blocks 2kk and
    // 2kk + 1 of S: {row g keys 2t.., row g+8 keys 2t.., row g keys 8+2t.., row g+8 keys 8+2t..}.
    auto pack_p = [&] {
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) {
        pa[kk][0] = pack2<T>(sc[8 * kk + 0], sc[8 * kk + 1]);
        pa[kk][1] = pack2<T>(sc[8 * kk + 2], sc[8 * kk + 3]);
        pa[kk][2] = pack2<T>(sc[8 * kk + 4], sc[8 * kk + 5]);
        pa[kk][3] = pack2<T>(sc[8 * kk + 6], sc[8 * kk + 7]);
      }
    };

    // Ping-pong (overlapped schedule only): the two consumers take turns issuing their MMAs,
    // one slot at a time (prefill_common::Turns), so while one runs its softmax the other's
    // GEMMs are queued on the tensor cores, instead of both warpgroups drifting into step and
    // leaving the tensor cores idle during a shared softmax phase.
    const Turns turns(kOverlap && pingpong, warpgroup_tiles(it, 0, causal), warpgroup_tiles(it, 1, causal), cw);
    turns.open();

    // Done with Q (and the item) once the warpgroup's last S has completed: the producer then
    // loads the next item's Q while this one's last P.V and epilogue run.
    if (wg_tiles == 0) mbar_arrive(q_empty_a);
    if constexpr (!kOverlap) {
      // Tile by tile: S, softmax, P.V, each waited for before the next.
      for (int j = 0; j < wg_tiles; ++j) {
        const int st = stage(j);
        mbar_wait(k_full_a + 8 * st, parity(j));
        wgmma_fence();
        issue_s(j);
        wgmma_wait<0>();
        fence_regs(sc);
        release(k_empty_a + 8 * st);
        if (j == wg_tiles - 1) mbar_arrive(q_empty_a);
        if (softmax(j)) rescale_o();
        pack_p();
        mbar_wait(v_full_a + 8 * st, parity(j));
        fence_regs(o);
        wgmma_fence();
        issue_pv(j);
        wgmma_wait<0>();
        fence_regs(o);
        release(v_empty_a + 8 * st);
      }
    } else if (wg_tiles > 0) {
      // S of tile j is issued together with P.V of tile j - 1, and the softmax of tile j runs
      // while P.V of tile j - 1 is still on the tensor cores. The rescale of O by tile j's
      // correction waits for that P.V (O then holds tiles < j at tile j - 1's max): at the end
      // of the iteration, or with early_rescale in the next one, between the issue of S(j + 1)
      // and of P.V(j), where the 64 multiplies run under S(j + 1) instead of delaying the next
      // issue (FA3 does the same for QK head dims above 128, where S is long enough to hide
      // them). `pending`: O still owes the correction of the last softmax (warp-uniform).
      bool pending = false;
      mbar_wait(k_full_a + 8 * stage(0), parity(0));
      turns.begin(0);
      wgmma_fence();
      issue_s(0);
      turns.end(0);
      wgmma_wait<0>();
      fence_regs(sc);
      release(k_empty_a + 8 * stage(0));
      if (wg_tiles == 1) mbar_arrive(q_empty_a);
      softmax(0);  // O is zero: no rescale
      pack_p();
      for (int j = 1; j < wg_tiles; ++j) {
        const int st = stage(j), prev = stage(j - 1);
        mbar_wait(k_full_a + 8 * st, parity(j));
        mbar_wait(v_full_a + 8 * prev, parity(j - 1));
        fence_regs(o);
        turns.begin(j);
        wgmma_fence();
        issue_s(j);
        if constexpr (early_rescale) {
          fence_regs(o);  // volatile asm order: the multiplies come after the S issue
          if (pending) rescale_o();
          fence_regs(o);
          wgmma_fence();  // O was written by ordinary instructions since the last fence
        }
        issue_pv(j - 1);
        turns.end(j);
        wgmma_wait<1>();  // groups complete in order: S of tile j is done
        fence_regs(sc);
        release(k_empty_a + 8 * st);
        if (j == wg_tiles - 1) mbar_arrive(q_empty_a);
        const bool moved = softmax(j);
        wgmma_wait<0>();  // P.V of tile j - 1 is done: O and pa are free
        fence_regs(o);
        release(v_empty_a + 8 * prev);
        if constexpr (early_rescale)
          pending = moved;
        else if (moved)
          rescale_o();
        pack_p();
      }
      const int last = wg_tiles - 1;
      mbar_wait(v_full_a + 8 * stage(last), parity(last));
      fence_regs(o);
      turns.begin(wg_tiles);
      if (pending) rescale_o();
      fence_regs(o);
      wgmma_fence();
      issue_pv(last);
      turns.end(wg_tiles);
      wgmma_wait<0>();
      fence_regs(o);
      release(v_empty_a + 8 * stage(last));
    }
    pass_tiles<kStages>(wg_tiles, num_tiles, done, k_full, k_empty, v_full, v_empty);

    // Epilogue: O / l rounded once to T; lse = ln(l) + scale * max; rows with no key: 0, -inf.
    if (wg_active)
      store_rows<T>(p, o, row_sum, row_max, scale_log2, 1.f, 0.f, row0, n, q_begin, head);
    done += num_tiles;
  }
#else
  (void)p, (void)maps;
  (void)scale_log2, (void)head_group, (void)pingpong, (void)tma, (void)compact, (void)compact_items;
#endif
}

// ---- building-block probe -------------------------------------------------------------
// One warpgroup, no pipeline: a [64, 192], k [128, 192], v [128, 128] (dense rows) go through
// the kernel's own copy_panel into swizzled panels; S = a k^T by 12 wgmma_ss, written to s_out
// [64, 128] through the accumulator layout; then P = S rounded to T as the register operand,
// O = P v by 8 wgmma_rs with the MN-major descriptor, written to o_out [64, 128].
// swap_v_strides exchanges the V descriptor's two byte offsets: a diagnostic for the tests.
template <class T>
__global__ void __launch_bounds__(128)
    prefill_sm90_probe_kernel(const T* a, const T* k, const T* v, float* s_out, float* o_out,
                              bool swap_v_strides) {
#if KMLA_SM90_DEVICE
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t a_smem = base, k_smem = base + 3 * 64 * kPanelRowBytes;
  const uint32_t v_smem = k_smem + kKBytes;
  const int tid = threadIdx.x;
  for (int pn = 0; pn < 3; ++pn) {
    copy_panel<64, 128>(a_smem + pn * 64 * kPanelRowBytes, a + pn * 64, kQkDim, 64, tid);
    copy_panel<kBlockN, 128>(k_smem + pn * kKPanelBytes, k + pn * 64, kQkDim, kBlockN, tid);
  }
  for (int pn = 0; pn < 2; ++pn)
    copy_panel<kBlockN, 128>(v_smem + pn * kKPanelBytes, v + pn * 64, kVDim, kBlockN, tid);
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();
  __syncthreads();

  float sc[64];
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kQkDim / 16; ++kk) {
    const uint32_t a_off = (kk / 4) * 64 * kPanelRowBytes + (kk % 4) * 32;
    const uint32_t k_off = (kk / 4) * kKPanelBytes + (kk % 4) * 32;
    wgmma_ss<T>(sc, desc_k_major(a_smem + a_off), desc_k_major(k_smem + k_off), kk > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(sc);

  const int warp = tid / 32, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int r = 16 * warp + g;
#pragma unroll
  for (int i = 0; i < 16; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      s_out[(r + 8 * (e >> 1)) * kBlockN + 8 * i + 2 * t + (e & 1)] = sc[4 * i + e];

  uint32_t pa[8][4];
#pragma unroll
  for (int kk = 0; kk < 8; ++kk)
#pragma unroll
    for (int q = 0; q < 4; ++q) pa[kk][q] = pack2<T>(sc[8 * kk + 2 * q], sc[8 * kk + 2 * q + 1]);
  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  fence_regs(o);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 8; ++kk)
    wgmma_rs<T>(o, pa[kk],
                swap_v_strides ? make_desc(v_smem + kk * 16 * kPanelRowBytes, 1024, kKPanelBytes)
                               : desc_mn_major(v_smem + kk * 16 * kPanelRowBytes));
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(o);
#pragma unroll
  for (int i = 0; i < 16; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      o_out[(r + 8 * (e >> 1)) * kVDim + 8 * i + 2 * t + (e & 1)] = o[4 * i + e];
#else
  (void)a, (void)k, (void)v, (void)s_out, (void)o_out, (void)swap_v_strides;
#endif
}

}  // namespace

namespace {

// Whether the wgmma kernel runs on `device` (sm90a_kernel_runs_on, asked once per device).
bool sm90_kernel_runs_on(int device) {
  static std::atomic<int> answers[kMaxSm90Devices] = {};
  return sm90a_kernel_runs_on(
      device, reinterpret_cast<const void*>(prefill_attention_sm90_kernel<bf16, 2>), answers);
}

// The TMA view of one operand: [rows][heads][width] with the operand's strides, a box of one
// panel's 64 columns x 128 rows, 128-byte swizzle. A shared operand (head_stride 0) gets a
// heads extent of 1 (the kernel asks for head 0). The row extent is 2^31: the kernel loads
// only boxes that lie inside a sequence (see produce_tma), so it never bounds a load; cu_k's
// total is on the device and stays there.
void encode_operand_map(CUtensorMap* map, const Operand& o, int width, int heads, DType act,
                        const char* name) {
  const bool shared = o.head_stride == 0;
  const cuuint64_t dims[3] = {cuuint64_t(width), cuuint64_t(shared ? 1 : heads),
                              cuuint64_t(1) << 31};
  // Byte strides of dims 1 and 2 (multiples of 16: prefill_attention's validation asks for
  // 16-byte rows and heads). A heads extent of 1 takes the row stride as its (unused) stride.
  const cuuint64_t strides[2] = {cuuint64_t(shared ? o.row_stride : o.head_stride) * 2,
                                 cuuint64_t(o.row_stride) * 2};
  const cuuint32_t box[3] = {64, 1, kBlockN};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  KMLA_CHECK(encode != nullptr, "prefill_attention_sm90: the driver has no cuTensorMapEncodeTiled");
  const CUresult r = encode(
      map, act == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      3, const_cast<void*>(o.ptr), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  KMLA_CHECK(r == CUDA_SUCCESS, "prefill_attention_sm90: cuTensorMapEncodeTiled failed for ", name,
             " (CUresult ", int(r), ", row_stride ", o.row_stride, ", head_stride ", o.head_stride,
             ")");
}

// Whether the TMA producer can describe the operands: positive row strides, head strides
// positive (k_rope: or 0, shared by all heads, which its map handles), all below the encoder's
// 2^40-byte limit. The validation allows more (any multiple of 8 elements, negative too); such
// layouts run the cp.async producer instead of failing.
bool tma_supports(const PrefillParams& p) {
  constexpr int64_t kMaxStride = (int64_t(1) << 40) / 2;  // elements of 2 bytes
  auto ok = [&](const Operand& o, bool may_share) {
    return o.row_stride > 0 && o.row_stride < kMaxStride &&
           (o.head_stride > 0 || (may_share && o.head_stride == 0)) && o.head_stride < kMaxStride;
  };
  return ok(p.q, false) && ok(p.k_nope, false) && ok(p.k_rope, true) && ok(p.v, false);
}

}  // namespace

bool prefill_sm90_supported(const PrefillParams& p) {
  // The operands' alignment needs are those of the mma.sync kernel (16-byte rows, checked by
  // prefill_attention's validation); what remains is the GPU and the binary.
  (void)p;
  int device = 0;
  KMLA_CUDA_CHECK(cudaGetDevice(&device));
  return sm90_kernel_runs_on(device);
}

int64_t prefill_sm90_compact_items(const PrefillParams& p) {
  // Query blocks per head: sum_s ceil(n_s / 128) <= num_seqs * ceil(max_q_len / 128), and,
  // summing ceil(n / 128) = floor((n + 127) / 128) over the sequences, <= floor((total_q +
  // 127 num_seqs) / 128). The first bound is the 3-D grid's size, so the compact grid is
  // never larger; with total_q the excess is under one block per sequence and head.
  int64_t blocks = int64_t(p.num_seqs) * ceil_div(p.max_q_len, kBlockM);
  if (p.total_q > 0)
    blocks = std::min(blocks, (p.total_q + int64_t(kBlockM - 1) * p.num_seqs) / kBlockM);
  const int64_t items = blocks * p.heads;
  KMLA_CHECK(items < (int64_t(1) << 31), "prefill_attention: the compact grid needs ", items,
             " CTAs (total_q ", p.total_q, ", max_q_len ", p.max_q_len, ", heads ", p.heads,
             "), more than 2^31 - 1");
  return items;
}

int64_t prefill_sm90_ctas(const PrefillParams& p, int64_t items, int ctas) {
  KMLA_CHECK(ctas >= -1, "prefill_attention: ctas must be -1, 0 or positive, got ", ctas);
  if (ctas < 0 || p.work_counter == nullptr) return items;
  if (ctas == 0) {
    int device = 0;
    KMLA_CUDA_CHECK(cudaGetDevice(&device));
    KMLA_CUDA_CHECK(cudaDeviceGetAttribute(&ctas, cudaDevAttrMultiProcessorCount, device));
  }
  return std::min<int64_t>(items, ctas);
}

void prefill_attention_sm90_launch(const PrefillParams& p, const Sm90Options& opt,
                                   cudaStream_t stream) {
  KMLA_CHECK(opt.head_group >= 0 && opt.head_group <= 128,
             "prefill_attention_sm90: head_group must be in [0, 128], got ", opt.head_group);
  const int head_group = std::min(opt.head_group, p.heads);  // lin below stays far from 2^31
  const float scale_log2 = p.softmax_scale * 1.4426950408889634f;
  static_assert(kBlockM == kBlockN, "one box shape serves Q and the K/V tiles");
  const bool tma = opt.tma && tma_supports(p);
  // One sequence without a work counter keeps the 3-D grid: the same CTAs in the same order,
  // without the compact grid's search in front of every CTA. With a counter it takes the
  // persistent CTAs too (its items in the 3-D grid's order): measured on H200 (2026-12-04)
  // 8k x 16 heads 513-514 against 546-558 us, 8k x 64 2014-2064 against 2120-2170.
  const bool compact = opt.compact && (p.num_seqs > 1 || p.work_counter != nullptr);
  // Compact grid: with a work counter one CTA per SM (the kernel's shared memory allows one)
  // taking items from it, or opt.ctas of them; without one (or opt.ctas < 0) one per item.
  int64_t compact_items = 0, compact_ctas = 0;
  if (compact) {
    compact_items = prefill_sm90_compact_items(p);
    compact_ctas = prefill_sm90_ctas(p, compact_items, opt.ctas);
    if (compact_ctas == 0) return;  // no query block in the batch
  }
  Sm90Maps maps;
  std::memset(&maps, 0, sizeof(maps));
  if (tma) {
    // Host work only (no device call): graph capture records the maps with the launch.
    encode_operand_map(&maps.q, p.q, kQkDim, p.heads, p.act, "q");
    encode_operand_map(&maps.nope, p.k_nope, kNopeDim, p.heads, p.act, "k_nope");
    encode_operand_map(&maps.rope, p.k_rope, kRopeDim, p.heads, p.act, "k_rope");
    encode_operand_map(&maps.v, p.v, kVDim, p.heads, p.act, "v");
  }
  dispatch_act(p.act, [&]<class T>() {
    auto* kernel = !opt.overlap        ? prefill_attention_sm90_kernel<T, 0>
                   : opt.early_rescale ? prefill_attention_sm90_kernel<T, 2>
                                       : prefill_attention_sm90_kernel<T, 1>;
    KMLA_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemAlloc));
    const dim3 grid = compact ? dim3(unsigned(compact_ctas))
                              : dim3(unsigned(ceil_div(p.max_q_len, kBlockM)), unsigned(p.heads),
                                     unsigned(p.num_seqs));
    kernel<<<grid, kThreads, kSmemAlloc, stream>>>(p, maps, scale_log2, head_group, opt.pingpong,
                                                   tma, compact, int(compact_items));
    KMLA_LAUNCH_CHECK();
  });
}

void prefill_sm90_probe(DType act, const void* a, const void* k, const void* v, float* s_out,
                        float* o_out, cudaStream_t stream, bool swap_v_strides) {
  KMLA_CHECK(act == DType::bf16 || act == DType::f16,
             "prefill_sm90_probe: act must be bf16 or f16, got ", dtype_name(act));
  constexpr int kProbeSmem = 3 * 64 * kPanelRowBytes + kKBytes + kVBytes + 1024;
  dispatch_act(act, [&]<class T>() {
    auto* kernel = prefill_sm90_probe_kernel<T>;
    KMLA_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kProbeSmem));
    kernel<<<1, 128, kProbeSmem, stream>>>(static_cast<const T*>(a), static_cast<const T*>(k),
                                           static_cast<const T*>(v), s_out, o_out, swap_v_strides);
    KMLA_LAUNCH_CHECK();
  });
}

}  // namespace kmla::cuda
