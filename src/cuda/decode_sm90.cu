// Absorbed-MQA decode on Hopper with warpgroup MMA (wgmma), for requests with at least 64
// (token, head) query rows: 64 or 128 heads, or fewer heads times several query tokens. With
// that many rows per key the work is compute bound (a 64-row tile does 64 x 2 x (576 + 512)
// flops per 1152-byte key: ~121 flops per byte), and the mma.sync kernel's ldmatrix traffic
// and register-fed MMAs cap it far below the tensor cores' rate.
//
// Same contract and numerics as decode_splitkv_kernel in decode_attention.cu (see there and
// docs/SEMANTICS.md rule 6): S = Q K^T in fp32, online softmax in base 2 with the score scale
// folded in, P rounded to T for P V (the row sum from the unrounded p), the output rounded
// once; with several KV splits each split writes its normalised fp32 partial and its LSE in
// the layout the shared combine kernel reads. Only 16-bit caches (of the activation type)
// come here. Design, budgets and the expected speed: docs/decode_sm90.md, last section.
//
// Only the sm_90a compile of this file holds the kernel; the sm_80 compile of the same source
// gets a body that traps (the host never launches it anywhere but on sm_90 with sm_90a code).
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#include "cuda/decode_combine.cuh"
#include "cuda/decode_sched.cuh"
#include "cuda/decode_sm90.cuh"
#include "cuda/sm90.cuh"

namespace kmla::cuda {

namespace {

using namespace sm90;

constexpr int kRows = kDecodeSm90Rows;  // query rows per CTA (one consumer M of 64)
constexpr int kKeys = kDecodeSm90Keys;  // keys per tile
constexpr int kThreads = 256;           // two warpgroups
constexpr int kRowBytes = kLatentDim * 2;               // 1152: one 576-wide row in T
[[maybe_unused]] constexpr int kRowChunks = kRowBytes / 16;              // 72 chunks of 16 bytes
constexpr int kPanels = kLatentDim / kPanelElems;       // 9 panels of 64 columns
constexpr int kPanelBytes = 64 * kPanelRowBytes;        // 8192: 64 rows (or keys) x 128 B
constexpr int kTileBytes = kPanels * kPanelBytes;       // 73,728: Q, or one K tile
[[maybe_unused]] constexpr int kHalfKeys = kKeys / 2;                    // S columns per warpgroup
[[maybe_unused]] constexpr int kHalfCols = kKvLoraRank / 2;              // O columns per warpgroup
[[maybe_unused]] constexpr float kLn2 = 0.6931471805599453f;
static_assert(kRows == 64 && kKeys == 64 && kLatentDim == 576 && kKvLoraRank == 512,
              "the tile shapes below are written for 64 rows x 64 keys of MLA's 576 / 512");

// ---- shared memory (dynamic, from a 1024-byte-aligned base) --------------------------
//   Q          [0, 73,728)         9 panels x 64 rows (rows past the request: zeros)
//   K stage 0  [73,728, 147,456)   9 panels x 64 keys; V = its first 8 panels
//   K stage 1  [147,456, 221,184)
//   P          [221,184, 229,376)  1 panel: 64 rows x 64 keys in T (the PV A operand)
//   red_max    [229,376, 229,888)  [2 warpgroups][64 rows] fp32 tile maxima of S halves
//   red_sum    [229,888, 230,400)  [2][64] fp32 row sums at the end
//   key_ok     [230,400, 230,528)  [2 stages][64 keys] u8: key loaded (in split, good block)
// total 230,528 B + 1,024 alignment slack = 231,552, plus 32 B of static shared memory (TMA
// mbarriers and fix flags): 231,584 <= 232,448 (227 KB opt-in per block).
[[maybe_unused]] constexpr int kQOff = 0;
constexpr int kKOff = kTileBytes;
constexpr int kPOff = kKOff + 2 * kTileBytes;
constexpr int kRedMaxOff = kPOff + kPanelBytes;
constexpr int kRedSumOff = kRedMaxOff + 2 * kRows * 4;
constexpr int kKeyOkOff = kRedSumOff + 2 * kRows * 4;
constexpr int kSmemBytes = kKeyOkOff + 2 * kKeys;
constexpr int kSmemAlloc = kSmemBytes + 1024;
static_assert(kSmemBytes == 230528 && kSmemAlloc <= 227 * 1024, "fits the sm_90 opt-in");
static_assert(kPOff % 1024 == 0 && kKOff % 1024 == 0, "panels are swizzle-atom aligned");
constexpr int kProbeSmemAlloc = 2 * kTileBytes + kPanelBytes + 1024;

// Byte offset of 16-byte chunk c (0..71) of row `row` in a [64][576] T tile of 9 panels.
[[maybe_unused]] __host__ __device__ constexpr uint32_t tile_offset(int row, int c) {
  return uint32_t((c >> 3) * kPanelBytes) + swizzle128(row, c & 7);
}

// How far (log2 units) a row's tile max may pass its running max before the max moves and O
// is rescaled (sm90_piece, tile_max). A compile-time constant: as a kernel argument it made
// ptxas serialise the wide kernels' wgmmas (C7511).
[[maybe_unused]] constexpr float kLazyRescale = 8.0f;

#if KMLA_SM90A

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}
// A key copy: evict_first, as the TMA key loads (see the loader below).
__device__ __forceinline__ void cp_async16_key(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst),
               "l"(src), "r"(valid ? 16 : 0), "l"(l2_evict_first_policy()));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

// The named barrier of P part c (sm90_piece's kParts; 1 and 3 are the narrow softmax's and the
// thin tiles').
constexpr int p_bar(int c) { return c == 0 ? 2 : 3 + c; }
// f.template operator()<I>() for I = 0 .. N - 1, in order.
template <int N, class F>
__device__ __forceinline__ void unroll_n(F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) { (f.template operator()<I>(), ...); }
  (std::make_integer_sequence<int, N>{});
}

// S half of warpgroup wg: s (64 rows x keys [32 wg, 32 wg + 32) of the tile at kt) = Q K^T,
// 36 k-steps of 16 over the 9 panels; both operands K-major. Issued and committed, not
// waited for. The B start moves by 32 keys x 128 B = 4096 B (4 swizzle atoms).
// The descriptors of all these issues are one add each to a low half computed once
// (sm90::desc_lo): masking and shifting 72 addresses per tile sat on the issuing warps' path.
constexpr uint32_t kDescHi = desc_hi(kSwizzleAtomBytes, 1);
template <class T>
__device__ __forceinline__ void issue_s(float (&s)[16], uint32_t q_s, uint32_t kt, int wg) {
  const uint32_t q_lo = desc_lo(q_s, 16), k_lo = desc_lo(kt + wg * kHalfKeys * kPanelRowBytes, 16);
#pragma unroll
  for (int kk = 0; kk < kLatentDim / 16; ++kk) {
    const uint32_t off = ((kk >> 2) * kPanelBytes + (kk & 3) * 32) >> 4;
    wgmma_ss_m64n32k16<T, false>(s, make_desc_halves(q_lo + off, kDescHi),
                                 make_desc_halves(k_lo + off, kDescHi), kk > 0);
  }
  wgmma_commit();
}

// O half of warpgroup wg: o (64 rows x columns [256 wg, 256 wg + 256)) += P V, 4 k-steps of
// 16 keys. P (A) is K-major in its one panel (+32 B per step); V (B) is the tile's panels
// 4 wg .. 4 wg + 3 read MN-major: panels 8192 B apart, 8-key groups 1024 B apart, a step of
// 16 keys = 2048 B.
template <class T, int K0 = 0, int K1 = kKeys / 16>
__device__ __forceinline__ void issue_pv(float (&o)[128], uint32_t p_s, uint32_t kt, int wg) {
  const uint32_t p_lo = desc_lo(p_s, 16), v_lo = desc_lo(kt + 4 * wg * kPanelBytes, kPanelBytes);
#pragma unroll
  for (int kk = K0; kk < K1; ++kk)
    wgmma_ss_m64n256k16<T, true>(
        o, make_desc_halves(p_lo + 2 * kk, kDescHi),
        make_desc_halves(v_lo + ((kk * 16 * kPanelRowBytes) >> 4), kDescHi), true);
  wgmma_commit();
}

