// fp8 (e4m3) variable-length prefill attention for Hopper (sm_90a): PrefillParams with fp8 set.
// Same contract as the 16-bit kernels (cuda/attention.cuh): causal bottom-right or not, LSE in
// natural log, out rounded once to the activation dtype. Design, budgets and the reasons for
// each choice: docs/prefill_sm90.md, section "fp8 prefill".
//
// Numerics. Inputs are codes with one fp32 scale per tensor (x = code * scale, read on the
// device). S = Q8 K8^T in fp32 on the tensor cores; the scales of q and k fold into the
// softmax's base-2 scale. P is stored for P.V as e4m3 codes of 256 p (p <= 1 after the running
// max is subtracted, so 256 p <= 256 < 448, and p down to 2^-14 stays a normal e4m3 number);
// the row sum l adds the unrounded 256 p, so O / l carries no factor 256 and only v's scale is
// left for the epilogue. With the lazy rescale (the default) the running max may lag a row's
// true max by up to a factor 2 (kLazyMargin), so p <= 2 and the codes are 128 p instead:
// still <= 256, and normal down to p = 2^-13.
//
// Only the sm_90a compile holds the kernel; other targets compile an empty body.
#include <cuda.h>  // CUtensorMap, encoded through the runtime's driver entry point
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cuda/attention.cuh"
#include "cuda/prefill_attention.cuh"
#include "cuda/prefill_fp8_sm90.cuh"
#include "cuda/prefill_sm90_common.cuh"
#include "cuda/sm90.cuh"

namespace kmla::cuda {
namespace {

constexpr int kNope = 128, kRope = 64, kVDim = 128;  // MLA's head dims, fixed
// Query rows per item: two consumer warpgroups of 64.
constexpr int kBlockM = prefill_common::kRows;
constexpr int kThreads = 384;  // warpgroup 0 producer, 1 and 2 consumers

// Keys per tile: 160, FA3's choice for e4m3 at these head dims. A consumer thread's
// per-tile work that does not scale with the keys (the max shuffles, the rescale decision,
// the barriers, the MMA issue) is spread over 80 scores instead of 64. Measured against 128
// (H100, 2026-12-06, 12 runs each, alternated over three calls): 8k x 16 heads causal 376-390
// us against 385-397 (medians 385.9 / 396.0, -2.6 %); 8k x 64 within its noise (medians 1506 /
// 1501, each 1450-1571). 2 stages only: a third does not fit, and lost with 128-key tiles.
// 192 keys spill even with the consumers at 232 registers (docs/prefill_sm90.md, round 5).
constexpr int kBlockN = 160;
constexpr int kStages = 2;  // depth of the K ring, the raw V ring and the V^T ring alike
// Per consumer thread: S registers (m64n160 fp32), and the 32-key k-steps of P.V.
[[maybe_unused]] constexpr int kAcc = kBlockN / 2;
[[maybe_unused]] constexpr int kSteps = kBlockN / 32;
[[maybe_unused]] constexpr int kBlocks = kBlockN / 8;  // 8-key column blocks of S

// Shared memory, all from a 1024-byte-aligned base. An e4m3 element is one byte, so a
// 128-dim row is exactly one 128-byte swizzle row ("SW128": 16-byte chunk c of row r at
// r * 128 + 16 (c ^ (r & 7)), repeating every 1024 bytes) and the 64-dim rope part is one
// 64-byte swizzle row ("SW64": chunk c of row r at r * 64 + 16 (c ^ ((r >> 1) & 3)),
// repeating every 512 bytes). Both are the layouts TMA writes with the matching swizzle mode
// and that wgmma reads through a K-major descriptor of that mode.
//   Q        nope SW128 [128 rows][128 B] 16384, rope SW64 [128][64 B] 8192       24576
//   stage s  K nope SW128 [160][128 B] 20480 | K rope SW64 [160][64 B] 10240 |
//            V raw SW128 [160 keys][128 dims] 20480 | V^T two SW128 panels [128 dims][128
//            key slots] 32768 (keys 128-159 in the second, the first 32 bytes of its rows:
//            12 KiB unused, so that every k-step has the one descriptor form)       83968
//   total    24576 + 2 x 83968 = 192512 (188 KiB), + 1024 alignment slack
// The 13 mbarriers are static shared memory (104 bytes).
constexpr int kQNopeBytes = kBlockM * 128;  // 16384
constexpr int kQRopeBytes = kBlockM * 64;   // 8192
constexpr int kQBytes = kQNopeBytes + kQRopeBytes;
constexpr int kVtPanelBytes = kVDim * 128;  // one SW128 panel of V^T: 128 dims x 128 key slots
[[maybe_unused]] constexpr int kKNopeOff = 0;
constexpr int kKRopeOff = kBlockN * 128;                   // 20480
constexpr int kVRawOff = kKRopeOff + kBlockN * 64;         // 30720
constexpr int kVtOff = kVRawOff + kBlockN * 128;           // 51200
constexpr int kVtPanels = (kBlockN + 127) / 128;           // 2: keys 128-159 in the second
constexpr int kStageBytes = kVtOff + kVtPanels * kVtPanelBytes;  // 83968
// Byte offset in V^T of the 32-key k-step kk of P.V: 32 bytes a step inside a panel, keys
// 128 and up in the next panel (the kernel's descriptors and the probe's alike).
[[maybe_unused]] constexpr int vt_step_bytes(int kk) {
  return (kk >> 2) * kVtPanelBytes + 32 * (kk & 3);
}
[[maybe_unused]] constexpr int kKBytes = kVRawOff;         // K nope + rope: 30720
[[maybe_unused]] constexpr int kVBytes = kBlockN * kVDim;  // 20480
constexpr int kSmemBytes = kQBytes + kStages * kStageBytes + 1024;
static_assert(kKRopeOff % 1024 == 0 && kVRawOff % 1024 == 0 && kVtOff % 1024 == 0 &&
              kStageBytes % 1024 == 0 && kQBytes % 1024 == 0);
static_assert(kSmemBytes <= 227 * 1024, "the rings fit the sm_90 per-block opt-in");

// Registers (65536 per SM, one CTA): 168 per thread at launch (__launch_bounds__(384, 1)), then
// the producer drops to 72 and the consumers rise to 216: 128 x 72 + 256 x 216 = 64512, the
// registers the launch allocated. A consumer holds O (64 fp32), S (80 fp32), P (20 registers of
// 4 e4m3 codes) and the softmax state (ptxas: 0 spills).
// The producer's ldmatrix transposers keep 8 x4 loads (32 registers) in flight.
constexpr int kProducerRegs = 72;
constexpr int kConsumerRegs = 216;
// Lazy rescale (Fp8PrefillOptions::lazy_rescale): how far, in base 2, a row's max may rise
// before O and l are rescaled to it.
[[maybe_unused]] constexpr float kLazyMargin = 1.f;
static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 65536 - 1024);

// TMA views of the inputs, each 3-D [rows][heads][width] (innermost first: width, heads,
// rows) with a box of width x 1 x 128 rows. q is viewed twice (dims 0-127 in SW128, 128-191
// in SW64). A __grid_constant__ kernel parameter: 5 x 128 bytes.
struct Fp8Maps {
  CUtensorMap q_nope, q_rope, k_nope, k_rope, v;
};

#if KMLA_SM90A

using prefill_common::draw_ticket;
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
using sm90::fence_proxy_async;
using sm90::fence_regs;
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

// K-major operand descriptors (sm90::make_desc's fields; in loops as halves, see sm90::desc_lo).
// SW128: rows of 128 bytes, 8-row groups 1024 bytes apart (swizzle mode 1). SW64: rows of 64
// bytes, 8-row groups 512 bytes apart (mode 2). The leading offset is 16 bytes in both. A
// k-step of 32 e4m3 elements is 32 bytes along the row in either: 2 in the low half.
constexpr uint32_t kDescHi128 = sm90::desc_hi(1024, 1);
constexpr uint32_t kDescHi64 = sm90::desc_hi(512, 2);
__device__ __forceinline__ uint32_t desc_lo(uint32_t addr) { return sm90::desc_lo(addr, 16); }
__device__ __forceinline__ uint64_t desc(uint32_t lo, uint32_t hi) {
  return sm90::make_desc_halves(lo, hi);
}
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr) {
  return desc(desc_lo(addr), kDescHi128);
}
__device__ __forceinline__ uint64_t desc_sw64(uint32_t addr) {
  return desc(desc_lo(addr), kDescHi64);
}