// Stores this thread's p values (the accumulator layout of the warpgroup's S half) rounded to
// T into the P panel: row 16 warp + g (+ 8), key 32 wg + 8 i + 2 t (+ 1) -> chunk 4 wg + i.
// For a fixed i the 32 lanes write 8 rows x 4 words; the swizzle puts the 8 rows on 8
// different chunk columns, so the 32 stores hit 32 different banks.
// With NB = 8 (the wide S of one warpgroup, wg = 0) the same for all 64 keys, chunk i.
template <class T, int NB = 4, int I0 = 0, int I1 = NB>
__device__ __forceinline__ void store_p(uint8_t* p_s, const float (&p)[4 * NB], int wg, int warp,
                                        int g, int t) {
#pragma unroll
  for (int i = I0; i < I1; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = 16 * warp + g + 8 * h;
      *reinterpret_cast<uint32_t*>(p_s + swizzle128(row, NB * wg + i) + 4 * t) =
          pack2<T>(p[4 * i + 2 * h], p[4 * i + 2 * h + 1]);
    }
  }
}

// The wide S of one warpgroup: s (64 rows x all 64 keys of the tile at kt) = Q K^T, 36
// wgmma m64n64k16. Each k-step reads 2 KB of Q and 2 KB of K for 64 x 64 x 16 MACs, where the
// two m64n32 halves read Q twice (6 KB): a third less shared-memory traffic for S.
template <class T>
__device__ __forceinline__ void issue_s_wide(float (&s)[32], uint32_t q_s, uint32_t kt) {
  const uint32_t q_lo = desc_lo(q_s, 16), k_lo = desc_lo(kt, 16);
#pragma unroll
  for (int kk = 0; kk < kLatentDim / 16; ++kk) {
    const uint32_t off = ((kk >> 2) * kPanelBytes + (kk & 3) * 32) >> 4;
    wgmma_ss_m64n64k16<T, false>(s, make_desc_halves(q_lo + off, kDescHi),
                                 make_desc_halves(k_lo + off, kDescHi), kk > 0);
  }
  wgmma_commit();
}

// ---- thin tiles: a piece of at most 32 rows (KernelFlags::thin_rows) -------------------
// A request of 32 rows or fewer (12 heads x 2 tokens = 24, or 12 x 1 in a large batch,
// decode_sm90_takes_rows) would compute as 64 rows on the wide tile. A thin tile puts the keys in
// the MMAs' M instead: S^T = K Q^T (64 keys x N rows, N = 16 or 32) and O^T = V^T P^T (512 columns
// x N rows), a quarter or a half of the wide tile's MMA work and no 64-row accumulators.

// Local row of a thin tile's thread-row i (i = 2 j + e: row 8 j + 2 t + e, t = lane % 4): the
// N column of its S^T and O^T accumulator values.
__device__ __forceinline__ int thin_row(int i, int t) { return 8 * (i >> 1) + 2 * t + (i & 1); }

// S^T of the tile at kt: st (64 keys x N rows) = K Q^T, 36 wgmma m64nNk16, both operands
// K-major at the same offsets as the wide S (A the key tile, B Q's first N rows).
template <class T, int N>
__device__ __forceinline__ void issue_s_thin(float (&st)[N / 2], uint32_t q_s, uint32_t kt) {
  const uint32_t q_lo = desc_lo(q_s, 16), k_lo = desc_lo(kt, 16);
#pragma unroll
  for (int kk = 0; kk < kLatentDim / 16; ++kk) {
    const uint32_t off = ((kk >> 2) * kPanelBytes + (kk & 3) * 32) >> 4;
    wgmma_ss_thin<T, N, false>(st, make_desc_halves(k_lo + off, kDescHi),
                               make_desc_halves(q_lo + off, kDescHi), kk > 0);
  }
  wgmma_commit();
}

// O^T of warpgroup wg: ot (4 blocks of 64 columns, columns [256 wg, 256 wg + 256), x N rows)
// += V^T P^T, 4 k-steps of 16 keys per block. A is V panel 4 wg + b read MN-major (the
// panel's 128-byte rows are the M dim; 8-key groups 1024 B apart, the leading offset is never
// used by one 64-wide block); B is P^T, N rows x 64 keys K-major in the P panel (+32 B per step).
template <class T, int N>
__device__ __forceinline__ void issue_pv_thin(float (&ot)[2 * N], uint32_t p_s, uint32_t kt,
                                              int wg) {
  const uint32_t p_lo = desc_lo(p_s, 16);
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    const uint32_t v_lo = desc_lo(kt + (4 * wg + b) * kPanelBytes, kPanelBytes);
    float(&ob)[N / 2] = *reinterpret_cast<float(*)[N / 2]>(&ot[b * N / 2]);
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk)
      wgmma_ss_thin<T, N, true>(ob,
                                make_desc_halves(v_lo + ((kk * 16 * kPanelRowBytes) >> 4), kDescHi),
                                make_desc_halves(p_lo + 2 * kk, kDescHi), true);
  }
  wgmma_commit();
}

// The piece's number of 64-key tiles; an empty piece of a cut pair instead writes its LSE of
// -inf (the combine then never reads its partial) and gets -1, and the caller returns.
__device__ __forceinline__ int piece_tiles(const DecodeArgs& a, const DecodeWork& work) {
  const int ntiles = work.key1 > work.key0 ? (work.key1 - work.key0 + kKeys - 1) / kKeys : 0;
  if (ntiles > 0 || work.direct) return ntiles;
  const int tid = threadIdx.x;
  if (tid < kRows && work.row0 + tid < work.nrows)
    a.ws_lse[work.part + int64_t(tid) * work.part_stride] = kNegInf;
  return -1;
}

// Copies the piece's first `rows` (64, or a thin tile's N) query rows into the Q tile at q_s by
// cp.async (rows past the request zero-filled; not committed) and returns the output row of
// local row 0.
__device__ __forceinline__ int64_t load_q(const DecodeArgs& a, const DecodeWork& work, uint32_t q_s,
                                          int rows) {
  const int64_t out_row0 = int64_t(a.query_start[work.r]) * a.heads + work.row0;
  const uint8_t* q = static_cast<const uint8_t*>(a.q) + out_row0 * kRowBytes;
  for (int i = threadIdx.x; i < rows * kRowChunks; i += kThreads) {
    const int row = i / kRowChunks, c = i % kRowChunks;
    const bool ok = work.row0 + row < work.nrows;
    cp_async16(q_s + tile_offset(row, c), ok ? q + row * kRowBytes + c * 16 : a.q, ok);
  }
  return out_row0;
}

// A piece's direct output (rows of 512 T) is staged in shared memory, in the key stages (free
// after its last P V), before it goes out: the accumulator layout alone would store 4 bytes
// of each of 8 rows per warp instruction (half sectors), the staged rows go out as 512
// contiguous bytes per warp instruction. Rows are 16 bytes apart in the banks, so a warp's
// 4-byte stores from the accumulator layout (8 rows x 4 column pairs) cover the 32 banks once.
// Measured on an H100 (2026-12-07, twenty-seventh session, two rounds alternated): (128, 128,
// 4k) 316.5 -> 307.3 us, (64, 128, 8k) 299.4 -> 295.3, (64, 64, 8k, q 2) 301.5 -> 295.7. The
// same for the fp32 partials (float2 stores, whole 32-byte sectors already) was slower: the
// DSpark draft 224.0 -> 227.9, (16, 128, 4k) +1.5 us; they keep their stores from registers.
constexpr int kStageRowBytes = kKvLoraRank * 2 + 16;
static_assert(kRows * kStageRowBytes <= 2 * kTileBytes, "the staged rows fit the stages");

// Copies `rows` staged rows of 512 T (kStageRowBytes apart at `stage`) to dst, consecutive
// rows: 16 bytes a thread at a time where dst is 16-byte aligned, else 4. Out of line, with
// its arguments by value: inlined, ptxas serialised the kernel's wgmmas for want of
// registers (C7511).
__device__ __noinline__ void write_staged_rows(const uint8_t* stage, int rows, uint8_t* dst) {
  constexpr int kRowOut = kKvLoraRank * 2;
  auto copy = [&]<class V>() {
    constexpr int kPer = kRowOut / int(sizeof(V));  // V units of a row
    for (int i = threadIdx.x; i < rows * kPer; i += kThreads) {
      const int row = i / kPer, c = i % kPer;
      reinterpret_cast<V*>(dst + row * kRowOut)[c] =
          *reinterpret_cast<const V*>(stage + row * kStageRowBytes + c * int(sizeof(V)));
    }
  };
  if ((reinterpret_cast<uintptr_t>(dst) & 15) == 0)
    copy.template operator()<uint4>();
  else
    copy.template operator()<uint32_t>();
  fence_proxy_async();  // my generic reads of the stages before the next piece's TMA writes
}