#define KMLA_FP8_D64                                                                       \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
  "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "  \
  "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "  \
  "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define KMLA_FP8_D80                                                              \
  KMLA_FP8_D64                                                                    \
  ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, " \
  "%79"
#define KMLA_FP8_ACC8(i)                                                                     \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define KMLA_FP8_ACC64                                                                          \
  KMLA_FP8_ACC8(0), KMLA_FP8_ACC8(8), KMLA_FP8_ACC8(16), KMLA_FP8_ACC8(24), KMLA_FP8_ACC8(32), \
      KMLA_FP8_ACC8(40), KMLA_FP8_ACC8(48), KMLA_FP8_ACC8(56)

// d (64 x 160 fp32) = (accumulate ? d : 0) + A (64 x 32 e4m3, smem) B^T (B: 160 x 32 e4m3,
// smem), both K-major (8-bit wgmma has no transpose).
__device__ __forceinline__ void wgmma_e4m3_ss(float (&d)[80], uint64_t desc_a, uint64_t desc_b,
                                              bool accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %82, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n160k32.f32.e4m3.e4m3 " KMLA_FP8_D80
      "}, %80, %81, p, 1, 1;\n}\n"
      : KMLA_FP8_ACC64, KMLA_FP8_ACC8(64), KMLA_FP8_ACC8(72)
      : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)));
}
// d (64 x 128 fp32) += A (64 x 32 e4m3 in registers: per warp the m16n8k32 8-bit A fragment,
// a[0] = row g, k 4t..4t+3; a[1] = row g+8, same k; a[2], a[3] = the same rows, k + 16) B^T
// (B: 128 x 32 e4m3, smem, K-major).
__device__ __forceinline__ void wgmma_e4m3_rs(float (&d)[64], const uint32_t (&a)[4],
                                              uint64_t desc_b) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " KMLA_FP8_D64
      "}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : KMLA_FP8_ACC64
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}
#undef KMLA_FP8_ACC64
#undef KMLA_FP8_ACC8
#undef KMLA_FP8_D80
#undef KMLA_FP8_D64

// Four fp32 values as e4m3 codes (round to nearest even, saturating), b0 in the low byte.
__device__ __forceinline__ uint32_t e4m3x4(float b0, float b1, float b2, float b3) {
  uint32_t r;
  asm("{\n .reg .b16 lo, hi;\n"
      " cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
      " cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      " mov.b32 %0, {lo, hi};\n}\n"
      : "=r"(r)
      : "f"(b0), "f"(b1), "f"(b2), "f"(b3));
  return r;
}

// P (fp32 accumulator layout) as the A fragments of the 32-key k-steps of P.V: column
// blocks 4kk .. 4kk + 3 packed in register order, which is the relabelled key order
// transpose_v writes V^T in.
__device__ __forceinline__ void pack_p_e4m3(const float (&sc)[kAcc], uint32_t (&pa)[kSteps][4]) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    const float* s = sc + 16 * kk;
    pa[kk][0] = e4m3x4(s[0], s[1], s[4], s[5]);
    pa[kk][1] = e4m3x4(s[2], s[3], s[6], s[7]);
    pa[kk][2] = e4m3x4(s[8], s[9], s[12], s[13]);
    pa[kk][3] = e4m3x4(s[10], s[11], s[14], s[15]);
  }
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