// The end of a piece: adds this thread's row sums l_lo, l_hi (rows row_lo and row_lo + 8 of
// the tile, this thread's columns) over the quad and, through red_sum ([2][64]) and a
// __syncthreads, over both warpgroups; then normalises the thread's two rows of the O half
// of warpgroup wg and writes them to the output (through the key stages at `stage`,
// write_staged_rows), or to the piece's fp32 partial; warpgroup 0 also writes the LSE. m:
// the rows' final running maxima (log2 domain, scores scaled). No visible key <=> l = 0
// (the row's max key adds 2^0 = 1).
template <class T>
__device__ __forceinline__ void finish_rows(const DecodeArgs& a, const DecodeWork& work,
                                            int64_t out_row0, const float (&o)[128], int wg,
                                            int row_lo, int t, const float (&m)[2], float l_lo,
                                            float l_hi, float* red_sum, uint8_t* stage) {
#pragma unroll
  for (int x = 1; x <= 2; x <<= 1) {
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, x);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, x);
  }
  const int row_hi = row_lo + 8;
  if (t == 0) {
    red_sum[wg * kRows + row_lo] = l_lo;
    red_sum[wg * kRows + row_hi] = l_hi;
  }
  __syncthreads();  // also: both warpgroups' last P V has read the key stages
  const float l[2] = {red_sum[row_lo] + red_sum[kRows + row_lo],
                      red_sum[row_hi] + red_sum[kRows + row_hi]};
  const bool direct = work.direct;  // (uniform)
  if (direct) fence_proxy_async();  // the stages' async-proxy reads before my generic writes
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row_lo + 8 * h;
    const bool live = work.row0 + row < work.nrows;
    const bool empty = !(l[h] > 0.0f);
    const float inv = empty ? 0.0f : a.v_scale / l[h];
    const float lse = empty ? kNegInf : (m[h] + __log2f(l[h])) * kLn2;
    const int col0 = kHalfCols * wg + 2 * t;
    if (direct) {  // every row staged; only the request's are copied out
      uint32_t* dst = reinterpret_cast<uint32_t*>(stage + row * kStageRowBytes) + col0 / 2;
#pragma unroll
      for (int i = 0; i < 32; ++i)
        dst[4 * i] = pack2<T>(o[4 * i + 2 * h] * inv, o[4 * i + 2 * h + 1] * inv);
      if (live && wg == 0 && t == 0) a.lse[out_row0 + row] = lse;
    } else if (live) {
      const int64_t w = work.part + int64_t(row) * work.part_stride;
      if (!empty) {
        float* out = a.ws_o + w * kKvLoraRank + col0;
#pragma unroll
        for (int i = 0; i < 32; ++i)
          *reinterpret_cast<float2*>(out + 8 * i) =
              make_float2(o[4 * i + 2 * h] * inv, o[4 * i + 2 * h + 1] * inv);
      }
      if (wg == 0 && t == 0) a.ws_lse[w] = lse;
    }
  }
  if (direct) {
    __syncthreads();
    write_staged_rows(stage, min(kRows, work.nrows - work.row0),
                      reinterpret_cast<uint8_t*>(static_cast<T*>(a.out) + out_row0 * kKvLoraRank));
  }
}

// The end of a thin piece (layouts in sm90_piece): adds the row sums l (this thread's keys,
// rows 8 j + 2 t + e at i = 2 j + e) over the lanes of a row and, through red_sum ([4 warps]
// [32 rows]) and a __syncthreads, over warpgroup 0's warps; then normalises this thread's
// part of its warpgroup's O^T and writes it, as finish_rows. m: warpgroup 0's final maxima.
template <class T, int N>
__device__ __forceinline__ void finish_thin(const DecodeArgs& a, const DecodeWork& work,
                                            int64_t out_row0, const float (&ot)[2 * N], int wg,
                                            int warp, int g, int t, const float (&m)[8],
                                            float (&l)[8], float* red_sum) {
  constexpr int R = N / 4;
#pragma unroll
  for (int x = 4; x <= 16; x <<= 1) {
#pragma unroll
    for (int i = 0; i < R; ++i) l[i] += __shfl_xor_sync(0xffffffffu, l[i], x);
  }
  if (wg == 0 && g == 0) {
#pragma unroll
    for (int i = 0; i < R; ++i) red_sum[32 * warp + thin_row(i, t)] = l[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int row = thin_row(i, t);
    if (work.row0 + row >= work.nrows) continue;
    const float sum = red_sum[row] + red_sum[32 + row] + red_sum[64 + row] + red_sum[96 + row];
    const bool empty = !(sum > 0.0f);
    const float inv = empty ? 0.0f : a.v_scale / sum;
    const float lse = empty ? kNegInf : (m[i] + __log2f(sum)) * kLn2;
    const int64_t w = work.part + int64_t(row) * work.part_stride;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = 64 * (4 * wg + b) + 16 * warp + g + 8 * h;
        const float v = ot[b * N / 2 + 4 * (i >> 1) + 2 * h + (i & 1)] * inv;
        if (work.direct)
          static_cast<T*>(a.out)[(out_row0 + row) * kKvLoraRank + col] = from_float<T>(v);
        else if (!empty)
          a.ws_o[w * kKvLoraRank + col] = v;
      }
    }
    if (wg == 0 && warp == 0 && g == 0) {
      if (work.direct)
        a.lse[out_row0 + row] = lse;
      else
        a.ws_lse[w] = lse;
    }
  }
}

#endif  // KMLA_SM90A

// Runtime variants of the kernel (DecodeSm90Options, plus the timing-only profile mode),
// passed by value: uniform branches, no extra instantiations.
struct KernelFlags {
  bool skip_rescale;
  // Timing only, results are wrong (KMLA_DECODE_SM90_PROFILE): 1 = no key loads after the
  // first two tiles (the loop's compute alone), 2 = no MMAs or softmax (its loads alone).
  int profile;
  // > 0: key tiles by bulk tensor copies (TMA) of groups of this many keys (8, 16, 32 or 64,
  // a divisor of the block size) through the kernel's tensor map; 0: cp.async.
  int tma_keys;
  // tma_keys == 64 and the map's box holds all 9 panels: one copy per tile.
  bool one_copy;
  bool issue_wg1;    // DecodeSm90Options::issue_wg1 (wide S only)
  bool early_issue;  // DecodeSm90Options::early_issue (TMA only)
  int thin_rows;     // DecodeSm90Options::thin_rows (wide S only)
};