// The partial-tile path: one warp copies kRowsT rows (a Q block or a key tile) of 128 (SW128)
// or 64 (SW64) bytes with cp.async; rows >= valid are zero-filled without being read
// (src-size 0), so neither the next sequence's rows nor NaN padding reach an MMA. Rolled
// loops: 56 registers, rare path.
template <int kRowsT>
__device__ __forceinline__ void warp_copy_sw128(uint32_t panel, const uint8_t* src,
                                                int64_t row_stride, int valid, int lane) {
#pragma unroll 1
  for (int x = lane; x < kRowsT * 8; x += 32) {
    const int r = x >> 3, c = x & 7;
    const bool ok = r < valid;  // a missing row reads nothing, from a valid address
    cp_async16(panel + r * 128 + ((c ^ (r & 7)) << 4), ok ? src + r * row_stride + 16 * c : src,
               ok);
  }
}
template <int kRowsT>
__device__ __forceinline__ void warp_copy_sw64(uint32_t panel, const uint8_t* src,
                                               int64_t row_stride, int valid, int lane) {
#pragma unroll 1
  for (int x = lane; x < kRowsT * 4; x += 32) {
    const int r = x >> 2, c = x & 3;
    const bool ok = r < valid;
    cp_async16(panel + r * 64 + ((c ^ ((r >> 1) & 3)) << 4), ok ? src + r * row_stride + 16 * c : src,
               ok);
  }
}

// V tile [160 keys][128 dims] (SW128, as loaded) -> V^T [128 dims][160 key slots] (two SW128
// panels of 128 slots), by one of the two transposer warps (tw = 0, 1). The key slots are
// relabelled so that P's accumulator registers are the A fragment as they stand: within each 32-key
// k-step, slot 4t + b of the first 16 holds key 8 (b >> 1) + 2t + (b & 1), and likewise + 16 for
// the second 16 (docs/prefill_sm90.md). So the 4 slots of one 32-bit V^T word w (t = w & 3) are
// keys base + {2t, 2t + 1, 2t + 8, 2t + 9} with base = 16 (w >> 2). With ldmatrix.trans / stmatrix
// one x4 instruction moves 512 bytes (a 32-bit access 128), and the 20 loads of a thread go out in
// batches of 8, 8 and 4. (The first version, 32-bit loads, byte permutes and 32-bit stores in 16
// dependent rounds per tile, was the kernel's wall: 1.01x the bf16 time against 0.79x with this
// one, H200 8k x 64 heads.) Warp tw takes dims 64 tw .. 64 tw + 63 (chunks 4 tw .. 4 tw + 3) for
// all 160 keys: 20 instructions of each kind per thread and tile, 80 byte permutes.
//   Load n (word group wq = n >> 1, chunks c0 = 4 tw + 2 (n & 1), c0 + 1): four 8x8 b16
//   matrices, keys 16 wq + {0..7, 8..15} of chunk c0, then the same of chunk c0 + 1 (lane l
//   gives row l & 7 of matrix l >> 3). With .trans, lane (p = l >> 2, t = l & 3) receives of
//   each matrix keys 2t (low half) and 2t + 1 (high half) at dims 2p, 2p + 1 of the chunk,
//   byte order [k 2t d 2p, k 2t d 2p+1, k 2t+1 d 2p, k 2t+1 d 2p+1]. Two of them (keys + 0 and
//   + 8) hold exactly the V^T words of slot word t (keys {2t, 2t+1, 2t+8, 2t+9}) at dims 2p
//   (bytes 0, 2, 4, 6: prmt 0x6420) and 2p + 1 (bytes 1, 3, 5, 7: 0x7531).
//   Store n: four 8x8 matrices of V^T rows (16 bytes = word group wq), lanes 4q .. 4q + 3
//   giving row q's words t = 0..3. Row q of matrix "X" of a chunk is dim 2q for q < 4 and
//   2q + 1 for q >= 4, of "Y" the other one, so lane p supplies X the even word when p < 4
//   (a per-lane prmt selector). Then the 8 rows of one matrix have 8 different dim & 7, i.e.
//   8 different swizzled chunk positions: both the ldmatrix phases (8 consecutive keys, one
//   chunk) and the stmatrix phases are free of bank conflicts.
__device__ __forceinline__ void ldsm4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void stsm4(uint32_t addr, uint32_t a, uint32_t b, uint32_t c,
                                      uint32_t d) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
               "r"(a), "r"(b), "r"(c), "r"(d)
               : "memory");
}
constexpr int kLdsmBatch = 8;
__device__ __forceinline__ void transpose_v(uint32_t vraw, uint32_t vt, int tw, int lane) {
  constexpr int kWordGroups = kBlockN / 16;  // 16 keys each; 8 and 9 in V^T's second panel
  const int q = lane & 7, m = lane >> 3, p = lane >> 2;
  // This lane's load row: key 16 wq + 8 (m & 1) + q of chunk c0 + (m >> 1); key & 7 = q.
  uint32_t ld[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int chunk = 4 * tw + 2 * h + (m >> 1);
    ld[h] = vraw + (8 * (m & 1) + q) * 128 + ((chunk ^ q) << 4);
  }
  // This lane's store row: dim 16 chunk + 2q + odd, odd = (q >= 4) ^ (m & 1) (X: m even).
  const int odd = int(q >= 4) ^ (m & 1), e = (2 * q + odd) & 7;
  uint32_t st[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int chunk = 4 * tw + 2 * h + (m >> 1);
    st[h] = vt + (16 * chunk + 2 * q + odd) * 128;
  }
  const uint32_t sel_x = p < 4 ? 0x6420u : 0x7531u, sel_y = sel_x ^ 0x1111u;
#pragma unroll
  for (int wq0 = 0; wq0 < kWordGroups; wq0 += kLdsmBatch / 2) {
    uint32_t r[kLdsmBatch][4];  // loads of (wq0, h = 0), (wq0, 1), (wq0 + 1, 0), ...
#pragma unroll
    for (int n = 0; n < kLdsmBatch; ++n)
      if (wq0 + (n >> 1) < kWordGroups) ldsm4_trans(ld[n & 1] + (wq0 + (n >> 1)) * 2048, r[n]);
#pragma unroll
    for (int n = 0; n < kLdsmBatch; ++n) {
      const int wq = wq0 + (n >> 1);
      if (wq >= kWordGroups) continue;
      const uint32_t col = uint32_t((wq >> 3) * kVtPanelBytes + (((wq & 7) ^ e) << 4));
      stsm4(st[n & 1] + col, __byte_perm(r[n][0], r[n][1], sel_x),
            __byte_perm(r[n][0], r[n][1], sel_y), __byte_perm(r[n][2], r[n][3], sel_x),
            __byte_perm(r[n][2], r[n][3], sel_y));
    }
  }
}