// ---- the kernel ---------------------------------------------------------------------
// Grid and work as the mma.sync kernel's for 64-row tiles (decode_sched.cuh): per request,
// x = 64-row tile of the request's (token * heads + head) rows, y = KV split, z = request;
// balanced, x = worker, each running its pieces in turn. One CTA per SM (smem above).
//
// Warpgroups wg = 0, 1 both load (cp.async) and both compute; they share the 64 rows:
//   S:  warpgroup wg computes the scores of all 64 rows against keys [32 wg, 32 wg + 32) of
//       the tile (36 wgmma m64n32k16, Q and K from shared memory);
//   softmax: each warpgroup's row maxima over its 32 keys meet in red_max, so both hold the
//       same running max m (hence the same rescale factor) for a row; each keeps the partial
//       row sum l of its own keys, added at the end;
//   P:  each warpgroup writes its 64 x 32 half of P (rounded to T) into the P panel;
//   PV: warpgroup wg accumulates output columns [256 wg, 256 wg + 256) over all 64 keys
//       (4 wgmma m64n256k16, P and V from shared memory).
// Per tile t (keys key0 + 64 t ..), two stages:
//   wait for my copies of tile t (and Q); proxy fence; __syncthreads    # t in; t-1 consumed
//   issue the copies of tile t + 1 into the other stage (block ids read one tile ahead)
//   (TMA with early_issue, the default: __syncthreads; issue t + 1; wait for tile t)
//   S; wait; mask + tile max; bar(1); max, p, l; P -> smem; proxy fence; rescale O; bar(2)
//   PV; wait
// Registers per thread: O 128 fp32 + S 16 + softmax state and addresses (no launch-bound cap
// below 255: 256 threads per SM).
//
// Copies: thread (key = tid / 4, part = tid % 4) copies chunks part, part + 4, ... (18 of
// 16 B) of one key row per tile, after one block-table lookup; Q takes 18 chunks per thread
// once. A key outside [key0, key1) or behind a bad block id is zero-filled (never read) and
// flagged in key_ok, which masks it.
//
// TMA copies (flags.tma_keys = G > 0): one warp issues each tile (warp 4 with the wide S and
// the default issue_wg1, else warp 0; with the default early_issue right after the tile
// barrier, the wait for the current tile moving behind the issue): lane j < 64 / G looks up
// the block of keys [G j, G j + G) (one block, since G divides the block size and every tile
// starts at a multiple of 64), and if that block id is good, 9 tensor copies of G rows x 64
// columns, one per panel (G = 64 with flags.one_copy: one 4-D copy of the 9 panels; measured
// on an H100, 2026-12-06, three rounds alternated: -2 to -3 % on the 128 / 64-head shapes,
// e.g. (64, 128, 8k) 311.9 / 309.7 / 309.1 -> 303.3 / 300.3 / 304.8 us, -0.3 to -0.6 % on
// the one-tile shapes); lane 0 first announces the tile's bytes on the stage's mbarrier,
// which every thread waits on instead of its own cp.async groups. Copies of whole groups
// also bring rows past key1 (cache slots past the sequence: any bytes, NaN included), and
// groups behind a bad block id are not copied at all (the stage keeps an older tile), so a
// tile with any key not ok is fixed before use: its V columns (panels 0-7) are zeroed on
// those rows (P is 0 there, and 0 x NaN would be NaN); S is masked by selection anyway.
//
// kWideS (DecodeSm90Options::wide_s, a template parameter so that the default kernel's code
// stays as measured): warpgroup 0 computes all of S (36 wgmma m64n64k16) and the softmax of
// the 64 keys alone, writes P and its rescale factors (into red_max), and warpgroup 1 waits
// at the P barrier, then rescales its O half with those factors; only warpgroup 0 keeps m
// and l. The two warpgroups' PV is unchanged.
//
// The kernel runs one piece of work (decode_sched.cuh) per call; under the balanced schedule a
// CTA runs several in turn, so the TMA mbarriers are invalidated at the end of each piece and
// initialised afresh (phase 0) by the next.
template <class T, bool kWideS, int kThin, int kParts = 1>
__device__ __forceinline__ void sm90_piece(const DecodeArgs& a, const DecodeWork& work,
                                           const KernelFlags& flags, const CUtensorMap& kmap) {
  static_assert(kThin == 0 || (kWideS && (kThin == 16 || kThin == 32)), "thin tiles: 16 or 32");
  // (Four parts made ptxas serialise the wgmmas, C7511.)
  static_assert(kParts == 1 || (kWideS && kParts == 2), "P in one part, or two with the wide S");
#if KMLA_SM90A
  constexpr int thin = kThin;
  __shared__ __align__(8) uint64_t full_bar[2];  // TMA: tile landed in stage 0 / 1
  __shared__ uint8_t fix_s[2];                   // TMA: the stage's tile has keys not ok
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_u32 = smem_u32(smem_raw);
  const uint32_t base = (raw_u32 + 1023u) & ~1023u;
  uint8_t* const smem = smem_raw + (base - raw_u32);
  float* const red_max = reinterpret_cast<float*>(smem + kRedMaxOff);
  float* const red_sum = reinterpret_cast<float*>(smem + kRedSumOff);
  uint8_t* const key_ok_s = smem + kKeyOkOff;

  // The piece of work (decode_sched.cuh): rows [row0, row0 + 64) of request r, keys
  // [key0, key1) in 64-key tiles.
  const int r = work.r;
  const int row0 = work.row0;
  const int qlen = work.qlen, seq = work.seq, nrows = work.nrows;
  auto key_count = [&](int row) -> int {  // keys visible to local row `row`
    return decode_row_keys(a, qlen, seq, nrows, row);
  };
  const int key0 = work.key0, key1 = work.key1;
  const int ntiles = piece_tiles(a, work);
  if (ntiles < 0) return;
  const int tid = threadIdx.x;
  const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;

  const uint32_t q_s = base + kQOff;
  const int64_t out_row0 = load_q(a, work, q_s, thin != 0 ? thin : kRows);

  // ---- key tile loader ----
  // Both forms (cp.async and TMA) load keys under the L2 evict_first policy. Measured on the
  // H100 (2026-12-05, two binaries alternated twice): (128, 12, 8k, q 4) 455.9 / 454.2 ->
  // 437.1 / 437.7 us, the DSpark draft (64, 8, 8k, q 8) 251.4 / 251.3 -> 235.5 / 237.7, mixed
  // q 2..6 518.7 / 517.3 -> 503.5 / 503.1; the 128 / 64-head shapes, whose two row-tile CTAs
  // read the same keys, within noise (e.g. (64, 128, 8k) 338.9 / 336.9 against 337.5 / 337.6).
  const int my_key = tid >> 2, my_part = tid & 3;
  const int32_t* table = a.block_tables + int64_t(r) * a.max_blocks;
  auto fetch_block = [&](int tile) -> int {  // my key's block id in `tile`, read only if used
    const int pos = key0 + tile * kKeys + my_key;
    return tile < ntiles && pos < key1 ? table[decode_block_of(a, pos)] : -1;
  };
  auto issue = [&](int tile, int block) {
    const int stage = tile & 1;
    const int pos = key0 + tile * kKeys + my_key;
    bool ok;
    const std::byte* src = decode_key_src(a, pos, key1, block, kRowBytes, my_part == 0, ok);
    if (my_part == 0) key_ok_s[stage * kKeys + my_key] = ok;
    const uint32_t dst = base + kKOff + stage * kTileBytes;
#pragma unroll 2
    for (int c = my_part; c < kRowChunks; c += 4)
      cp_async16_key(dst + tile_offset(my_key, c), src + c * 16, ok);
  };

  // The loop's switches, pinned in a register by an empty asm the compiler cannot see through:
  // left to it, they were reloaded from the parameter bank (and branched on) at every tile, on
  // the chain from the tile barrier to S, where the tensor pipe idles.
  int pinned = (flags.tma_keys << 8) | (flags.profile << 4) | (flags.early_issue ? 2 : 0) |
               (flags.skip_rescale ? 1 : 0);
  asm volatile("" : "+r"(pinned));
  const int profile = (pinned >> 4) & 15;
  const bool skip_rescale = pinned & 1;
  // TMA: lane j of the issuing warp takes keys [G j, G j + G) of every tile (see above the
  // kernel).
  const int tma_keys = pinned >> 8;
  const bool tma = tma_keys > 0;
  const int lane_c = tid & 31;
  // The warp that issues the copies: with the wide S (and flags.issue_wg1) warp 4, the first
  // of warpgroup 1, which idles while warpgroup 0 computes S and the softmax, so the table
  // lookups, ballots and copies stay off warpgroup 0's path to S; else warp 0.
  const bool issuer = kWideS && flags.issue_wg1 ? (tid >> 5) == 4 : tid < 32;
  // flags.early_issue: the copies of tile t + 1 go out right after the tile barrier (their
  // stage, that of t - 1, is free there) and only then does everyone wait for tile t, so two
  // tiles are in flight; else the wait for tile t comes before the barrier.
  const bool early = tma && (pinned & 2);
  auto fetch_group = [&](int tile) -> int {
    const int pos = key0 + tile * kKeys + tma_keys * lane_c;
    return issuer && tile < ntiles && tma_keys * lane_c < kKeys && pos < key1
               ? table[decode_block_of(a, pos)]
               : -1;
  };
  auto issue_tma = [&](int tile, int block) {  // the issuing warp only
    const int stage = tile & 1;
    const int pos = key0 + tile * kKeys + tma_keys * lane_c;
    const bool any = tma_keys * lane_c < kKeys && pos < key1;
    const bool good = any && block >= 0 && int64_t(block) < a.num_blocks;
    if (any && !good) raise_error(a.error_flag, kErrBadBlockId);
    const unsigned good_groups = __ballot_sync(0xffffffffu, good);
    bool all_ok = true;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int k = lane_c + 32 * h;
      const bool ok = (good_groups >> (k / tma_keys) & 1u) && key0 + tile * kKeys + k < key1;
      key_ok_s[stage * kKeys + k] = ok;
      all_ok = all_ok && ok;
    }
    const bool fix = !__all_sync(0xffffffffu, all_ok);
    if (lane_c == 0) {
      fix_s[stage] = fix;
      mbar_arrive_expect_tx(&full_bar[stage],
                            uint32_t(__popc(good_groups) * tma_keys * kRowBytes));
    }
    __syncwarp();  // the bytes are announced before any copy can complete
    const int copies = flags.one_copy ? 1 : kPanels;
    if constexpr (thin == 0) {
      if (good) {  // a box per panel, or (one_copy) one of all nine
        const uint32_t dst = base + kKOff + stage * kTileBytes + lane_c * tma_keys * kPanelRowBytes;
#pragma unroll 1
        for (int pn = 0; pn < copies; ++pn)
          tma_load_4d(dst + pn * kPanelBytes, &kmap, 0, decode_row_in_block(a, pos), pn, block,
                      &full_bar[stage], l2_evict_first_policy());
      }
    } else {
      // Thin tiles: item i = (group i mod groups, panel i / groups) goes to lane i mod 32, so
      // the 18-72 copies of 8-32-key groups leave the warp in one to three rounds instead of
      // one lane issuing a group's nine in a row (block size 16 on an H200: (128, 12, 4k) 197 us
      // on thin tiles against 158 on the 16-row kernel, 2026-12-06, twentieth session). (The
      // same in the wide pieces made ptxas serialise the wide kernel's wgmmas, C7511.)
      const int groups = kKeys / tma_keys, gshift = __ffs(groups) - 1;
      const int row = decode_row_in_block(a, pos);
#pragma unroll 1
      for (int k = 0; k < 3; ++k) {
        const int i = lane_c + 32 * k, gi = i & (groups - 1), pn = i >> gshift;
        const int gblock = __shfl_sync(0xffffffffu, block, gi);
        const int grow = __shfl_sync(0xffffffffu, row, gi);
        if (pn < copies && (good_groups >> gi & 1u))
          tma_load_4d(
              base + kKOff + stage * kTileBytes + gi * tma_keys * kPanelRowBytes + pn * kPanelBytes,
              &kmap, 0, grow, pn, gblock, &full_bar[stage], l2_evict_first_policy());
      }
    }
  };
  auto fetch = [&](int tile) { return tma ? fetch_group(tile) : fetch_block(tile); };
  auto issue_any = [&](int tile, int block) {
    if (!tma)
      issue(tile, block);
    else if (issuer)
      issue_tma(tile, block);
  };
  // Which tiles get loaded at all (the "compute" profile stops after tile 1).
  auto loaded = [&](int tile) { return profile != 1 || tile < 2; };

  if (tma) {
    if (tid == 0) {
      mbar_init(&full_bar[0], 1);
      mbar_init(&full_bar[1], 1);
      fence_mbarrier_init();
    }
    __syncthreads();
  }
  int next_block = fetch(0);
  if (ntiles > 0) {
    const int b = next_block;
    next_block = fetch(1);
    issue_any(0, b);
  }
  cp_async_commit();  // group: Q (and tile 0 without TMA)

  // ---- per-thread state: rows lo = 16 warp + g and hi = lo + 8 of the tile ----
  const int row_lo = 16 * warp + g, row_hi = row_lo + 8;
  const int count_lo = key_count(row0 + row_lo), count_hi = key_count(row0 + row_hi);
  const int count_first = key_count(row0);
  float m_lo = kNegInf, m_hi = kNegInf;  // running max of scaled scores (log2 domain)
  float l_lo = 0.0f, l_hi = 0.0f;        // this warpgroup's partial row sums
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.0f;
  float s[32];  // S of this thread: the first 16 for a half, all 32 for the wide S
  const uint32_t p_s = base + kPOff;

  // Thin pieces (flags.thin_rows; the wide S's roles): warpgroup 0 computes S^T (keys x rows)
  // and the softmax down the keys, each thread holding keys 16 warp + g (+ 8) of rows
  // 8 j + 2 t + e (index i = 2 j + e); a row's max comes from its 8 lanes (shuffles) and the
  // 4 warps (red_sum as [4][32], barrier 3). P^T (rows x keys, K-major) goes into the P panel,
  // the factors into red_max as in the wide form, and each warpgroup keeps O^T of its 256
  // columns in o[0, 2 N): block b, column 64 (4 wg + b) + 16 warp + g (+ 8), row as above.
  float thin_m[8], thin_l[8];  // warpgroup 0: running max; partial sum of my keys
  int thin_count[8];           // keys visible to my thin rows
  if constexpr (thin != 0) {
#pragma unroll
    for (int i = 0; i < thin / 4; ++i) {  // my rows
      thin_m[i] = kNegInf;
      thin_l[i] = 0.0f;
      thin_count[i] = key_count(row0 + thin_row(i, t));
    }
  }
  auto thin_tile = [&]<int N>(uint32_t kt, int stage, int tile, bool whole) {
    constexpr int R = N / 4;  // my rows
    float(&ot)[2 * N] = *reinterpret_cast<float(*)[2 * N]>(&o[0]);
    float corr[R];
    bool moved = false;
    if (wg == 0) {
      float(&st)[N / 2] = *reinterpret_cast<float(*)[N / 2]>(&s[0]);
      wgmma_fence();
      issue_s_thin<T, N>(st, q_s, kt);
      wgmma_wait<0>();
      fence_regs(st);
      // st[4 j + 2 h + e]: key 16 warp + g + 8 h, row 8 j + 2 t + e.
      if (!whole) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int key = 16 * warp + g + 8 * h;
          const bool ok = key_ok_s[stage * kKeys + key];
          const int kpos = key0 + tile * kKeys + key;
#pragma unroll
          for (int i = 0; i < R; ++i) {
            float& v = st[4 * (i >> 1) + 2 * h + (i & 1)];
            v = ok && kpos < thin_count[i] ? v : kNegInf;
          }
        }
      }
      float mx[R];