#endif  // KMLA_SM90A

// ---- the kernel -----------------------------------------------------------------------
// A 1-D grid over the item list of prefill_sm90_common.cuh (one item: a 128-row query block of one
// head of one sequence; sequences in order, heads in groups of head_group, inside a group
// the longest blocks first, so the CTAs in flight share the K/V of ~head_group heads in L2).
// Without PrefillParams::work_counter one CTA per item; with it persistent CTAs (one per SM by
// default) that take item blockIdx.x, then one item per ticket drawn from the counter once
// the current item's loads are issued. The next item's Q and first tiles then load while the
// consumers finish the current one: q_empty (every consumer thread, after its warpgroup's
// last S) frees Q and the item slot, and each ring's stages and phases run on across items
// (a tile's ring position is its index among all the tiles the CTA has loaded).
//
// Warpgroup 0, the producer (72 registers), one job per warp:
//   warp 0: each item's Q (TMA, 2 boxes) and K tiles (TMA nope + rope) into the K ring; it
//           publishes the item (item_smem, with q_full) and draws the tickets;
//   warp 1: V tiles as stored (TMA, 1 box) into the raw V ring;
//   warps 2-3: transpose each raw V tile into the V^T ring (transpose_v, ldmatrix/stmatrix).
//   A box that would run past its sequence (the last Q block or key tile) is copied by the
//   warp's 32 lanes with cp.async instead, zero-filling the missing rows. Each warp finds the
//   item itself (list_item); the ticket reaches warps 1-3 through next_idx and named barrier 3.
// Warpgroups 1 and 2, the consumers (216 registers): query rows 64 (w - 1) .. of the block.
//   Per tile of 160 keys: S = Q K^T (6 wgmma m64n160k32: 4 over the nope panel, 2 over rope),
//   mask on the tiles that cross the diagonal or the sequence end, online softmax in base 2
//   (lazy: the max moves only past a factor 2), P packed to e4m3 in registers, O += P V (5
//   wgmma m64n128k32 with P from registers, V^T from smem). S of tile j is issued first, then O's
//   rescale, then (once V^T of j - 1 is in) P.V of tile j - 1, under which the softmax of tile j
//   runs. With pingpong the two consumers also take turns issuing (named barriers 1, 2), so one's
//   softmax overlaps the other's GEMMs.
//
// mbarriers (phase parity of use u of a ring slot: u & 1; of q_full / q_empty: the round):
//   q_full (1 arrival + bytes) / q_empty (256 consumer threads);
//   k_full[s] (1 + bytes) / k_empty[s] (8 consumer warps);
//   vr_full[s] (1 + bytes) / vr_empty[s] (64 transposer threads);
//   vt_full[s] (64 transposer threads) / vt_empty[s] (8 consumer warps).
// The raw V slots are the only smem that threads read through the generic proxy after
// another warp wrote it, so their hand-offs name every thread (each transposer thread
// arrives itself; warp 1's cp.async copies end at named barrier 4): compute-sanitizer's
// racecheck does not follow a __syncwarp into one lane's mbarrier arrival.
//
template <class T>
__global__ void __launch_bounds__(kThreads, 1)
    prefill_fp8_sm90_kernel(const PrefillParams p, const __grid_constant__ Fp8Maps maps,
                            int head_group, int items, bool pingpong, bool lazy) {
#if KMLA_SM90A
  __shared__ __align__(8) uint64_t q_full, q_empty, k_full[kStages], k_empty[kStages];
  __shared__ __align__(8) uint64_t vr_full[kStages], vr_empty[kStages];
  __shared__ __align__(8) uint64_t vt_full[kStages], vt_empty[kStages];
  __shared__ Item item_smem;   // the round's item, written by producer lane 0 before q_full
  __shared__ int next_idx[2];  // the next round's item index (tickets), by round parity
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t q_nope_s = base, q_rope_s = base + kQNopeBytes;
  // Ring position of the CTA's tile gj (counted over all its items so far; unsigned, so that
  // the modulo is a mask for 2 stages).
  auto stage = [&](uint32_t gj) { return base + kQBytes + (gj % kStages) * kStageBytes; };
  auto use_parity = [](uint32_t gj) { return (gj / kStages) & 1u; };
  const bool causal = p.causal;

  const int tid = int(threadIdx.x), wg = tid / 128, wtid = tid & 127;
  const int warp = wtid / 32, lane = tid & 31;
  if (tid == 0) {
    mbar_init(&q_full, 1);
    mbar_init(&q_empty, 256);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&k_full[s], 1);
      mbar_init(&k_empty[s], 8);
      mbar_init(&vr_full[s], 1);
      mbar_init(&vr_empty[s], 64);
      mbar_init(&vt_full[s], 64);
      mbar_init(&vt_empty[s], 8);
    }
    sm90::fence_mbarrier_init();
  }
  __syncthreads();

  if (wg == 0) {
    // ---------------- producer ----------------
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    int32_t* const counter = p.work_counter;
    int done = 0;  // tiles of the previous items: where this item's tiles sit in the rings
#pragma unroll 1
    for (int r = 0;; ++r) {
      const int idx = round_index(r, counter, items, next_idx);
      const Item it = idx < items ? list_item(p, idx, head_group) : kNoItem;
      const int num_tiles = it.block < 0 ? 0 : item_tiles<kBlockN>(it, causal);
      const int head = it.head, k_begin = it.k_begin, m = it.m;
      if (warp == 0) {
        // The item and its Q once the consumers are done with the previous Q, then the K ring.
        if (r > 0) mbar_wait(&q_empty, uint32_t((r - 1) & 1));
        if (lane == 0) item_smem = it;  // published by the q_full arrival below
        const int q0 = it.block * kBlockM, q_valid = it.n - q0;
        if (num_tiles == 0) {
          // No more items, or a block whose rows see no key: the item only.
          if (lane == 0) mbar_arrive(&q_full);
          if (it.block < 0) {
            if (counter != nullptr && lane == 0) leave_counter(counter);
            return;
          }
        } else if (q_valid >= kBlockM) {
          if (lane == 0) {
            mbar_arrive_expect_tx(&q_full, kQBytes);
            tma_load_3d(q_nope_s, &maps.q_nope, 0, head, it.q_begin + q0, &q_full);
            tma_load_3d(q_rope_s, &maps.q_rope, 0, head, it.q_begin + q0, &q_full);
          }
        } else {
          const uint8_t* src = static_cast<const uint8_t*>(p.q.ptr) +
                               int64_t(it.q_begin + q0) * p.q.row_stride +
                               int64_t(head) * p.q.head_stride;
          warp_copy_sw128<kBlockM>(q_nope_s, src, p.q.row_stride, q_valid, lane);
          warp_copy_sw64<kBlockM>(q_rope_s, src + kNope, p.q.row_stride, q_valid, lane);
          cp_async_commit_wait_all();
          fence_proxy_async();
          __syncwarp();
          if (lane == 0) mbar_arrive(&q_full);
        }
        const int rope_head = p.k_rope.head_stride == 0 ? 0 : head;
#pragma unroll 1
        for (int j = 0; j < num_tiles; ++j) {
          const int gj = done + j, s = gj % kStages, key0 = j * kBlockN, rows = m - key0;
          const uint32_t st = stage(gj);
          if (gj >= kStages) mbar_wait(&k_empty[s], use_parity(gj) ^ 1u);
          if (rows >= kBlockN) {
            if (lane == 0) {
              mbar_arrive_expect_tx(&k_full[s], kKBytes);
              tma_load_3d(st + kKNopeOff, &maps.k_nope, 0, head, k_begin + key0, &k_full[s]);
              tma_load_3d(st + kKRopeOff, &maps.k_rope, 0, rope_head, k_begin + key0, &k_full[s]);
            }
          } else {
            const uint8_t* nope = static_cast<const uint8_t*>(p.k_nope.ptr) +
                                  int64_t(k_begin + key0) * p.k_nope.row_stride +
                                  int64_t(head) * p.k_nope.head_stride;
            const uint8_t* rope = static_cast<const uint8_t*>(p.k_rope.ptr) +
                                  int64_t(k_begin + key0) * p.k_rope.row_stride +
                                  int64_t(head) * p.k_rope.head_stride;
            warp_copy_sw128<kBlockN>(st + kKNopeOff, nope, p.k_nope.row_stride, rows, lane);
            warp_copy_sw64<kBlockN>(st + kKRopeOff, rope, p.k_rope.row_stride, rows, lane);
            cp_async_commit_wait_all();
            fence_proxy_async();
            __syncwarp();
            if (lane == 0) mbar_arrive(&k_full[s]);
          }
        }
        // The next item's ticket once this item's loads are issued (as in the 16-bit kernel:
        // about when the SM frees up, which keeps the heavy-first list balanced).
        if (counter != nullptr && lane == 0) next_idx[(r + 1) & 1] = draw_ticket(counter);
      } else if (it.block < 0) {
        return;
      } else if (warp == 1) {
        // The raw V ring.
#pragma unroll 1
        for (int j = 0; j < num_tiles; ++j) {
          const int gj = done + j, s = gj % kStages, key0 = j * kBlockN, rows = m - key0;
          const uint32_t dst = stage(gj) + kVRawOff;
          if (gj >= kStages) mbar_wait(&vr_empty[s], use_parity(gj) ^ 1u);
          if (rows >= kBlockN) {
            if (lane == 0) {
              mbar_arrive_expect_tx(&vr_full[s], kVBytes);
              tma_load_3d(dst, &maps.v, 0, head, k_begin + key0, &vr_full[s]);
            }
          } else {
            const uint8_t* src = static_cast<const uint8_t*>(p.v.ptr) +
                                 int64_t(k_begin + key0) * p.v.row_stride +
                                 int64_t(head) * p.v.head_stride;
            warp_copy_sw128<kBlockN>(dst, src, p.v.row_stride, rows, lane);
            cp_async_commit_wait_all();
            // Read back by the transposers through the generic proxy: the mbarrier's
            // release / acquire orders it, no proxy fence needed.
            named_bar_sync<4, 32>();
            if (lane == 0) mbar_arrive(&vr_full[s]);
          }
        }
      } else {
        // Transposers: raw V of tile gj -> V^T, once the consumers are done with V^T of gj - 2.
        const int tw = warp - 2;
#pragma unroll 1
        for (int j = 0; j < num_tiles; ++j) {
          const int gj = done + j, s = gj % kStages;
          const uint32_t st = stage(gj);
          mbar_wait(&vr_full[s], use_parity(gj));
          if (gj >= kStages) mbar_wait(&vt_empty[s], use_parity(gj) ^ 1u);
          transpose_v(st + kVRawOff, st + kVtOff, tw, lane);
          // Every load has returned (the stores used them): the raw slot may be refilled. And
          // the stores go to the async proxy (wgmma) through this thread's fence.
          fence_proxy_async();
          mbar_arrive(&vr_empty[s]);
          mbar_arrive(&vt_full[s]);
        }
      }
      done += num_tiles;
    }
  }

  // ---------------- consumers ----------------
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
  const int cw = wg - 1;
  const int g = lane >> 2, t = lane & 3;
  const float scale_log2 = p.softmax_scale * __ldg(p.q_scale) * __ldg(p.k_scale) * 1.4426950408889634f;
  // P's e4m3 codes are 2^p_exp p: 256 p (p <= 1) with the exact max, 128 p (p <= 2, the
  // margin) with the lazy one; either way at most 256 < 448, the largest e4m3 value.
  const float p_exp = lazy ? 8.f - kLazyMargin : 8.f;
  auto release = [&](uint32_t bar) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
  };
  // Shared addresses and descriptor halves the tile loop needs, computed once (sm90::desc_lo).
  const uint32_t k_full_a = smem_u32(k_full), k_empty_a = smem_u32(k_empty);
  const uint32_t vt_full_a = smem_u32(vt_full), vt_empty_a = smem_u32(vt_empty);
  const uint32_t q_empty_a = smem_u32(&q_empty);
  const uint32_t q_nope_lo = desc_lo(q_nope_s + cw * 64 * 128);
  const uint32_t q_rope_lo = desc_lo(q_rope_s + cw * 64 * 64);
  const uint32_t ring_lo = desc_lo(base + kQBytes);  // stage s: + s * kStageBytes / 16
  int done = 0;  // tiles of the previous items (the producer's count)
#pragma unroll 1
  for (int r = 0;; ++r) {
    mbar_wait(&q_full, uint32_t(r & 1));  // the round's item (and its Q when it has keys)
    const Item it = item_smem;
    if (it.block < 0) return;  // no more items
    const int head = it.head, q_begin = it.q_begin, n = it.n, m = it.m;
    const int q0 = it.block * kBlockM;
    const int num_tiles = item_tiles<kBlockN>(it, causal);
    const int my_tiles = warpgroup_tiles<kBlockN>(it, cw, causal);
    const int wg_first = q0 + 64 * cw;
    const int min_visible = key_limit(wg_first, n, m, causal);  // fewest keys any row sees
    const int row0 = wg_first + 16 * warp + g;  // this thread's rows: row0, row0 + 8
    const int limit[2] = {key_limit(row0, n, m, causal), key_limit(row0 + 8, n, m, causal)};
    // Tile j of this item: its ring slot and that slot's phase.
    auto slot = [&](int j) { return uint32_t(done + j) % kStages; };
    auto parity = [&](int j) { return use_parity(uint32_t(done + j)); };

    float o[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
    float sc[kAcc];
    uint32_t pa[kSteps][4];
    float row_max[2] = {-INFINITY, -INFINITY};  // raw score units
    float row_sum[2] = {0.f, 0.f};              // this thread's share of 256 l
    float corr[2] = {1.f, 1.f};

    auto issue_s = [&](int j) {
      const uint32_t st = ring_lo + slot(j) * (kStageBytes >> 4);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_e4m3_ss(sc, desc(q_nope_lo + 2 * kk, kDescHi128),
                      desc(st + (kKNopeOff >> 4) + 2 * kk, kDescHi128), kk > 0);
#pragma unroll
      for (int kk = 0; kk < 2; ++kk)
        wgmma_e4m3_ss(sc, desc(q_rope_lo + 2 * kk, kDescHi64),
                      desc(st + (kKRopeOff >> 4) + 2 * kk, kDescHi64), true);
      wgmma_commit();
    };
    auto issue_pv = [&](int j) {
      const uint32_t vt = ring_lo + slot(j) * (kStageBytes >> 4) + (kVtOff >> 4);
#pragma unroll
      for (int kk = 0; kk < kSteps; ++kk)
        wgmma_e4m3_rs(o, pa[kk], desc(vt + (vt_step_bytes(kk) >> 4), kDescHi128));
      wgmma_commit();
    };
    // Mask + online softmax of tile j on sc; p is kept as 2^p_exp p (the + p_exp in the
    // exponent). Returns whether some row of the warp moved its max (O then needs corr).
    auto softmax = [&](int j) {
      const int key0 = j * kBlockN;
      if (key0 + kBlockN > min_visible) {
#pragma unroll
        for (int i = 0; i < kBlocks; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (key0 + 8 * i + 2 * t + (e & 1) >= limit[e >> 1]) sc[4 * i + e] = -INFINITY;
      }
      // Row maxima as balanced trees (not a chain of 40 dependent fmaxf), both rows
      // before their shuffles so that the two rows' latencies overlap.
      float mx[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float m[kBlocks];
#pragma unroll
        for (int i = 0; i < kBlocks; ++i) m[i] = fmaxf(sc[4 * i + 2 * h], sc[4 * i + 2 * h + 1]);
        mx[h] = fmaxf(row_max[h], tree_max<kBlocks>(m));
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
#pragma unroll
      for (int h = 0; h < 2; ++h) mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      bool moved = false;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // Lazy rescale: keep the old max while the new one is at most kLazyMargin (base 2) above
        // it. (Both -inf: NaN, the test fails and the max stays -inf; only -inf before: +inf.)
        if (lazy && (mx[h] - row_max[h]) * scale_log2 <= kLazyMargin) mx[h] = row_max[h];
        // No visible key yet: max stays -inf and the offset 0 keeps p = 0 rather than NaN.
        const float off = mx[h] == -INFINITY ? 0.f : mx[h] * scale_log2;
        corr[h] = fast_exp2(row_max[h] * scale_log2 - off);
        moved |= mx[h] != row_max[h];
        row_max[h] = mx[h];
        const float off8 = p_exp - off;
        float part[4] = {0.f, 0.f, 0.f, 0.f};  // four chains of adds instead of one
#pragma unroll
        for (int i = 0; i < kBlocks; ++i) {
          sc[4 * i + 2 * h] = fast_exp2(fmaf(sc[4 * i + 2 * h], scale_log2, off8));
          sc[4 * i + 2 * h + 1] = fast_exp2(fmaf(sc[4 * i + 2 * h + 1], scale_log2, off8));
          part[(2 * i) & 3] += sc[4 * i + 2 * h];
          part[(2 * i + 1) & 3] += sc[4 * i + 2 * h + 1];
        }
        row_sum[h] = row_sum[h] * corr[h] + ((part[0] + part[1]) + (part[2] + part[3]));
      }
      return __any_sync(0xffffffffu, moved);
    };
    auto rescale_o = [&] { scale_acc_rows(o, corr); };
    // Ping-pong (prefill_common::Turns): the consumers take turns issuing their MMAs.
    const Turns turns(pingpong, warpgroup_tiles<kBlockN>(it, 0, causal),
                      warpgroup_tiles<kBlockN>(it, 1, causal), cw);
    turns.open();

    // Done with Q (and the item) once the warpgroup's last S has completed: the producer then
    // loads the next item's Q while this one's last P.V and epilogue run.
    if (my_tiles == 0) mbar_arrive(q_empty_a);
    if (my_tiles > 0) {
      mbar_wait(k_full_a + 8 * slot(0), parity(0));
      turns.begin(0);
      wgmma_fence();
      issue_s(0);
      turns.end(0);
      wgmma_wait<0>();
      fence_regs(sc);
      release(k_empty_a + 8 * slot(0));
      if (my_tiles == 1) mbar_arrive(q_empty_a);
      softmax(0);  // O is still zero: no rescale owed
      pack_p_e4m3(sc, pa);
      bool owe = false;  // O still needs corr of the last softmax
      for (int j = 1; j < my_tiles; ++j) {
        const uint32_t s = slot(j), sp = slot(j - 1);
        mbar_wait(k_full_a + 8 * s, parity(j));
        fence_regs(o);
        turns.begin(j);
        wgmma_fence();
        issue_s(j);
        fence_regs(o);  // the multiplies below come after the S issue
        if (owe) rescale_o();
        fence_regs(o);
        // V^T of tile j - 1 only now: S(j) need not wait for the transposers.
        mbar_wait(vt_full_a + 8 * sp, parity(j - 1));
        wgmma_fence();
        issue_pv(j - 1);
        turns.end(j);
        wgmma_wait<1>();  // S(j) done (groups retire in order)
        fence_regs(sc);
        release(k_empty_a + 8 * s);
        if (j == my_tiles - 1) mbar_arrive(q_empty_a);
        owe = softmax(j);
        wgmma_wait<0>();  // P.V(j - 1) done: O and pa free
        fence_regs(o);
        release(vt_empty_a + 8 * sp);
        pack_p_e4m3(sc, pa);
      }
      const int last = my_tiles - 1;
      mbar_wait(vt_full_a + 8 * slot(last), parity(last));
      fence_regs(o);
      turns.begin(my_tiles);
      if (owe) rescale_o();
      fence_regs(o);
      wgmma_fence();
      issue_pv(last);
      turns.end(my_tiles);
      wgmma_wait<0>();
      fence_regs(o);
      release(vt_empty_a + 8 * slot(last));
    }
    pass_tiles<kStages>(my_tiles, num_tiles, done, k_full, k_empty, vt_full, vt_empty);

    // Epilogue: out = O * scale_v / (2^p_exp l), rounded once; lse = ln(l) + scale * max
    // (l without its factor 2^p_exp).
    if (wg_first < n)
      store_rows<T>(p, o, row_sum, row_max, scale_log2, __ldg(p.v_scale), p_exp, row0, n, q_begin,
                    head);
    done += num_tiles;
  }
#else
  (void)p, (void)maps, (void)head_group, (void)items, (void)pingpong, (void)lazy;
#endif
}

// ---- building-block probe ----------------------------------------------------------------
// One CTA of 128 threads, no pipeline: q [64, 192], k [160, 192] and v [160, 128] (dense e4m3
// rows) go through the partial-tile copies into the kernel's smem layouts (warps 0, 1, 2),
// warps 0-1 transpose V as the producer does, then one warpgroup computes s_out = q k^T
// [64, 160] fp32 (both panels' descriptors, the accumulator layout) and o_out = e4m3(s_out) v
// [64, 128] fp32 (the relabelled P fragment against V^T). For the tests' diagnosis of a
// layout mistake apart from the pipeline.
__global__ void __launch_bounds__(128) prefill_fp8_probe_kernel(const uint8_t* q, const uint8_t* k,
                                                                const uint8_t* v, float* s_out,
                                                                float* o_out) {
#if KMLA_SM90A
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t q_nope_s = base, q_rope_s = base + kQNopeBytes, st = base + kQBytes;
  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid & 31;
  if (warp == 0) {
    warp_copy_sw128<kBlockM>(q_nope_s, q, 192, 64, lane);
    warp_copy_sw64<kBlockM>(q_rope_s, q + kNope, 192, 64, lane);
  } else if (warp == 1) {
    warp_copy_sw128<kBlockN>(st + kKNopeOff, k, 192, kBlockN, lane);
    warp_copy_sw64<kBlockN>(st + kKRopeOff, k + kNope, 192, kBlockN, lane);
  } else if (warp == 2) {
    warp_copy_sw128<kBlockN>(st + kVRawOff, v, 128, kBlockN, lane);
  }
  cp_async_commit_wait_all();
  __syncthreads();
  if (warp < 2) {
    transpose_v(st + kVRawOff, st + kVtOff, warp, lane);
  }
  fence_proxy_async();
  __syncthreads();

  float sc[kAcc];
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    wgmma_e4m3_ss(sc, desc_sw128(q_nope_s + 32 * kk), desc_sw128(st + kKNopeOff + 32 * kk), kk > 0);
#pragma unroll
  for (int kk = 0; kk < 2; ++kk)
    wgmma_e4m3_ss(sc, desc_sw64(q_rope_s + 32 * kk), desc_sw64(st + kKRopeOff + 32 * kk), true);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(sc);
  const int g = lane >> 2, t = lane & 3, r = 16 * warp + g;
#pragma unroll
  for (int i = 0; i < kBlocks; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      s_out[(r + 8 * (e >> 1)) * kBlockN + 8 * i + 2 * t + (e & 1)] = sc[4 * i + e];
  uint32_t pa[kSteps][4];
  pack_p_e4m3(sc, pa);
  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  fence_regs(o);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk)
    wgmma_e4m3_rs(o, pa[kk], desc_sw128(st + kVtOff + vt_step_bytes(kk)));
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(o);
#pragma unroll
  for (int i = 0; i < 16; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) o_out[(r + 8 * (e >> 1)) * 128 + 8 * i + 2 * t + (e & 1)] = o[4 * i + e];
#else
  (void)q, (void)k, (void)v, (void)s_out, (void)o_out;
#endif
}

// Whether `device` runs the kernel (sm90a_kernel_runs_on, asked once per device).
bool fp8_kernel_runs_on(int device) {
  static std::atomic<int> answers[kMaxSm90Devices] = {};
  return sm90a_kernel_runs_on(device, reinterpret_cast<const void*>(prefill_fp8_sm90_kernel<bf16>),
                              answers);
}

// [rows][heads][width] bytes of `o` starting `col` bytes into each row, a box of width x 1 x
// box_rows rows with the swizzle that matches width (128: SW128, 64: SW64). Heads extent 1 for
// a shared operand. The rows extent is 2^31: the kernel only asks for boxes inside a sequence.
void encode_map(CUtensorMap* map, const Operand& o, int col, int width, int heads, int box_rows,
                const char* name) {
  const bool shared = o.head_stride == 0;
  const cuuint64_t dims[3] = {cuuint64_t(width), cuuint64_t(shared ? 1 : heads),
                              cuuint64_t(1) << 31};
  const cuuint64_t strides[2] = {cuuint64_t(shared ? o.row_stride : o.head_stride),
                                 cuuint64_t(o.row_stride)};
  const cuuint32_t box[3] = {cuuint32_t(width), 1, cuuint32_t(box_rows)};
  const cuuint32_t unit[3] = {1, 1, 1};
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  KMLA_CHECK(encode != nullptr, "prefill fp8: the driver has no cuTensorMapEncodeTiled");
  const CUresult r = encode(
      map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3,
      const_cast<uint8_t*>(static_cast<const uint8_t*>(o.ptr) + col), dims, strides, box, unit,
      CU_TENSOR_MAP_INTERLEAVE_NONE,
      width == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  KMLA_CHECK(r == CUDA_SUCCESS, "prefill fp8: cuTensorMapEncodeTiled failed for ", name,
             " (CUresult ", int(r), ", row_stride ", o.row_stride, ", head_stride ", o.head_stride,
             ")");
}

}  // namespace

bool prefill_fp8_supported() {
  int device = 0;
  KMLA_CUDA_CHECK(cudaGetDevice(&device));
  return fp8_kernel_runs_on(device);
}

void prefill_attention_fp8_launch(const PrefillParams& p, const Fp8PrefillOptions& opt,
                                  cudaStream_t stream) {
  KMLA_CHECK(opt.head_group >= 0 && opt.head_group <= 128,
             "prefill fp8: head_group must be in [0, 128], got ", opt.head_group);
  Fp8Maps maps;
  std::memset(&maps, 0, sizeof maps);
  encode_map(&maps.q_nope, p.q, 0, kNope, p.heads, kBlockM, "q");
  encode_map(&maps.q_rope, p.q, kNope, kRope, p.heads, kBlockM, "q (rope part)");
  encode_map(&maps.k_nope, p.k_nope, 0, kNope, p.heads, kBlockN, "k_nope");
  encode_map(&maps.k_rope, p.k_rope, 0, kRope, p.heads, kBlockN, "k_rope");
  encode_map(&maps.v, p.v, 0, kVDim, p.heads, kBlockN, "v");
  // The item list (prefill_sm90_common.cuh) on one CTA per item, or with a work counter on
  // persistent CTAs (one per SM unless opt.ctas says otherwise).
  const int64_t items = prefill_sm90_compact_items(p);
  const int64_t ctas = prefill_sm90_ctas(p, items, opt.ctas);
  if (ctas == 0) return;  // no query block in the batch
  const int head_group = std::min(opt.head_group, p.heads);
  dispatch_act(p.act, [&]<class T>() {
    auto* kernel = prefill_fp8_sm90_kernel<T>;
    KMLA_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    kernel<<<dim3(unsigned(ctas)), kThreads, kSmemBytes, stream>>>(p, maps, head_group, int(items),
                                                                   opt.pingpong, opt.lazy_rescale);
    KMLA_LAUNCH_CHECK();
  });
}

void prefill_fp8_probe(const void* q, const void* k, const void* v, float* s_out, float* o_out,
                       cudaStream_t stream) {
  constexpr int kProbeSmem = kQBytes + kStageBytes + 1024;
  KMLA_CUDA_CHECK(cudaFuncSetAttribute(prefill_fp8_probe_kernel,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kProbeSmem));
  prefill_fp8_probe_kernel<<<1, 128, kProbeSmem, stream>>>(
      static_cast<const uint8_t*>(q), static_cast<const uint8_t*>(k),
      static_cast<const uint8_t*>(v), s_out, o_out);
  KMLA_LAUNCH_CHECK();
}

}  // namespace kmla::cuda