#pragma unroll
      for (int i = 0; i < R; ++i)
        mx[i] = fmaxf(st[4 * (i >> 1) + (i & 1)], st[4 * (i >> 1) + 2 + (i & 1)]);
#pragma unroll
      for (int x = 4; x <= 16; x <<= 1) {
#pragma unroll
        for (int i = 0; i < R; ++i) mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], x));
      }
      // Every lane stores its rows' maxima (the 8 lanes of a row the same value) and below
      // every thread its rows' factors: stores under a lane condition here made ptxas serialise
      // the wide tiles' wgmmas of the same kernel (C7520, "WG.AR in divergent path").
#pragma unroll
      for (int i = 0; i < R; ++i) red_sum[32 * warp + thin_row(i, t)] = mx[i];
      named_barrier(3, 128);
      const float scale = a.score_scale_log2;
      float mref[R];
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const int row = thin_row(i, t);
        const float m4 = fmaxf(fmaxf(red_sum[row], red_sum[32 + row]),
                               fmaxf(red_sum[64 + row], red_sum[96 + row]));
        // Lazy, as tile_max below: the max moves only past a margin of 2^kLazyRescale.
        const float mnew = m4 * scale > thin_m[i] + kLazyRescale ? m4 * scale : thin_m[i];
        moved = moved || mnew != thin_m[i];
        mref[i] = mnew == kNegInf ? 0.0f : mnew;  // no visible key yet: as in softmax
        corr[i] = fast_exp2(thin_m[i] - mref[i]);
        thin_m[i] = mnew;
      }
      uint8_t* const pt = smem + kPOff;
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const int row = thin_row(i, t);
        float sum = 0.0f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float& v = st[4 * (i >> 1) + 2 * h + (i & 1)];
          v = fast_exp2(fmaf(v, scale, -mref[i]));
          sum += v;
          *reinterpret_cast<T*>(pt + swizzle128(row, 2 * warp + h) + 2 * g) = from_float<T>(v);
        }
        thin_l[i] = thin_l[i] * corr[i] + sum;
      }
      fence_proxy_async();  // my P^T stores -> both warpgroups' wgmma reads
#pragma unroll
      for (int i = 0; i < R; ++i) red_max[thin_row(i, t)] = corr[i];
    }
    auto rescale = [&] {
#pragma unroll
      for (int b = 0; b < 4; ++b) {
#pragma unroll
        for (int i = 0; i < R; ++i) {
          ot[b * N / 2 + 4 * (i >> 1) + (i & 1)] *= corr[i];
          ot[b * N / 2 + 4 * (i >> 1) + 2 + (i & 1)] *= corr[i];
        }
      }
    };
    if (wg == 0 && (!skip_rescale || __any_sync(0xffffffffu, moved))) rescale();
    named_barrier(2, kThreads);  // all of P^T and the factors are in
    if (wg == 1) {
      bool ne = false;
#pragma unroll
      for (int i = 0; i < R; ++i) {
        corr[i] = red_max[thin_row(i, t)];
        ne = ne || corr[i] != 1.0f;
      }
      if (!skip_rescale || __any_sync(0xffffffffu, ne)) rescale();
    }
    wgmma_fence();
    issue_pv_thin<T, N>(ot, p_s, kt, wg);
    wgmma_wait<0>();
    fence_regs(ot);
  };

  const uint32_t full_bar_a = smem_u32(full_bar);  // computed once: off the loop's path
  for (int tile = 0; tile < ntiles; ++tile) {
    const int stage = tile & 1;
    const uint32_t kt = base + kKOff + stage * kTileBytes;
    // With TMA only Q came by cp.async (tile 0 waits for it); the tiles' bytes are async-proxy
    // writes that the mbarrier orders before the wgmma reads.
    if (!tma || tile == 0) {
      cp_async_wait_all();  // my copies of this tile (and of Q) have landed
      fence_proxy_async();  // ... and are visible to the wgmma reads that follow
    }
    if (tma && !early && loaded(tile)) mbar_wait(full_bar_a + 8 * stage, uint32_t(tile >> 1) & 1u);
    __syncthreads();      // everyone's copies; tile - 1 fully consumed (its PV waited)
    if (tile + 1 < ntiles && loaded(tile + 1)) {  // into tile - 1's stage
      const int b = next_block;
      next_block = fetch(tile + 2);
      issue_any(tile + 1, b);
    }
    if (!tma) cp_async_commit();
    if (early && loaded(tile)) mbar_wait(full_bar_a + 8 * stage, uint32_t(tile >> 1) & 1u);
    const bool fix = tma && fix_s[stage];
    if (fix) {
      // Zero the V columns of the keys not ok: 64 keys x 8 panels x 8 chunks of 16 bytes.
      for (int i = tid; i < kKeys * 64; i += kThreads) {
        const int key = i >> 6, c = i & 63;
        if (!key_ok_s[stage * kKeys + key])
          *reinterpret_cast<uint4*>(smem + kKOff + stage * kTileBytes + tile_offset(key, c)) =
              make_uint4(0, 0, 0, 0);
      }
      fence_proxy_async();
      __syncthreads();
    }
    if (profile == 2) continue;
    // Every key of the tile loaded (TMA's flag covers the split's end and bad blocks too) and
    // visible to the tile's first row, which sees the fewest (a causal row later in the
    // request sees more): the softmax then masks nothing.
    const bool whole = tma && !fix && key0 + (tile + 1) * kKeys <= count_first;
    if constexpr (thin != 0) {
      thin_tile.template operator()<thin>(kt, stage, tile, whole);
      continue;
    }

    // ---- S (half per warpgroup, or all of it on warpgroup 0), online softmax in base 2 ----
    float corr_lo = 1.0f, corr_hi = 1.0f;  // O rescale factors of my two rows
    float mref_lo = 0.0f, mref_hi = 0.0f;  // the maxima p is taken against
    // tile_max<NB>: this thread's NB blocks of 8 keys from key `koff` of the tile; masked keys
    // -inf. The tile max of a row comes from the other warpgroup's half through red_max
    // (NB = 4) or is complete already (NB = 8). Updates m (lazily, below), corr and l's scale;
    // returns whether a row's m moved. `whole`: every key of the tile is loaded and visible to
    // every row of the request in the tile, so nothing is masked (rows past the request see
    // zeros of Q: their p are never written out). The maxima are taken over the raw scores
    // and then scaled (the scale is positive, so that is the same number), and p = 2^(s scale
    // - m) in one fma: the scale multiply of every score is gone from the chain.
    // Lazy rescale: m moves only when a row's tile max passes it by more than kLazyRescale
    // (log2 units), so p <= 2^kLazyRescale = 256 (within T's range, rounded with the same
    // relative error; l and O in fp32) and O / l and the LSE are the same softmax. A row's
    // exact max is new in tile t with chance ~1 / t, so a warp's 16 rows rescaled O on most
    // of a piece's first few dozen tiles (128 multiplies per warpgroup, on the path to its
    // P V); a max that grows by 2^8 is rare once the first tile is in.
    auto tile_max = [&]<int NB>(float(&sv)[4 * NB], int koff, bool whole) -> bool {
      if (!whole) {
        const int kpos = key0 + tile * kKeys + koff + 2 * t;  // my column 0's key
        const uint8_t* ok = key_ok_s + stage * kKeys + koff + 2 * t;
#pragma unroll
        for (int i = 0; i < NB; ++i) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = 8 * i + (e & 1);
            const bool visible = ok[col] && kpos + col < (e < 2 ? count_lo : count_hi);
            sv[4 * i + e] = visible ? sv[4 * i + e] : kNegInf;
          }
        }
      }
      float bm_lo[NB], bm_hi[NB];  // block maxima, reduced as balanced trees
#pragma unroll
      for (int i = 0; i < NB; ++i) {
        bm_lo[i] = fmaxf(sv[4 * i], sv[4 * i + 1]);
        bm_hi[i] = fmaxf(sv[4 * i + 2], sv[4 * i + 3]);
      }
      float mx_lo = tree_max<NB>(bm_lo), mx_hi = tree_max<NB>(bm_hi);
#pragma unroll
      for (int x = 1; x <= 2; x <<= 1) {
        mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, x));
        mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, x));
      }
      if constexpr (NB == 4) {
        if (t == 0) {
          red_max[wg * kRows + row_lo] = mx_lo;
          red_max[wg * kRows + row_hi] = mx_hi;
        }
        named_barrier(1, kThreads);
        // Both warpgroups combine the two halves in the same order: the same m, bit for bit.
        mx_lo = fmaxf(red_max[row_lo], red_max[kRows + row_lo]);
        mx_hi = fmaxf(red_max[row_hi], red_max[kRows + row_hi]);
      }
      const float scale = a.score_scale_log2;
      mx_lo *= scale;
      mx_hi *= scale;
      // (m = -inf: any visible key moves it; none leaves it -inf.)
      const float mnew_lo = mx_lo > m_lo + kLazyRescale ? mx_lo : m_lo;
      const float mnew_hi = mx_hi > m_hi + kLazyRescale ? mx_hi : m_hi;
      const bool moved = mnew_lo != m_lo || mnew_hi != m_hi;
      // With no visible key yet (m = -inf) subtract 0 instead: -inf - -inf would be NaN.
      mref_lo = mnew_lo == kNegInf ? 0.0f : mnew_lo;
      mref_hi = mnew_hi == kNegInf ? 0.0f : mnew_hi;
      corr_lo = fast_exp2(m_lo - mref_lo);
      corr_hi = fast_exp2(m_hi - mref_hi);
      l_lo *= corr_lo;
      l_hi *= corr_hi;
      m_lo = mnew_lo;
      m_hi = mnew_hi;
      return moved;
    };
    // p of blocks [I0, I1) of sv (after tile_max), added to l and stored (rounded to T) into
    // the P panel, fenced for the wgmma reads.
    auto exp_store = [&]<int NB, int I0, int I1>(float(&sv)[4 * NB]) {
      const float scale = a.score_scale_log2;
#pragma unroll
      for (int i = I0; i < I1; ++i) {
        sv[4 * i] = fast_exp2(fmaf(sv[4 * i], scale, -mref_lo));
        sv[4 * i + 1] = fast_exp2(fmaf(sv[4 * i + 1], scale, -mref_lo));
        sv[4 * i + 2] = fast_exp2(fmaf(sv[4 * i + 2], scale, -mref_hi));
        sv[4 * i + 3] = fast_exp2(fmaf(sv[4 * i + 3], scale, -mref_hi));
        l_lo += sv[4 * i] + sv[4 * i + 1];
        l_hi += sv[4 * i + 2] + sv[4 * i + 3];
      }
      store_p<T, NB, I0, I1>(smem + kPOff, sv, wg, warp, g, t);
      fence_proxy_async();  // my P stores -> both warpgroups' wgmma reads
    };
    // Once the running maxima settle corr is 1 and the 128 multiplications change nothing
    // (2^0 is exactly 1; a row without keys yet has O = 0): a warp skips them when none of
    // its rows' max moved. Warp-uniform, so no divergence.
    auto rescale_o = [&](bool moved) {
      if (skip_rescale && !__any_sync(0xffffffffu, moved)) return;
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        o[4 * i] *= corr_lo;
        o[4 * i + 1] *= corr_lo;
        o[4 * i + 2] *= corr_hi;
        o[4 * i + 3] *= corr_hi;
      }
    };
    if constexpr (!kWideS) {
      float(&sh)[16] = *reinterpret_cast<float(*)[16]>(&s[0]);
      wgmma_fence();
      issue_s<T>(sh, q_s, kt, wg);
      wgmma_wait<0>();
      fence_regs(sh);
      const bool moved = tile_max.template operator()<4>(sh, kHalfKeys * wg, whole);
      exp_store.template operator()<4, 0, 4>(sh);
      rescale_o(moved);
      named_barrier(2, kThreads);  // both halves of P are in
      wgmma_fence();
      issue_pv<T>(o, p_s, kt, wg);
    } else {
      // The wide S: warpgroup 0 computes S and the softmax. With kParts = 2
      // (DecodeSm90Options::split_p) P goes out in two halves of 32 keys and both warpgroups
      // issue their P V of a half as soon as it is in, so the exponentials of keys 32-63 run
      // under the P V of keys 0-31.
      constexpr int kBlocks = 8 / kParts, kSteps = kKeys / 16 / kParts;
      if (wg == 0) {
        wgmma_fence();
        issue_s_wide<T>(s, q_s, kt);
        wgmma_wait<0>();
        fence_regs(s);
        const bool moved = tile_max.template operator()<8>(s, 0, whole);
        if (t == 0) {  // the rescale factors, for warpgroup 1 (red_max is free in this form)
          red_max[row_lo] = corr_lo;
          red_max[row_hi] = corr_hi;
        }
        unroll_n<kParts>([&]<int c>() {
          exp_store.template operator()<8, c * kBlocks, (c + 1) * kBlocks>(s);
          // (The sync also orders warpgroup 0's own warps: each wgmma reads all their P rows.)
          named_bar_sync<p_bar(c), kThreads>();
          if (c == 0) rescale_o(moved);
          wgmma_fence();
          issue_pv<T, c * kSteps, (c + 1) * kSteps>(o, p_s, kt, 0);
        });
      } else {
        unroll_n<kParts>([&]<int c>() {
          named_bar_sync<p_bar(c), kThreads>();
          if (c == 0) {  // warpgroup 0's factors for my rows
            corr_lo = red_max[row_lo];
            corr_hi = red_max[row_hi];
            rescale_o(corr_lo != 1.0f || corr_hi != 1.0f);
          }
          wgmma_fence();
          issue_pv<T, c * kSteps, (c + 1) * kSteps>(o, p_s, kt, 1);
        });
      }
    }
    wgmma_wait<0>();
    fence_regs(o);
  }
  cp_async_wait_all();

  // ---- finish: row sums of both warpgroups, normalise, write ----
  // With the wide S only warpgroup 0 tracks m; finish_rows takes the LSE from it alone.
  if constexpr (thin != 0) {
    finish_thin<T, thin>(a, work, out_row0, *reinterpret_cast<float(*)[2 * thin]>(&o[0]), wg, warp,
                         g, t, thin_m, thin_l, red_sum);
  } else
    finish_rows<T>(a, work, out_row0, o, wg, row_lo, t, {m_lo, m_hi}, l_lo, l_hi, red_sum,
                   smem + kKOff);
  if (tma && tid == 0) {  // every wait on full_bar of this piece is behind the barrier above
    mbar_inval(&full_bar[0]);
    mbar_inval(&full_bar[1]);
  }
#else
  (void)a, (void)work, (void)flags, (void)kmap;
  __trap();  // never launched without sm_90a code (decode_sm90_supports checks the binary)
#endif
}

// One piece per CTA (per-request schedule) or a worker's balanced share, one piece after
// the other.
// kWideS: DecodeSm90Options::wide_s; kParts: split_p (2) or not (1).
template <class T, bool kWideS, int kParts = 1>
__global__ void __launch_bounds__(kThreads, 1)
    decode_sm90_kernel(const DecodeArgs a, const KernelFlags flags,
                       const __grid_constant__ CUtensorMap kmap) {
  for_each_decode_work<kRows, kKeys>(
      a,
      [&](const DecodeWork& w) {
        // A request of at most 16 rows as a thin tile. Not the last rows of a longer request:
        // its thin piece outran the 64-row piece it runs in lockstep with, so the two stopped
        // sharing their key reads in L2 (uniform q 6, 64 + 8 rows: 682 -> 796 us on an H100).
        // (Thin pieces of 32 rows here too made ptxas serialise the wide tiles' wgmmas for want
        // of registers, C7511: they have a kernel of their own, below.)
        if (kWideS && w.row0 == 0 && w.nrows <= 16 && w.nrows <= flags.thin_rows)
          sm90_piece<T, kWideS, kWideS ? 16 : 0>(a, w, flags, kmap);
        else
          sm90_piece<T, kWideS, 0, kParts>(a, w, flags, kmap);
      },
      [&](const DecodeWork* cuts, int n) { merge_cut_pieces<T>(a, cuts, n); });
}

// Launches whose requests have 17-32 rows (KernelFlags::thin_rows): every piece as a thin tile
// of N = 32 rows.
template <class T, int N>
__global__ void __launch_bounds__(kThreads, 1)
    decode_sm90_thin_kernel(const DecodeArgs a, const KernelFlags flags,
                            const __grid_constant__ CUtensorMap kmap) {
  for_each_decode_work<kRows, kKeys>(
      a, [&](const DecodeWork& w) { sm90_piece<T, true, N>(a, w, flags, kmap); },
      [&](const DecodeWork* cuts, int n) { merge_cut_pieces<T>(a, cuts, n); });
}

// ---- building-block probe (decode_sm90_probe) -----------------------------------------
// One CTA of 256 threads: q and k rows through the kernel's tile layout, S through issue_s,
// P (rounded to T) through store_p, O through issue_pv; outputs in the accumulator mapping.
template <class T>
__global__ void __launch_bounds__(kThreads, 1)
    decode_sm90_probe_kernel(const T* q, const T* k, const float* p_in, float* s_out,
                             float* o_out) {
#if KMLA_SM90A
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_u32 = smem_u32(smem_raw);
  const uint32_t base = (raw_u32 + 1023u) & ~1023u;
  uint8_t* const smem = smem_raw + (base - raw_u32);
  const uint32_t q_s = base, kt = base + kTileBytes, p_s = base + 2 * kTileBytes;
  const int tid = threadIdx.x;
  const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  for (int i = tid; i < kRows * kRowChunks; i += kThreads) {
    const int row = i / kRowChunks, c = i % kRowChunks;
    cp_async16(q_s + tile_offset(row, c), q + row * kLatentDim + c * 8, true);
    cp_async16(kt + tile_offset(row, c), k + row * kLatentDim + c * 8, true);
  }
  cp_async_commit();
  cp_async_wait_all();
  fence_proxy_async();
  __syncthreads();

  float s[16];
  wgmma_fence();
  issue_s<T>(s, q_s, kt, wg);
  wgmma_wait<0>();
  fence_regs(s);
  float p[16];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = 16 * warp + g + 8 * (e >> 1), key = kHalfKeys * wg + 8 * i + 2 * t + (e & 1);
      s_out[row * kKeys + key] = s[4 * i + e];
      p[4 * i + e] = p_in[row * kKeys + key];
    }
  }
  store_p<T>(smem + 2 * kTileBytes, p, wg, warp, g, t);
  fence_proxy_async();
  __syncthreads();
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.0f;
  fence_regs(o);
  wgmma_fence();
  issue_pv<T>(o, p_s, kt, wg);
  wgmma_wait<0>();
  fence_regs(o);
#pragma unroll
  for (int i = 0; i < 32; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = 16 * warp + g + 8 * (e >> 1), col = kHalfCols * wg + 8 * i + 2 * t + (e & 1);
      o_out[row * kKvLoraRank + col] = o[4 * i + e];
    }
  }
#else
  (void)q, (void)k, (void)p_in, (void)s_out, (void)o_out;
  __trap();
#endif
}

// Whether the wgmma kernel can run on `device` (sm90a_kernel_runs_on, asked once per device).
bool sm90_kernel_runs_on(int device) {
  static std::atomic<int> answers[kMaxSm90Devices] = {};
  return sm90a_kernel_runs_on(
      device, reinterpret_cast<const void*>(decode_sm90_kernel<bf16, false>), answers);
}

// The options of every launch: the environment's (read on first use), or a test's.
DecodeSm90Options& current_options() {
  static DecodeSm90Options opt = [] {
    DecodeSm90Options o;
    o.skip_rescale = env_switch("KMLA_DECODE_SM90_SKIP_RESCALE", o.skip_rescale);
    o.tma = env_switch("KMLA_DECODE_SM90_TMA", o.tma);
    o.wide_s = env_switch("KMLA_DECODE_SM90_WIDE_S", o.wide_s);
    o.issue_wg1 = env_switch("KMLA_DECODE_SM90_ISSUE_WG1", o.issue_wg1);
    o.early_issue = env_switch("KMLA_DECODE_SM90_EARLY_ISSUE", o.early_issue);
    o.one_copy = env_switch("KMLA_DECODE_SM90_ONE_COPY", o.one_copy);
    o.split_p = env_switch("KMLA_DECODE_SM90_SPLIT_P", o.split_p);
    o.min_rows = env_int_in("KMLA_DECODE_SM90_MIN_ROWS", o.min_rows, 0, kRows - 1);
    o.thin_rows = env_int_in("KMLA_DECODE_SM90_THIN_ROWS", o.thin_rows, 0, 32);
    o.small_min_requests =
        env_int_in("KMLA_DECODE_SM90_SMALL_REQUESTS", o.small_min_requests, 0, 1 << 30);
    o.small_max_keys =
        env_int_in("KMLA_DECODE_SM90_SMALL_MAX_KEYS", int(o.small_max_keys), 0, 1 << 30);
    return o;
  }();
  return opt;
}

// KMLA_DECODE_SM90_PROFILE=compute|loads (read once): timing only, the results are wrong.
// "compute" stops loading keys after the first two tiles, "loads" skips the MMAs and the
// softmax, so the two timings bound what the compute and the copies each take per tile.
int profile_mode() {
  static const int mode = [] {
    const char* env = std::getenv("KMLA_DECODE_SM90_PROFILE");
    if (env == nullptr || *env == '\0') return 0;
    if (std::strcmp(env, "compute") == 0) return 1;
    if (std::strcmp(env, "loads") == 0) return 2;
    KMLA_CHECK(false, "KMLA_DECODE_SM90_PROFILE must be compute or loads, got '", env, "'");
    return 0;
  }();
  return mode;
}

// The key-group size of the TMA copies for this cache: the largest of 64 (a tile), 32, 16, 8
// keys that divides the block size (a group then never crosses a block), 0 if none does
// (cp.async).
int tma_group_keys(int block_size) {
  for (int g = kKeys; g >= 8; g /= 2)
    if (block_size % g == 0) return g;
  return 0;
}

// The paged cache as a 4-D tensor of T, dims (outermost first) [num_blocks][9 panels]
// [block_size][64 columns] with strides block_stride (from the caller), 128 B (a panel's
// columns) and 1152 B (a row), read in boxes of `group` rows x 64 columns x `panels` panels
// (1, or all 9 with one_copy) into 128-byte-swizzled panels: a box lands as the stage's
// [panel][row][64] layout. Encoded on the host for every launch (no device work, graph
// safe). False if the driver cannot encode it (a caller-owned cache of unusual geometry, an
// old driver): the launch then takes cp.async, which is slower but computes the same.
bool cache_tensor_map(const DecodeArgs& a, DType act, int group, int panels, CUtensorMap& map) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[4] = {cuuint64_t(kPanelElems), cuuint64_t(a.block_size),
                              cuuint64_t(kPanels), cuuint64_t(a.num_blocks)};
  const cuuint64_t strides[3] = {cuuint64_t(kRowBytes), cuuint64_t(kPanelRowBytes),
                                 cuuint64_t(a.block_stride)};
  const cuuint32_t box[4] = {cuuint32_t(kPanelElems), cuuint32_t(group), cuuint32_t(panels), 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUresult r = encode(
      &map, act == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      4, const_cast<std::byte*>(a.cache_base), dims, strides, box, elem_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

// The key-group size the launch copies with (0: cp.async), and the tensor map for it;
// one_copy: its boxes hold whole tiles (64-key groups and DecodeSm90Options::one_copy).
int tma_keys_for(const DecodeArgs& a, DType act, CUtensorMap& map, bool& one_copy) {
  const DecodeSm90Options& o = current_options();
  const int group = o.tma && a.num_blocks > 0 ? tma_group_keys(a.block_size) : 0;
  one_copy = group == kKeys && o.one_copy;
  if (group > 0 && cache_tensor_map(a, act, group, one_copy ? kPanels : 1, map)) return group;
  one_copy = false;
  return 0;
}

}  // namespace

int decode_sm90_tma_keys(const DecodeParams& p, bool* one_copy) {
  DecodeArgs a{};
  a.cache_base = p.cache.base;
  a.block_stride = p.cache.block_stride;
  a.num_blocks = p.cache.num_blocks;
  a.block_size = p.cache.block_size;
  a.block_shift = decode_block_shift(p.cache.block_size);
  CUtensorMap map{};
  bool one = false;
  const int group = tma_keys_for(a, p.act, map, one);
  if (one_copy != nullptr) *one_copy = one;
  return group;
}

DecodeSm90Options decode_sm90_options() { return current_options(); }
void decode_sm90_set_options(const DecodeSm90Options& o) { current_options() = o; }

bool decode_sm90_supports(const DecodeParams& p, const DecodePlan& plan) {
  if (plan.portable || plan.batch_invariant || plan.rows_per_cta != kRows) return false;
  // Fewer than 64 rows take a 64-row plan too (plan_decode, decode_sm90_takes_rows): a thin
  // tile at 32 rows or fewer, else a 64-row one whose missing rows are masked.
  const CacheFormat f = p.cache.format;
  if (p.q_fp8 || !(f == CacheFormat::bf16 || f == CacheFormat::fp16)) return false;
  int device = 0;
  KMLA_CUDA_CHECK(cudaGetDevice(&device));
  return sm90_kernel_runs_on(device);
}

int64_t decode_sm90_small_max_keys() {
  int device = 0, sms = 0, mem_khz = 0, bus_bits = 0;
  KMLA_CUDA_CHECK(cudaGetDevice(&device));
  KMLA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  KMLA_CUDA_CHECK(cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, device));
  KMLA_CUDA_CHECK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device));
  // Peak DRAM bytes per second (double data rate) per SM.
  const double per_sm = 2.0 * mem_khz * 1e3 * bus_bits / 8.0 / std::max(sms, 1);
  return per_sm > 30e9 ? current_options().small_max_keys : std::numeric_limits<int64_t>::max();
}

bool decode_sm90_takes_rows(int rows, int num_requests, int64_t max_seq_len, CacheFormat format,
                            bool portable) {
  const DecodeSm90Options& o = current_options();
  const bool small_batch_ok = o.small_min_requests > 0 && num_requests >= o.small_min_requests &&
                              decode_sm90_thin_tile(rows) != 0 &&
                              max_seq_len <= decode_sm90_small_max_keys();
  if (portable || (rows <= o.min_rows && !small_batch_ok)) return false;
  if (!(format == CacheFormat::bf16 || format == CacheFormat::fp16)) return false;
  int device = 0;
  KMLA_CUDA_CHECK(cudaGetDevice(&device));
  return sm90_kernel_runs_on(device);
}

int decode_sm90_thin_tile(int max_rows) {
  return max_rows > current_options().thin_rows ? 0 : max_rows <= 16 ? 16 : 32;
}

void launch_decode_sm90(DecodeArgs& a, DType act, dim3 grid, cudaStream_t stream) {
  dispatch_act(act, [&]<class T>() {
    const DecodeSm90Options& o = current_options();
    CUtensorMap kmap{};
    bool one_copy = false;
    const int group = tma_keys_for(a, act, kmap, one_copy);
    auto* kernel = !o.wide_s   ? decode_sm90_kernel<T, false>
                   : o.split_p ? decode_sm90_kernel<T, true, 2>
                               : decode_sm90_kernel<T, true, 1>;
    if (decode_sm90_thin_tile(a.max_rows) == 32) kernel = decode_sm90_thin_kernel<T, 32>;
    // A host-side attribute (no sync, allowed during graph capture), set on every launch so
    // that it holds on whichever device is current.
    KMLA_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemAlloc));
    launch_split_kernel(kernel, grid, kThreads, kSmemAlloc, stream, a,
                        KernelFlags{o.skip_rescale, profile_mode(), group, one_copy, o.issue_wg1,
                                    o.early_issue, o.thin_rows},
                        kmap);
  });
}

void decode_sm90_probe(DType act, const void* q, const void* k, const float* p, float* s_out,
                       float* o_out, cudaStream_t stream) {
  KMLA_CHECK(act == DType::bf16 || act == DType::f16,
             "decode_sm90_probe: act must be bf16 or f16, got ", dtype_name(act));
  dispatch_act(act, [&]<class T>() {
    auto* kernel = decode_sm90_probe_kernel<T>;
    KMLA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         kProbeSmemAlloc));
    kernel<<<1, kThreads, kProbeSmemAlloc, stream>>>(static_cast<const T*>(q),
                                                     static_cast<const T*>(k), p, s_out, o_out);
    KMLA_LAUNCH_CHECK();
  });
}

}  // namespace kmla::cuda
