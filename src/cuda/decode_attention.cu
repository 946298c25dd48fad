// Absorbed-MQA decode over the paged latent cache: split-KV flash decoding on the tensor
// cores (mma.sync m16n8k16 + ldmatrix + cp.async), plus the LSE combine of the splits.
//
// One CTA handles one or more pieces of work, each a tile of ROWS (token, head) query rows
// of one request against a range of its keys (decode_sched.cuh schedules them). The same
// code runs on sm_80 and sm_90a: mma.sync, ldmatrix and cp.async exist on both. On GPUs
// with ~210 KB of shared memory per block (Hopper) the 16-row tiles can run a deep pipeline
// (5 or 7 stages, one CTA per SM; DecodePlan::deep_pipeline, off by default: measured
// slower) that does not fit sm_80's 163 KB. Over a 16-bit cache the 16-row kernel runs in
// its warp-own form by default: each warp copies and waits for only the key columns it reads
// (DecodePlan::row16_warp_own). docs/decode_sm90.md describes the pipeline, budgets and split
// policies.
//
// Numerics (docs/SEMANTICS.md, rule 6): q and the cache rows are converted to the
// activation type T exactly (16-bit cache of type T as is; e4m3 codes are exact in bf16 and
// f16; fp8_ds_mla as bf16(code * tile_scale), then T). S = Q K^T accumulates in fp32; the
// plain-fp8 scales (q_scale, k_scale) are folded into the fp32 score scale and into the
// fp32 output scale, so the 16-bit mma on the codes equals an fp8 mma with fp32
// accumulation. The softmax is fp32 (online, base 2). P is rounded to T for the P V mma
// (the usual flash-attention choice; the row sum l uses the unrounded fp32 p). The output
// is rounded to T once: directly when there is one split, else in the combine kernel from
// fp32 partials (batch-invariant plans always combine; for one split that is the same
// arithmetic: weight exp(0) = 1, total 1).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string_view>

#include "cuda/attention.cuh"
#include "cuda/decode_args.cuh"
#include "cuda/decode_combine.cuh"
#include "cuda/decode_sched.cuh"
#include "cuda/decode_sm90.cuh"
#include "cuda/sm90.cuh"
#include "kmla/config.hpp"

namespace kmla::cuda {

namespace {

constexpr int kKeyTile = 32;                // keys per pipeline stage
constexpr int kStages = 2;                  // cp.async stages of key tiles (two CTAs per SM)
// The deep pipeline (Hopper, 16-row tiles, one CTA per SM): 16-bit cache 5 stages of
// 36,864 B (4 tiles = 147 KB in flight while one is computed); fp8 formats 7 raw stages
// of 18,432 / 20,992 B (6 = 110 / 126 KB in flight). See smem_plan for the totals.
constexpr int kDeepStages16 = 5;
constexpr int kDeepStagesFp8 = 7;
constexpr int kRowBytes = kLatentDim * 2;   // one 576-wide row in T: 1152 B
constexpr int kRowChunks = kRowBytes / 16;  // 72 chunks of 16 B
constexpr int kPStride = kKeyTile + 8;      // P row stride (elements): 80 B, conflict-free
// 16-row kernels: a warp's partial S tile [16][32] fp32 is stored with rows of 40 floats,
// so each half-warp's float2 stores and loads (rows g = 0..3 or 4..7, 8 B at 8 g + 2 t)
// cover all 32 banks once.
constexpr int kSPartStride = kKeyTile + 8;
constexpr int kDepthSteps = kLatentDim / 16 / 4;  // k-steps of S per warp (depth split): 9
constexpr int kMinKeysPerSplit = 256;       // below this a split is mostly overhead
constexpr int kDsMlaEntryBytes = 656;       // 512 e4m3 | 4 fp32 scales | 64 bf16 rope
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---- shared-memory plan ----------------------------------------------------------
// Byte offsets inside the dynamic shared memory of one CTA. raw_entry_bytes is 0 for a
// 16-bit cache (tiles are copied straight into the T layout, `stages` of them) and the fp8
// entry size (576 or 656) otherwise (`stages` raw tiles + one converted T tile).
//   rows = 16: Q 18,432 + tiles 73,728 + P 1,280 + flags 64 + reductions 512 = 94,016 B
//   rows = 64: Q 73,728 + tiles 73,728 + P 5,120 + flags 64 + reductions 2,048 = 154,688 B
//   rows = 64, fp8_ds_mla: Q 73,728 + T tile 36,864 + raw 41,984 + ... = 159,808 B
//   deep, rows 16: Q 18,432 + 5 tiles 184,320 + 1,280 + 160 + 512 + 10,240 = 214,944 B
//   deep, rows 16, fp8_ds_mla: Q 18,432 + T 36,864 + 7 raw 146,944 + 1,280 + 224 + 512
//     + 10,240 = 214,496 B (plain fp8: 196,576 B)
// (sm_80 allows 166,912 B per block; H200 (228 KB per SM, 1 KB reserved per CTA) fits two
// 2-stage rows-16 CTAs per SM, or one deep one: 227 KB per block.)
// The fp8 formats' 16-row 2-stage kernels take the register-fragment path (decode_fp8_tiles):
// kFp8Stages raw tiles in flight instead of 2, raw rows padded to a stride that is 64 bytes
// past a multiple of 128 (plain fp8: 576 as is; fp8_ds_mla: 656 -> 704), partial S tiles
// [4 warps][4 n-tiles][32 lanes] float4 = 8 KB.
// Two CTAs per SM (DecodePlan::fp8_ctas_per_sm = 2, the default), kFp8Stages raw stages:
//   plain fp8: 4 x 32 x 576 = 73,728 + flags 128 + S 8,192 = 82,048 B
//   fp8_ds_mla: 4 x 32 x 704 = 90,112 + 128 + 8,192 = 98,432 B
// (H200: 2 x (98,432 + 1,024 reserved) <= 233,472; the rows-16 bf16 kernel, 94,016 B, also
// fits two.) Three CTAs per SM (fp8_ctas_per_sm = 3; fp8_ds_mla, bf16 activations: the
// default where it fits) leave each CTA 233,472 / 3 - 1,024 = 76,800 B, so
// kFp8StagesThreeCtas raw stages:
//   fp8_ds_mla: 3 x 22,528 = 67,584 + 96 + 8,192 = 75,872 B (3 x 76,896 = 230,688 B per SM)
// and 65,536 / (3 x 128 threads) = 170, i.e. 168 registers per thread (allocated in steps
// of 8); decode_fp8_tiles says how its kThreeCtas form fits them. (Plain fp8 at three CTAs,
// 63,584 B, measured slower and was dropped.)
constexpr int kFp8Stages = 4;
constexpr int kFp8StagesThreeCtas = 3;
constexpr int kFp8SPartBytes = 4 * 4 * 32 * 16;
__host__ __device__ constexpr int fp8_raw_stride(int entry_bytes) {
  return entry_bytes == kLatentDim ? kLatentDim : 704;
}
__host__ __device__ constexpr bool fp8_fragment_path(int rows, int raw_entry_bytes, int stages) {
  return rows == 16 && raw_entry_bytes != 0 && stages == kStages;
}
// The fragment-path kernels (decode_fp8_tiles). kFp8Generic reads the format at run time and
// runs T mma: plain fp8 as is, fp8_ds_mla with the split sum. It serves f16 activations,
// KMLA_FP8_DECODE=bf16mma and amax-scaled fp8_ds_mla under bf16 at two CTAs per SM. The
// others are bf16-activation kernels of one format: plain fp8 on f16 mma (kF16Mma);
// fp8_ds_mla with the scales folded into S and P on f16 mma (kFoldScale, power-of-two
// scales) at two or three CTAs per SM, and without (amax scales) at three.
enum Fp8Kernel : int {
  kFp8Generic = 0,
  kFp8PlainF16 = 1,
  kFp8DsMla = 2,
  kFp8DsMlaF16 = 3,   // fp8_ds_mla with decode_fp8_tiles' kFoldScale (on f16 mma)
  kFp8ThreeCtas = 4,  // flag: three CTAs per SM (decode_fp8_tiles' kThreeCtas)
};
__host__ __device__ constexpr int fp8_stages(int fp8_kernel) {
  return fp8_kernel & kFp8ThreeCtas ? kFp8StagesThreeCtas : kFp8Stages;
}

struct SmemPlan {
  int q = 0, tiles = 0, raw = 0, p = 0, key_ok = 0, red_max = 0, red_sum = 0, s_part = 0,
      total = 0;
};

// fp8_raw_stages: the fragment path's raw stages (kFp8Stages or kFp8StagesThreeCtas).
__host__ __device__ constexpr SmemPlan smem_plan(int rows, int raw_entry_bytes, int stages,
                                                 int fp8_raw_stages = kFp8Stages) {
  SmemPlan s;
  int off = 0;
  if (fp8_fragment_path(rows, raw_entry_bytes, stages)) {
    // Raw stages, their key flags and the partial S tiles; Q lives in registers and there
    // is no converted tile and no P tile (see decode_fp8_tiles).
    s.raw = off;
    off += fp8_raw_stages * kKeyTile * fp8_raw_stride(raw_entry_bytes);
    s.key_ok = off;
    off += fp8_raw_stages * kKeyTile;
    off = (off + 15) / 16 * 16;
    s.s_part = off;
    off += kFp8SPartBytes;
    s.total = off;
    return s;
  }
  s.q = off;
  off += rows * kRowBytes;  // Q [rows][576] T, swizzled
  s.tiles = off;
  off += (raw_entry_bytes ? 1 : stages) * kKeyTile * kRowBytes;  // K=V tiles [32][576] T
  s.raw = off;
  off += raw_entry_bytes ? stages * kKeyTile * raw_entry_bytes : 0;  // raw fp8 rows
  s.p = off;
  off += rows * kPStride * 2;  // P [rows][32 (+8 pad)] T
  s.key_ok = off;
  off += stages * kKeyTile;  // per stage: key loaded (inside the split, good block id)
  s.red_max = off;
  off += rows * 4 * 4;  // [row group][key slice][16] fp32 partial row maxima
  s.red_sum = off;
  off += rows * 4 * 4;  // same for the final row sums
  off = (off + 15) / 16 * 16;
  s.s_part = off;
  // [slice][16][32 (+8)] fp32 partial S: the deep 16-row kernels' depth-split S only
  off += rows == 16 && stages > kStages ? 4 * 16 * kSPartStride * 4 : 0;
  s.total = off;
  return s;
}

// ---- small device helpers -----------------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}

// 16-byte async copy; when !valid nothing is read and the destination is zero-filled.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}
// A key-stream copy (the 16-bit key loaders below): the same with the 256-byte L2
// prefetch-size hint (a miss fetches the aligned 256 bytes around the chunk from DRAM, not
// only the sectors asked for) and the evict_first policy (the stream's lines go before any
// other when L2 needs room). On the H200 the hint made the 2-stage 16-row kernel 1.0-1.6 %
// faster on every long stream and block size (e.g. (128, 12, 8k) 332.9 / 332.4 -> 329.3 /
// 328.9 us, alternated), where L2 was the busiest unit (91.5 %) with DRAM at 78 %. evict_first on
// the H100 (2026-12-05, alternated): (128, 12, 8k) 421.1 / 421.9 -> 418.4 / 419.0 us, (128, 16, 4k)
// 224.1 / 223.0 -> 220.4 / 221.2, mixed lengths 426.2 / 425.4 -> 414.5 / 414.6, the K3 layer step
// 475.7 / 476.2 -> 473.8 / 474.6. (A request's second row tile, when it has one, reads the same
// keys right after the first in the pass order; evict_first gives up that L2 reuse.)
__device__ __forceinline__ void cp_async16_stream(uint32_t dst, const void* src, bool valid) {
  asm volatile(
      "cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;\n" ::"r"(dst),
      "l"(src), "r"(valid ? 16 : 0), "l"(l2_evict_first_policy()));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a (16x16, row) * b (16x8, col), fp32 accumulate.
template <class T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  if constexpr (std::is_same_v<T, bf16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// 2 e4m3 codes (low 16 bits) -> 2 T, packed, exact. For bf16 the fp32 form of an e4m3
// value has at most 3 mantissa bits, so its top 16 bits are the bf16 (NaN stays NaN).
template <class T>
__device__ __forceinline__ uint32_t e4m3x2_to_act(uint32_t codes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(codes), __NV_E4M3);
  if constexpr (std::is_same_v<T, fp16>) {
    return uint32_t(h.x) | (uint32_t(h.y) << 16);
  } else {
    const float2 f = __half22float2(__half2(h));
    return __byte_perm(__float_as_uint(f.x), __float_as_uint(f.y), 0x7632);
  }
}

// 2 fp8_ds_mla codes of one key (low 16 bits) with its group scale -> 2 T:
// bf16(code * scale), then T.
template <class T>
__device__ __forceinline__ uint32_t e4m3x2_scaled_to_act(uint32_t codes, float scale) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(codes), __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  if constexpr (std::is_same_v<T, bf16>) {
    const __nv_bfloat162 b = __floats2bfloat162_rn(f.x * scale, f.y * scale);
    return reinterpret_cast<const uint32_t&>(b);
  } else {
    return pack2<fp16>(round_to<bf16>(f.x * scale), round_to<bf16>(f.y * scale));
  }
}

// 4 e4m3 codes -> 4 T (the conversion pass's form: two pairs as above; for bf16 the top
// halves of the floats are taken by a byte permute, not a packing cvt: one conversion-unit op
// fewer per pair).
template <class T>
__device__ __forceinline__ uint2 e4m3x4_to_act(uint32_t codes) {
  return make_uint2(e4m3x2_to_act<T>(codes), e4m3x2_to_act<T>(codes >> 16));
}

// 8 e4m3 codes -> 8 T (the fp8 queries).
template <class T>
__device__ __forceinline__ uint4 e4m3x8_to_act(uint2 codes) {
  const uint2 lo = e4m3x4_to_act<T>(codes.x), hi = e4m3x4_to_act<T>(codes.y);
  return make_uint4(lo.x, lo.y, hi.x, hi.y);
}

// 4 fp8_ds_mla codes -> 4 T (two pairs as above).
template <class T>
__device__ __forceinline__ uint2 e4m3x4_scaled_to_act(uint32_t codes, float scale) {
  return make_uint2(e4m3x2_scaled_to_act<T>(codes, scale),
                    e4m3x2_scaled_to_act<T>(codes >> 16, scale));
}

// 8 bf16 -> 8 T.
template <class T>
__device__ __forceinline__ uint4 bf16x8_to_act(uint4 v) {
  if constexpr (std::is_same_v<T, bf16>) {
    return v;
  } else {
    uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float lo = __uint_as_float(w[i] << 16), hi = __uint_as_float(w[i] & 0xFFFF0000u);
      w[i] = pack2<fp16>(lo, hi);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Byte offset of 16-byte chunk c of row `row` in a [*][576] T tile. XOR-ing the chunk's
// low three bits with the row's keeps every ldmatrix phase (8 rows, one chunk column)
// on eight distinct bank groups; 72 chunks = 9 groups of 8, so a chunk stays in its row.
__device__ __forceinline__ uint32_t swz(int row, int c) {
  return uint32_t(row * kRowBytes + ((c ^ (row & 7)) << 4));
}

// ---- fp8 caches, 16 rows: raw tiles straight into mma fragments -----------------------
// The general path converts every raw fp8 tile into a T tile in shared memory (one more
// barrier, 37 KB written and read again) and re-reads Q from shared memory for every tile.
// Here the 4 warps read the raw e4m3 bytes with 16-byte shared loads laid out so that each
// thread gets exactly the codes of its own mma B fragments, convert them in registers once,
// and keep Q in registers:
//   S:   depth split. Warp w owns 9 of the 36 k-steps for all 32 keys: the 8 k-steps of
//        code columns [128 w, 128 w + 128) (two blocks of 64) plus k-step w of the last 64
//        columns. Its Q fragments are 36 registers loaded once; 4 independent mma chains
//        of 9. The 4 partial S tiles meet in shared memory (8 KB) and every warp adds all
//        four (in warp order, so all warps hold the bitwise same S for all 32 keys).
//   softmax: every warp computes the full 32-key softmax itself (16 exp2 per thread), so
//        the row maxima need no exchange and P never goes through shared memory: the S
//        accumulators of n-tiles 2k and 2k + 1 are the A fragment of P V k-step k.
//   P V: warp w owns output columns [128 w, 128 w + 128): the very columns whose codes it
//        converted for S. An S B fragment is an 8 x 8 matrix [key][column]; one movmatrix
//        (transpose) turns it into the P V B fragment [key][column] of the same 8 keys and
//        8 columns, so V costs no shared-memory load and no second conversion.
// Two barriers per tile (tile in / stage free, and the partial S tiles) instead of five.
// Per thread and tile: 8 x 16-byte + 4 x 4-byte shared loads, 144 codes converted, 36 + 32
// mma, 64 movmatrix, 4 + 16 16-byte accesses of the partial S tiles.
//
// Depth permutation. The m16n8k16 B fragment of thread (g = lane / 4, t = lane % 4) holds
// k-indices {2t, 2t + 1} (b0) and {2t + 8, 2t + 9} (b1) of key g. A k-step may take any 16
// depth columns in any order as long as Q uses the same ones, so in a block of 64 code
// columns k-step s of thread t takes columns 16 t + 4 s + {0, 1} (b0) and + {2, 3} (b1):
// the 16 codes thread t needs for the block's 4 k-steps are one aligned 16-byte chunk. The
// Q fragments are gathered from global memory in the same order (fp8_ds_mla's last 64
// columns are bf16 RoPE values and keep the usual order).
//
// Bank conflicts. Raw rows sit 576 or 704 bytes apart (64 mod 128), so an odd key shifts
// the bank slot (16-byte unit mod 8) by 4. Chunk c of tile key k is stored at position
// c ^ h(k) inside its aligned group of 8 chunks (the 4-chunk tail of a plain row: c ^ (h & 3);
// fp8_ds_mla puts its 8 RoPE chunks at 32..39 and its scale chunk at 40 + ((k >> 1) & 3)),
// with h(k) = 2 ((k >> 1) & 3) ^ ((k >> 2) & 1): h(k) ^ 4 (k & 1) takes 8 distinct values
// over k & 7. Every 8-lane phase of the code loads (keys 2j, 2j + 1, one chunk per t) and
// the RoPE and scale words then hit distinct slots; only the plain format's last block
// (one 4-byte word per thread at the same offset in all 32 lanes) is a 4-way conflict.
//
// Registers (sm_90a, 128 threads, 2 CTAs per SM: up to 255): 64 accumulators + 64
// converted codes (live from S to P V) + 36 Q + 16 S + addressing.
//
// Numerics as in the general path: the same exact T values of the codes (fp8_ds_mla:
// bf16(code * scale), then T) and the same fp32 softmax; only the order of the fp32
// additions inside S differs (4 partial sums of 9 k-steps, added in warp order).
__device__ __forceinline__ int fp8_swz_h(int key) {
  return (((key >> 1) & 3) << 1) ^ ((key >> 2) & 1);
}

// 2^c as a float, c in [-126, 127].
__device__ __forceinline__ float pow2i(int c) { return __uint_as_float(uint32_t(127 + c) << 23); }

// The exponent c of fp8_ds_mla's f16 P' (decode_fp8_tiles, kFoldScale) of a row whose largest
// p * scale so far is `big` (>= 0): kept while big * 2^c stays in [1, 2^15] and the row is
// not being rescaled anyway, else set to put big * 2^c in [2^7, 2^8), within [-100, 100]
// so that 2^c and 2^-c stay normal floats. big = 0 (no visible key yet) keeps c.
__device__ __forceinline__ int ds_p_exponent(float big, int c, bool rescaling) {
  const int e = int(__float_as_uint(big) >> 23) - 127;  // big in [2^e, 2^(e + 1))
  if (!(big > 0.0f) || (!rescaling && e + c >= 0 && e + c <= 14)) return c;
  return min(100, max(-100, 7 - e));
}

// 2 bf16 (packed) -> 2 T.
template <class T>
__device__ __forceinline__ uint32_t bf16x2_to_act(uint32_t v) {
  if constexpr (std::is_same_v<T, bf16>) {
    return v;
  } else {
    return pack2<fp16>(__uint_as_float(v << 16), __uint_as_float(v & 0xFFFF0000u));
  }
}

// Transposes the 8 x 8 16-bit matrix held as one mma fragment register per thread (thread
// lane: row lane / 4, columns 2 (lane % 4) + {0, 1}).
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// The online-softmax step of a warp's 16 x 32 score fragment (mma C layout: s[n][0..1] in row
// g, s[n][2..3] in row g + 8, keys 8 n + 2 tq + i): mx_lo / mx_hi are this lane's maxima of
// its masked, scaled scores. Takes the rows' maxima over the quad, moves the running max m,
// turns the scores into p = 2^(s - m) and adds them to l; returns the factor (corr_lo,
// corr_hi) by which the output accumulators must be scaled.
__device__ __forceinline__ float2 softmax_fragment_step(float (&s)[4][4], float mx_lo, float mx_hi,
                                                        float& m_lo, float& m_hi, float& l_lo,
                                                        float& l_hi) {
#pragma unroll
  for (int o = 1; o <= 2; o <<= 1) {
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, o));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, o));
  }
  const float mnew_lo = fmaxf(m_lo, mx_lo), mnew_hi = fmaxf(m_hi, mx_hi);
  // With no visible key yet (m = -inf) subtract 0 instead: -inf - -inf would be NaN.
  const float mref_lo = mnew_lo == kNegInf ? 0.0f : mnew_lo;
  const float mref_hi = mnew_hi == kNegInf ? 0.0f : mnew_hi;
  const float corr_lo = fast_exp2(m_lo - mref_lo), corr_hi = fast_exp2(m_hi - mref_hi);
  m_lo = mnew_lo;
  m_hi = mnew_hi;
  l_lo *= corr_lo;
  l_hi *= corr_hi;
#pragma unroll
  for (int n = 0; n < 4; ++n) {
    s[n][0] = fast_exp2(s[n][0] - mref_lo);
    s[n][1] = fast_exp2(s[n][1] - mref_lo);
    s[n][2] = fast_exp2(s[n][2] - mref_hi);
    s[n][3] = fast_exp2(s[n][3] - mref_hi);
    l_lo += s[n][0] + s[n][1];
    l_hi += s[n][2] + s[n][3];
  }
  return make_float2(corr_lo, corr_hi);
}

// One piece of 16 rows over keys [work.key0, work.key1) (ntiles tiles) of request work.r.
// kF16Mma (plain fp8, bf16 activations; the default there, KMLA_FP8_DECODE=bf16mma turns it
// off): both mma run on f16 operands, so a pair of codes costs one conversion instead of
// four. Q is scaled per row by a power of two 2^(14 - e) (e: exponent of the row's largest
// |q|) into f16, exact for every element within 2^-28 of that maximum (bf16's 8-bit
// significand fits f16's 11 bits); the scale comes back in the fp32 score scale. P is
// rounded to bf16 as in the bf16 mma and stored times 2^12 (exact in f16 down to p = 2^-26),
// taken out with 1 / l.
//
// kSplitSum (fp8_ds_mla): each warp adds up one n-tile of the partial S tiles and the totals
// are exchanged (see below). Measured on H200 (128, 12, 8k): fp8_ds_mla 340.1 against 350.4
// us, plain fp8 276.7 against 256.7 (slower there, so plain fp8 does not use it).
//
// kThreeCtas: three CTAs per SM (12 warps to hide the latency of the mma chains, the
// barriers and the exp2 instead of 8), kFp8StagesThreeCtas raw stages and at most 168
// registers (see smem_plan). Keeping the 64 converted codes from S to P V does not fit: ptxas
// spilled 260-290 bytes per thread with them. So P V reads its 8 raw 16-byte chunks again
// (the tile is still in its stage) and converts them a second time, just before each mma:
// live across the barriers are then the 64 accumulators, 36 Q registers and the S tile.
// Arithmetic (values, sums and their order) is the same as with two CTAs.
//
// kFoldScale (fp8_ds_mla, power-of-two scales, bf16 activations; always with kF16Mma):
// warp w's 8 code k-steps are exactly scale group w (columns [128 w, 128 w + 128)), and so
// are its P V output columns, so the group scale is one number per key there and the codes
// convert without it, to f16 with one cvt per pair as plain fp8 (the bf16 path paid a cvt,
// two f16 -> f32, two multiplies and a rounding pack per pair).
//   S: the 8 code k-steps run on f16 with Q scaled per row by 2^a into f16 as above (the
//     row maximum is over all 576 columns); the partial S column of key k is multiplied by
//     scale[k][w]; then the RoPE k-step, a bf16 mma with the same Q rows times 2^a in bf16
//     (exact: bf16 has fp32's exponent range), is added; 2^-a goes into the fp32 score
//     scale. With power-of-two scales this is the reference S over bf16(code * scale) =
//     code * scale and bf16 Q up to the fp32 summation order, for every Q element within
//     2^-28 of the row maximum (smaller ones may lose bits in f16: the kF16Mma argument).
//     (Amax-rule scales are not folded: there bf16(code * scale) != code * scale, and with
//     large logits that moved the LSE by more than the tests' 1e-3.)
//   P V: A = P'_k = bf16(p_k * scale[k][w]) * 2^c in f16, V the exact f16 codes. bf16 has 8
//     significant bits and f16 11, so P' is the exact bf16(p_k) * scale * 2^c while it is
//     a normal f16 (>= 2^-14) and <= 65504. c is per row and warp: B = the largest
//     p_k * scale[k][w] the row has seen (running, times the softmax correction like l);
//     c keeps B * 2^c in [1, 2^15] (P' <= 2^15 (1 + 2^-8)) and is set to put it in
//     [2^7, 2^8) when it leaves that window or the correction rescales the row anyway, the
//     accumulators taking 2^(c_new - c_old) with the correction. A P' below f16's normal
//     range (2^-14) is then under 2^-14 of B * 2^c >= 1 and loses at most 2^-25 absolute
//     (half the subnormal step), 2^-25 of B: far below the bf16 rounding of p (2^-9
//     relative) that every path has. The output takes 2^-c with 1 / l.
// Per thread and tile: 64 pairs converted with 1 instruction instead of 6 (128 at three
// CTAs), 8 scale loads, and ~100 instructions for P' (p * scale, its row maximum with 4
// shuffles, the c update, times 2^c, the bf16 rounding and the f16 packing). Measured on
// H200 (2026-12-03, (128, 12, 8k)): 310.8 us at three CTAs against 326.2 for the same fold
// on bf16 mma (322.1 at two CTAs).
template <class T, bool kPlain, bool kF16Mma, bool kSplitSum, bool kThreeCtas, bool kFoldScale,
          int kRawStages, class KeyCount>
__device__ __forceinline__ void decode_fp8_tiles(const DecodeArgs& a, std::byte* smem,
                                                 const DecodeWork& work, int ntiles,
                                                 KeyCount key_count) {
  const int r = work.r, row0 = work.row0, nrows = work.nrows, key0 = work.key0, key1 = work.key1;
  static_assert(!kF16Mma || (std::is_same_v<T, bf16> && (kPlain || kFoldScale)));
  static_assert(!kFoldScale || (!kPlain && kF16Mma));
  using M = std::conditional_t<kF16Mma, fp16, T>;  // mma operand type of the codes
  using MR = std::conditional_t<kPlain, M, T>;     // of the last k-step (fp8_ds_mla: RoPE)
  constexpr int kEntry = kPlain ? kLatentDim : kDsMlaEntryBytes;
  constexpr int kStride = fp8_raw_stride(kEntry);
  constexpr int kChunks = kEntry / 16;  // 36 or 41 per raw row
  constexpr int S = kRawStages;  // raw stages: kFp8Stages, or see fp8_stages
  const SmemPlan sp = smem_plan(16, kEntry, kStages, S);
  std::byte* const raw_s = smem + sp.raw;
  uint8_t* const key_ok_s = reinterpret_cast<uint8_t*>(smem + sp.key_ok);
  float4* const s_part = reinterpret_cast<float4*>(smem + sp.s_part);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3;

  // ---- tile loader: thread -> (key tid / 4, every 4th chunk) ----
  const int my_key = tid >> 2, my_part = tid & 3;
  const int my_h = fp8_swz_h(my_key);
  const int32_t* table = a.block_tables + int64_t(r) * a.max_blocks;
  auto fetch_block = [&](int tile) -> int {
    const int pos = key0 + tile * kKeyTile + my_key;
    return tile < ntiles && pos < key1 ? table[decode_block_of(a, pos)] : -1;
  };
  auto issue = [&](int tile, int block) {
    const int stage = tile % S;
    const int pos = key0 + tile * kKeyTile + my_key;
    bool ok;
    const std::byte* src = decode_key_src(a, pos, key1, block, kEntry, my_part == 0, ok);
    if (my_part == 0) key_ok_s[stage * kKeyTile + my_key] = ok;
    const uint32_t dst = smem_addr(raw_s + (stage * kKeyTile + my_key) * kStride);
#pragma unroll
    for (int c = my_part; c < kChunks; c += 4) {
      int at;
      if (c < 32) {
        at = c ^ my_h;
      } else if (kPlain) {
        at = 32 + ((c - 32) ^ (my_h & 3));
      } else {
        at = c == 32 ? 40 + ((my_key >> 1) & 3) : 32 + ((c - 33) ^ my_h);
      }
      cp_async16(dst + at * 16, src + c * 16, ok);
    }
  };

  int next_block = fetch_block(0);
#pragma unroll
  for (int i = 0; i < S - 1; ++i) {
    if (i < ntiles) {
      const int b = next_block;
      next_block = fetch_block(i + 1);
      issue(i, b);
    }
    cp_async_commit();
  }

  // ---- Q fragments of my 9 k-steps, gathered from global memory (rows past the request
  // are zero); k-step i < 8 is step i % 4 of code block 2 warp + i / 4 ----
  const int64_t out_row0 = int64_t(a.query_start[r]) * a.heads + row0;
  auto q_pair = [&](int row, int d) -> uint32_t {
    if (row0 + row >= nrows) return 0u;
    const int64_t e = (out_row0 + row) * kLatentDim + d;
    if (a.q_fp8)  // d is even: one aligned pair of codes
      return e4m3x2_to_act<M>(static_cast<const uint16_t*>(a.q)[e >> 1]);
    return *reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(a.q) + e);
  };
  uint32_t qa[9][4];
#pragma unroll
  for (int i = 0; i < 9; ++i) {
    int d0, d1;
    if (i < 8) {
      d0 = 64 * (2 * warp + i / 4) + 16 * tq + 4 * (i % 4);
      d1 = d0 + 2;
    } else if (kPlain) {
      d0 = kKvLoraRank + 16 * tq + 4 * warp;
      d1 = d0 + 2;
    } else {
      d0 = kKvLoraRank + 16 * warp + 2 * tq;
      d1 = d0 + 8;
    }
    qa[i][0] = q_pair(g, d0);
    qa[i][1] = q_pair(g + 8, d0);
    qa[i][2] = q_pair(g, d1);
    qa[i][3] = q_pair(g + 8, d1);
  }
  float score_lo = a.score_scale_log2;
  float score_hi = score_lo;
  if constexpr (kF16Mma) {
    if (!a.q_fp8) {  // bf16 Q -> f16 scaled per row (fp8 Q codes are exact in f16 as is)
      float mx[2] = {0.0f, 0.0f};
#pragma unroll
      for (int i = 0; i < 9; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t v = qa[i][j] & 0x7FFF7FFFu;
          mx[j & 1] =
              fmaxf(mx[j & 1], fmaxf(__uint_as_float(v << 16), __uint_as_float(v & 0xFFFF0000u)));
        }
#pragma unroll
      for (int o = 1; o <= 2; o <<= 1) {
        mx[0] = fmaxf(mx[0], __shfl_xor_sync(0xffffffffu, mx[0], o));
        mx[1] = fmaxf(mx[1], __shfl_xor_sync(0xffffffffu, mx[1], o));
      }
      float* const qmax_s = reinterpret_cast<float*>(s_part);  // free until tile 0's S
      if (tq == 0) {
        qmax_s[warp * 16 + g] = mx[0];
        qmax_s[warp * 16 + g + 8] = mx[1];
      }
      __syncthreads();
      float mul[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float m = 0.0f;
#pragma unroll
        for (int w = 0; w < 4; ++w) m = fmaxf(m, qmax_s[w * 16 + g + 8 * h]);
        // m in [2^(e-127), 2^(e-126)) -> times 2^(141 - e) in [2^14, 2^15); e clamped to
        // [15, 255] keeps both factors normal floats (inf / NaN rows stay inf / NaN)
        const int e = max(15, int(__float_as_uint(m) >> 23));
        mul[h] = __uint_as_float(uint32_t(268 - e) << 23);
        if (h == 0)
          score_lo *= __uint_as_float(uint32_t(e - 14) << 23);
        else
          score_hi *= __uint_as_float(uint32_t(e - 14) << 23);
      }
#pragma unroll
      for (int i = 0; i < 9; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t v = qa[i][j];
          const float f = mul[j & 1];
          const float lo = __uint_as_float(v << 16) * f, hi = __uint_as_float(v & 0xFFFF0000u) * f;
          // kFoldScale: the RoPE k-step stays bf16 (times the same power of two, exact)
          qa[i][j] = kFoldScale && i == 8 ? pack2<bf16>(lo, hi) : pack2<fp16>(lo, hi);
        }
    }
  }

  const int count_lo = key_count(row0 + g), count_hi = key_count(row0 + g + 8);
  float m_lo = kNegInf, m_hi = kNegInf;  // running max of scaled scores (log2 domain)
  float l_lo = 0.0f, l_hi = 0.0f;        // this thread's share of the row sums
  // kFoldScale: the row's largest p * scale so far (the whole row, times corr like l) and the
  // exponent c of its P' (acc holds 2^c times the output's sums)
  float big_lo = 0.0f, big_hi = 0.0f;
  int c_lo = 0, c_hi = 0;
  float acc[16][4];
#pragma unroll
  for (int n = 0; n < 16; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;

  const int h_g = fp8_swz_h(g);                                   // keys 8 n + g (S)

  for (int t = 0; t < ntiles; ++t) {
    cp_async_wait<S - 2>();  // tile t is in (for this thread's copies)
    __syncthreads();         // ... for all; and tile t - 1, its stage and s_part are done
    if (t + S - 1 < ntiles) {  // into the stage of tile t - 1
      const int b = next_block;
      next_block = fetch_block(t + S);
      issue(t + S - 1, b);
    }
    cp_async_commit();

    const int stage = t % S;
    const std::byte* const tile = raw_s + stage * kKeyTile * kStride;

    // ---- partial S: my 9 k-steps x 32 keys (n-tile n = keys 8 n .. 8 n + 7) ----
    float sp4[4][4];
#pragma unroll
    for (int n = 0; n < 4; ++n) sp4[n][0] = sp4[n][1] = sp4[n][2] = sp4[n][3] = 0.0f;
    float ks_scale[4];
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      const std::byte* row = tile + (8 * n + g) * kStride;
      ks_scale[n] = kPlain || kFoldScale ? 1.0f
                           : *reinterpret_cast<const float*>(row + (40 + (g >> 1)) * 16 + 4 * warp);
    }
    // kFoldScale: scale group `warp` of keys 8 n + 2 t + i, the keys of this thread's S
    // accumulator columns and P fragment elements (their scale chunk is 40 + t).
    float fold[4][2];
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int i = 0; i < 2; ++i)
        fold[n][i] = kFoldScale ? *reinterpret_cast<const float*>(
                                      tile + (8 * n + 2 * tq + i) * kStride + (40 + tq) * 16 + 4 * warp)
                                : 1.0f;
    // The 16-byte chunk of code block 2 warp + bi of key 8 n + g (16 codes: 4 k-steps x
    // (b0, b1)), and one code pair of it as a B fragment register (h = 0: b0, 1: b1).
    auto code_chunk = [&](int bi, int n) -> uint4 {
      const int chunk = (4 * (2 * warp + bi) + tq) ^ h_g;
      return *reinterpret_cast<const uint4*>(tile + (8 * n + g) * kStride + chunk * 16);
    };
    auto convert = [&](uint32_t word, int n, int h) -> uint32_t {
      if constexpr (kPlain)
        return e4m3x2_to_act<M>(h ? word >> 16 : word);
      else if constexpr (kFoldScale)
        return e4m3x2_to_act<M>(h ? word >> 16 : word);
      else
        return e4m3x2_scaled_to_act<T>(h ? word >> 16 : word, ks_scale[n]);
    };
    // kf[bi][s][n]: B fragments (b0, b1) of k-step s of code block 2 warp + bi, n-tile n;
    // converted once, used by S here and, transposed, by P V below (kThreeCtas: by S only,
    // the rest of it is dead code).
    uint32_t kf[2][4][4][2];
#pragma unroll
    for (int bi = 0; bi < 2; ++bi) {
      uint4 w[4];
#pragma unroll
      for (int n = 0; n < 4; ++n) w[n] = code_chunk(bi, n);
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const uint32_t ws[4] = {w[n].x, w[n].y, w[n].z, w[n].w};
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          kf[bi][s][n][0] = convert(ws[s], n, 0);
          kf[bi][s][n][1] = convert(ws[s], n, 1);
          mma_16816<M>(sp4[n], qa[4 * bi + s], kf[bi][s][n][0], kf[bi][s][n][1]);
        }
      }
    }
    // k-step 8: plain, step `warp` of the last code block (word `warp` of chunk 32 + t);
    // fp8_ds_mla, RoPE columns 16 warp .. 16 warp + 15 (bf16, usual fragment order).
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      if constexpr (kFoldScale) {  // the code part of the column times its key's scale
        sp4[n][0] *= fold[n][0];
        sp4[n][1] *= fold[n][1];
        sp4[n][2] *= fold[n][0];
        sp4[n][3] *= fold[n][1];
      }
      const std::byte* row = tile + (8 * n + g) * kStride;
      uint32_t b0, b1;
      if constexpr (kPlain) {
        const uint32_t v =
            *reinterpret_cast<const uint32_t*>(row + (32 + (tq ^ (h_g & 3))) * 16 + 4 * warp);
        b0 = e4m3x2_to_act<M>(v);
        b1 = e4m3x2_to_act<M>(v >> 16);
      } else {
        b0 = bf16x2_to_act<T>(
            *reinterpret_cast<const uint32_t*>(row + (32 + ((2 * warp) ^ h_g)) * 16 + 4 * tq));
        b1 = bf16x2_to_act<T>(*reinterpret_cast<const uint32_t*>(
            row + (32 + ((2 * warp + 1) ^ h_g)) * 16 + 4 * tq));
      }
      mma_16816<MR>(sp4[n], qa[8], b0, b1);
    }
    float s[4][4];
    if constexpr (kSplitSum) {
      // Warp w adds up n-tile w only (the other warps' partials of it, its own from
      // registers, in warp order: the same sum as below), puts the total on the diagonal
      // slot [w][w] (which no warp wrote), and after one more barrier reads the other three
      // totals: per warp 3 + 1 + 3 16-byte stores / loads and 12 adds instead of 4 + 12 and 48.
#pragma unroll
      for (int n = 0; n < 4; ++n)
        if (n != warp)
          s_part[(warp * 4 + n) * 32 + lane] =
              make_float4(sp4[n][0], sp4[n][1], sp4[n][2], sp4[n][3]);
      float4 own = make_float4(sp4[0][0], sp4[0][1], sp4[0][2], sp4[0][3]);
#pragma unroll
      for (int n = 1; n < 4; ++n)
        if (n == warp) own = make_float4(sp4[n][0], sp4[n][1], sp4[n][2], sp4[n][3]);
      __syncthreads();
      float4 v[4];
#pragma unroll
      for (int w = 0; w < 4; ++w) v[w] = w == warp ? own : s_part[(w * 4 + warp) * 32 + lane];
      float4 tot = v[0];
#pragma unroll
      for (int w = 1; w < 4; ++w) {
        tot.x += v[w].x;
        tot.y += v[w].y;
        tot.z += v[w].z;
        tot.w += v[w].w;
      }
      s_part[(warp * 4 + warp) * 32 + lane] = tot;
      __syncthreads();
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const float4 x = n == warp ? tot : s_part[(n * 4 + n) * 32 + lane];
        s[n][0] = x.x;
        s[n][1] = x.y;
        s[n][2] = x.z;
        s[n][3] = x.w;
      }
    } else {
#pragma unroll
      for (int n = 0; n < 4; ++n)
        s_part[(warp * 4 + n) * 32 + lane] = make_float4(sp4[n][0], sp4[n][1], sp4[n][2], sp4[n][3]);
      __syncthreads();
      // The sum in warp order, under bf16 activations with a warp's own partial taken from its
      // registers (12 of the 16 loads; the f16 generic kernel then spills 4 bytes, so it loads
      // all four).
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        float4 v[4];
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          if (std::is_same_v<T, bf16> && w == warp)
            v[w] = make_float4(sp4[n][0], sp4[n][1], sp4[n][2], sp4[n][3]);
          else
            v[w] = s_part[(w * 4 + n) * 32 + lane];
        }
        s[n][0] = v[0].x;
        s[n][1] = v[0].y;
        s[n][2] = v[0].z;
        s[n][3] = v[0].w;
#pragma unroll
        for (int w = 1; w < 4; ++w) {
          s[n][0] += v[w].x;
          s[n][1] += v[w].y;
          s[n][2] += v[w].z;
          s[n][3] += v[w].w;
        }
      }
    }

    // ---- online softmax over the 32 keys, the same in all 4 warps ----
    // Most tiles are whole: every key loaded and visible to every row of the request. Then
    // the per-key masks (position and flag tests, ~4 instructions a score) are skipped; rows
    // past the request get unmasked scores of their zero Q, which they never write out.
    float mx_lo = kNegInf, mx_hi = kNegInf;
    const int tile_end = key0 + t * kKeyTile + kKeyTile;
    const bool whole = key_ok_s[stage * kKeyTile + lane] != 0 &&
                       (row0 + g >= nrows || tile_end <= count_lo) &&
                       (row0 + g + 8 >= nrows || tile_end <= count_hi);
    if (__all_sync(0xffffffffu, whole)) {
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          s[n][i] *= score_lo;
          s[n][2 + i] *= score_hi;
          mx_lo = fmaxf(mx_lo, s[n][i]);
          mx_hi = fmaxf(mx_hi, s[n][2 + i]);
        }
    } else {
      const int pos0 = key0 + t * kKeyTile + 2 * tq;
      const uint8_t* ok = key_ok_s + stage * kKeyTile + 2 * tq;
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const uint32_t okp = *reinterpret_cast<const uint16_t*>(ok + 8 * n);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int pos = pos0 + 8 * n + i;
          const bool k_ok = (okp >> (8 * i)) & 0xFFu;
          s[n][i] = k_ok && pos < count_lo ? s[n][i] * score_lo : kNegInf;
          s[n][2 + i] = k_ok && pos < count_hi ? s[n][2 + i] * score_hi : kNegInf;
          mx_lo = fmaxf(mx_lo, s[n][i]);
          mx_hi = fmaxf(mx_hi, s[n][2 + i]);
        }
      }
    }
    const float2 corr = softmax_fragment_step(s, mx_lo, mx_hi, m_lo, m_hi, l_lo, l_hi);
    const float corr_lo = corr.x, corr_hi = corr.y;
    float f_lo = corr_lo, f_hi = corr_hi;  // what the accumulators take
    if constexpr (kFoldScale) {
      // p * scale[k][warp] (exact: a power of two; l above has the plain p), the row's
      // largest in this tile and so far, and c (ds_p_exponent)
      float u_lo = 0.0f, u_hi = 0.0f;
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          s[n][i] *= fold[n][i];
          s[n][2 + i] *= fold[n][i];
          u_lo = fmaxf(u_lo, s[n][i]);
          u_hi = fmaxf(u_hi, s[n][2 + i]);
        }
#pragma unroll
      for (int o = 1; o <= 2; o <<= 1) {
        u_lo = fmaxf(u_lo, __shfl_xor_sync(0xffffffffu, u_lo, o));
        u_hi = fmaxf(u_hi, __shfl_xor_sync(0xffffffffu, u_hi, o));
      }
      big_lo = fmaxf(big_lo * corr_lo, u_lo);
      big_hi = fmaxf(big_hi * corr_hi, u_hi);
      const int cn_lo = ds_p_exponent(big_lo, c_lo, corr_lo != 1.0f);
      const int cn_hi = ds_p_exponent(big_hi, c_hi, corr_hi != 1.0f);
      // corr 2^c_new 2^-c_old in that order: no overflow (c rises only when corr made big
      // smaller), and an underflow only drops sums that corr made negligible
      if (cn_lo != c_lo) f_lo = corr_lo * pow2i(cn_lo) * pow2i(-c_lo);
      if (cn_hi != c_hi) f_hi = corr_hi * pow2i(cn_hi) * pow2i(-c_hi);
      c_lo = cn_lo;
      c_hi = cn_hi;
    }
    // Once the running max settles corr is exactly 1 (x * 1 = x: skipping is bitwise the
    // same); the row state is identical in all warps, so the vote is too (kFoldScale: a warp's
    // c is its own, and so is its vote).
    if (__any_sync(0xffffffffu, f_lo != 1.0f || f_hi != 1.0f)) {
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        acc[n][0] *= f_lo;
        acc[n][1] *= f_lo;
        acc[n][2] *= f_hi;
        acc[n][3] *= f_hi;
      }
    }

    // ---- O[:, 128 warp .. +128] += P V; k-step k = keys 16 k .. 16 k + 15 ----
    // The S fragment kf[bi][s][n][h] is the 8 x 8 matrix [key 8 n + g][column of k-index
    // 2 t + i]; transposed (movmatrix) it is the P V B fragment [key 2 t + i][column g] of
    // the same 8 keys and 8 columns. So P V n-tile 8 bi + 2 s + h takes b0 from n-tile 2 k
    // and b1 from n-tile 2 k + 1, and thread t's accumulator pair of that n-tile is output
    // columns 128 warp + 64 bi + 16 t + 4 s + 2 h + {0, 1}.
    const float pc_lo = pow2i(c_lo), pc_hi = pow2i(c_hi);  // kFoldScale
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      auto pack_p = [&](float x, float y) -> uint32_t {
        if constexpr (kFoldScale) {
          // x, y: p * scale * 2^c; bf16 rounding of both in one cvt, then into f16 (exact
          // down to 2^-14)
          const uint32_t b = pack2<bf16>(x, y);
          return pack2<fp16>(__uint_as_float(b << 16), __uint_as_float(b & 0xFFFF0000u));
        } else if constexpr (kF16Mma) {
          // bf16 rounding of both in one cvt, then times 2^12 into f16 (exact)
          const uint32_t b = pack2<bf16>(x, y);
          return pack2<fp16>(__uint_as_float(b << 16) * 4096.0f,
                             __uint_as_float(b & 0xFFFF0000u) * 4096.0f);
        } else {
          return pack2<T>(x, y);
        }
      };
      // P fragment element (row, column 2 t + i) of n-tile n: S accumulator column i of
      // n-tile n, the same key (kFoldScale: s holds p times that key's scale, P' takes 2^c)
      auto p_of = [&](int n, int e) -> float {
        if constexpr (kFoldScale)
          return s[n][e] * (e < 2 ? pc_lo : pc_hi);
        else
          return s[n][e];
      };
      const uint32_t pa[4] = {pack_p(p_of(2 * k, 0), p_of(2 * k, 1)),
                              pack_p(p_of(2 * k, 2), p_of(2 * k, 3)),
                              pack_p(p_of(2 * k + 1, 0), p_of(2 * k + 1, 1)),
                              pack_p(p_of(2 * k + 1, 2), p_of(2 * k + 1, 3))};
#pragma unroll
      for (int bi = 0; bi < 2; ++bi) {
        uint4 w0{}, w1{};  // kThreeCtas: n-tiles 2 k and 2 k + 1 again, from the raw tile
        if constexpr (kThreeCtas) {
          w0 = code_chunk(bi, 2 * k);
          w1 = code_chunk(bi, 2 * k + 1);
        }
        const uint32_t ws0[4] = {w0.x, w0.y, w0.z, w0.w}, ws1[4] = {w1.x, w1.y, w1.z, w1.w};
#pragma unroll
        for (int st = 0; st < 4; ++st)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint32_t b0 = kThreeCtas ? convert(ws0[st], 2 * k, h) : kf[bi][st][2 * k][h];
            const uint32_t b1 =
                kThreeCtas ? convert(ws1[st], 2 * k + 1, h) : kf[bi][st][2 * k + 1][h];
            mma_16816<M>(acc[8 * bi + 2 * st + h], pa, movmatrix_trans(b0),
                         movmatrix_trans(b1));
          }
      }
    }
  }
  cp_async_wait<0>();

  // ---- finish: row sums over the 4 lanes of a row, normalise, write ----
#pragma unroll
  for (int o = 1; o <= 2; o <<= 1) {
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, o);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, o);
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = g + 8 * half;
    if (row0 + row >= nrows) continue;
    const float m = half ? m_hi : m_lo, l = half ? l_hi : l_lo;
    const bool empty = m == kNegInf || !(l > 0.0f);
    // kF16Mma: P was stored times 2^12 (plain fp8) or 2^c (kFoldScale)
    const float vs = !kF16Mma ? a.v_scale
                     : kPlain ? a.v_scale * (1.0f / 4096.0f)
                              : a.v_scale * pow2i(-(half ? c_hi : c_lo));
    const float inv = empty ? 0.0f : vs / l;
    const float lse = empty ? kNegInf : (m + __log2f(l)) * kLn2;
    // n-tile 8 bi + m holds columns 128 warp + 64 bi + 16 t + 2 m + {0, 1}
    const int col0 = 128 * warp + 16 * tq;
    if (work.direct) {
      T* out = static_cast<T*>(a.out) + (out_row0 + row) * kKvLoraRank + col0;
#pragma unroll
      for (int bi = 0; bi < 2; ++bi) {
        uint32_t w[8];
#pragma unroll
        for (int m = 0; m < 8; ++m)
          w[m] = pack2<T>(acc[8 * bi + m][2 * half] * inv, acc[8 * bi + m][2 * half + 1] * inv);
        *reinterpret_cast<uint4*>(out + 64 * bi) = make_uint4(w[0], w[1], w[2], w[3]);
        *reinterpret_cast<uint4*>(out + 64 * bi + 8) = make_uint4(w[4], w[5], w[6], w[7]);
      }
      if (warp == 0 && tq == 0) a.lse[out_row0 + row] = lse;
    } else {
      const int64_t wi = work.part + int64_t(row) * work.part_stride;
      if (!empty) {
        float* o = a.ws_o + wi * kKvLoraRank + col0;
#pragma unroll
        for (int bi = 0; bi < 2; ++bi)
#pragma unroll
          for (int m = 0; m < 8; m += 2)
            *reinterpret_cast<float4*>(o + 64 * bi + 2 * m) = make_float4(
                acc[8 * bi + m][2 * half] * inv, acc[8 * bi + m][2 * half + 1] * inv,
                acc[8 * bi + m + 1][2 * half] * inv, acc[8 * bi + m + 1][2 * half + 1] * inv);
      }
      if (warp == 0 && tq == 0) a.ws_lse[wi] = lse;
    }
  }
}

// ---- the split-KV kernel ------------------------------------------------------------
// Warps: (ROWS / 16) row groups x 4 key/column slices; warp w works on query rows
// [16 g, 16 g + 16) of the tile (g = w / 4) and slice c = w % 4:
//   S = Q K^T: keys [8c, 8c + 8) of the 32-key tile, 576 deep (36 k-steps, two
//              accumulator chains for ILP); the deep 16-row kernels instead split the depth:
//              warp c does k-steps [9c, 9c + 9) for all 32 keys with Q in registers, and
//              the 4 partial tiles are added in shared memory;
//   softmax:   row maxima of the 4 slices exchanged through shared memory, so all 4 warps
//              of a row group keep the identical running max m (and hence the identical
//              rescale factor); each warp keeps its own partial row sum l, added up at the
//              end;
//   O += P V:  output columns [128c, 128c + 128) for its 16 rows: 16 n-tiles x 4 fp32 =
//              64 accumulator registers per thread.
// Pipeline per 32-key tile t (STAGES stages; fp8 formats stage raw bytes and convert; their
// 16-row 2-stage tiles take decode_fp8_tiles above instead):
//   sync; issue cp.async of tile t + STAGES - 1 (block id prefetched one issue earlier);
//   wait tile t; sync; [convert raw -> T; sync]; S; partial maxima; sync; p, rescale,
//   P -> smem; sync; PV.
// STAGES = 2 with two CTAs per SM (the default), or the deep pipeline (kDeepStages*, one
// CTA per SM, 4-6 tiles in flight). Measured on H200: the deep form is slower (0.65 of copy
// bandwidth against 0.74-0.90), so a tile's compute in one CTA (~1.7 us, over the 1.2 us a
// 36 KB tile takes at the SM's share of the bandwidth) is what bounds the kernel, and two
// CTAs per SM overlap it; the depth-split S of the deep kernels cuts that compute (0.65 ->
// 0.73), still short of the 2-stage form's 0.89.
// Registers: 64 accumulators + 8 scores + 12 fragment registers + addressing; rows 64
// (512 threads) is capped at 128 registers by the launch bounds.
// The kernel runs one piece of work (decode_sched.cuh: a row tile of one request against a
// key range) per call of splitkv_piece; a balanced-schedule CTA runs several in a row.
// kFp8 (Fp8Kernel, bf16 activations only when nonzero): which fp8 fragment path the 16-row
// 2-stage kernel compiles (see decode_fp8_tiles and fp8_kernel_variant); with kFp8ThreeCtas
// the launch bounds ask for three CTAs per SM (168 registers).
// kWarpOwn (DecodePlan::row16_warp_own: 16 rows, 16-bit cache, 2 stages): every
// warp copies exactly the key columns it reads and waits only for its own copies; S is
// split by depth, so the sums come in another order (see "warp-own form" below).
template <class T, int ROWS, bool kConvert, int STAGES, int kFp8, bool kWarpOwn = false>
__device__ __forceinline__ void splitkv_piece(const DecodeArgs& a, const DecodeWork& work) {
  static_assert(!kWarpOwn || (ROWS == 16 && !kConvert && STAGES == kStages));
  constexpr int kWarps = ROWS / 16 * 4;
  constexpr int kThreads = kWarps * 32;
  constexpr int kThreadsPerKey = kThreads / kKeyTile;
  extern __shared__ __align__(128) std::byte smem[];

  // `work` is in shared memory: these references read it where they are used, so the
  // 32 / 64-row kernels (128 registers) need not keep them in registers across the loop.
  const int& r = work.r;
  const int& row0 = work.row0;  // first (token * heads + head) row of the tile
  const int &qlen = work.qlen, &seq = work.seq, &nrows = work.nrows;
  // Keys visible to local row `row` (0 for rows past the request). A row's arithmetic
  // depends on nothing else (its S row, max, sum and P V row are its own; keys a row cannot
  // see are masked and leave its state bitwise unchanged): what batch invariance rests on.
  auto key_count = [&](int row) -> int { return decode_row_keys(a, qlen, seq, nrows, row); };
  const int &key0 = work.key0, &key1 = work.key1;
  const int ntiles = key1 > key0 ? (key1 - key0 + kKeyTile - 1) / kKeyTile : 0;
  if (ntiles == 0 && !work.direct) {
    // An empty piece (a short request in a grid sized for long ones): the combine needs
    // only its LSE of -inf, and then never reads its partial output.
    const int row = int(threadIdx.x);
    if (threadIdx.x < ROWS && row0 + row < nrows)
      a.ws_lse[work.part + int64_t(row) * work.part_stride] = kNegInf;
    return;
  }
  if constexpr (kConvert && fp8_fragment_path(ROWS, 1, STAGES)) {
    // fp8 formats, 16 rows: the register-fragment path (Fp8Kernel).
    constexpr int kV = kFp8 & ~kFp8ThreeCtas;
    constexpr bool k3 = (kFp8 & kFp8ThreeCtas) != 0;
    constexpr int kS = fp8_stages(kFp8);
    if constexpr (kV == kFp8Generic) {
      static_assert(kFp8 == kFp8Generic);
      if (a.format == CacheFormat::fp8)
        decode_fp8_tiles<T, true, false, false, false, false, kS>(a, smem, work, ntiles,
                                                                   key_count);
      else
        decode_fp8_tiles<T, false, false, true, false, false, kS>(a, smem, work, ntiles,
                                                                   key_count);
    } else if constexpr (kV == kFp8PlainF16) {
      static_assert(!k3);
      decode_fp8_tiles<T, true, true, false, false, false, kS>(a, smem, work, ntiles, key_count);
    } else if constexpr (kV == kFp8DsMlaF16) {
      // f16 codes pay off with the hardware e4m3x2 -> f16x2 cvt (sm_89+). The sm_80 pass,
      // where it is emulated (and the three-CTA form spilled 16 bytes), compiles the
      // unfolded form (bf16(code * scale)) instead: correct for any scales.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
      decode_fp8_tiles<T, false, false, true, k3, false, kS>(a, smem, work, ntiles, key_count);
#else
      decode_fp8_tiles<T, false, true, true, k3, true, kS>(a, smem, work, ntiles, key_count);
#endif
    } else {
      static_assert(kV == kFp8DsMla);
      decode_fp8_tiles<T, false, false, true, k3, false, kS>(a, smem, work, ntiles, key_count);
    }
    return;
  }
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = warp >> 2, slice = warp & 3;

  const SmemPlan sp = smem_plan(ROWS, kConvert ? a.entry_bytes : 0, STAGES);
  std::byte* const q_s = smem + sp.q;
  std::byte* const tiles_s = smem + sp.tiles;
  std::byte* const raw_s = smem + sp.raw;
  std::byte* const p_s = smem + sp.p;
  uint8_t* const key_ok_s = reinterpret_cast<uint8_t*>(smem + sp.key_ok);
  float* const red_max = reinterpret_cast<float*>(smem + sp.red_max);
  float* const red_sum = reinterpret_cast<float*>(smem + sp.red_sum);
  float* const s_part = reinterpret_cast<float*>(smem + sp.s_part);

  // ---- Q tile -> shared memory (T, swizzled; rows past the request are zero) ----
  const int64_t out_row0 = int64_t(a.query_start[r]) * a.heads + row0;
  if (!a.q_fp8) {
    const std::byte* q = static_cast<const std::byte*>(a.q) + out_row0 * kRowBytes;
    for (int i = tid; i < ROWS * kRowChunks; i += kThreads) {
      const int row = i / kRowChunks, c = i % kRowChunks;
      const bool ok = row0 + row < nrows;
      cp_async16(smem_addr(q_s + swz(row, c)), ok ? q + row * kRowBytes + c * 16 : a.q, ok);
    }
  } else {
    const uint8_t* q = static_cast<const uint8_t*>(a.q) + out_row0 * kLatentDim;
    for (int i = tid; i < ROWS * kRowChunks; i += kThreads) {
      const int row = i / kRowChunks, c = i % kRowChunks;
      const uint2 codes = row0 + row < nrows
                              ? *reinterpret_cast<const uint2*>(q + row * kLatentDim + c * 8)
                              : make_uint2(0, 0);
      *reinterpret_cast<uint4*>(q_s + swz(row, c)) = e4m3x8_to_act<T>(codes);
    }
  }

  // ---- key tile loader: thread -> (key, part); each key's row is copied by
  // kThreadsPerKey threads, which needs one block-table lookup per thread and tile (the
  // warp-own form: lane l of every warp looks up key l) ----
  const int my_key = kWarpOwn ? lane : tid / kThreadsPerKey, my_part = tid % kThreadsPerKey;
  const int32_t* table = a.block_tables + int64_t(r) * a.max_blocks;
  auto fetch_block = [&](int tile) -> int {  // block id of my key in `tile`, read only if used
    const int pos = key0 + tile * kKeyTile + my_key;
    return tile < ntiles && pos < key1 ? table[decode_block_of<!kWarpOwn>(a, pos)] : -1;
  };
  auto issue = [&](int tile, int block) {
    const int stage = tile % STAGES;
    const int pos = key0 + tile * kKeyTile + my_key;
    bool ok;
    const std::byte* src = decode_key_src(a, pos, key1, block, a.entry_bytes, my_part == 0, ok);
    if (my_part == 0) key_ok_s[stage * kKeyTile + my_key] = ok;
    if constexpr (!kConvert) {
      const uint32_t dst = smem_addr(tiles_s + stage * kKeyTile * kRowBytes);
      for (int c = my_part; c < kRowChunks; c += kThreadsPerKey)
        cp_async16_stream(dst + swz(my_key, c), src + c * 16, ok);
    } else {
      const uint32_t dst = smem_addr(raw_s + (stage * kKeyTile + my_key) * a.entry_bytes);
      for (int c = my_part; c < a.entry_bytes / 16; c += kThreadsPerKey)
        cp_async16(dst + c * 16, src + c * 16, ok);
    }
  };

  // ---- warp-own form (kWarpOwn): who copies what ----
  // With the depth-split S below, warp w reads only output columns [128 w, 128 w + 128)
  // (chunks 16 w .. 16 w + 15: its 8 S k-steps and its P V columns) and RoPE k-step 32 + w
  // (chunks 64 + 2 w, 65 + 2 w) of each of the 32 keys. So it copies exactly those, 18
  // chunks per lane as in the shared loader, and only its own cp.async groups and a
  // __syncwarp stand between the copy and the reads: no CTA-wide wait for the slowest of the
  // tile's 2,304 copies. Lane l resolves key l (one block-table read and one division by
  // the block size, as before) and the warp passes the source pointers by shuffles. Main
  // columns: copy (q, h) of lane l is chunk 16 w + 8 h + l % 8 of key 4 q + l / 8, so each
  // 8-lane phase copies one whole 128-byte line of one key: one 4-sector L2 request, and 8
  // distinct 16-byte bank slots for the shared stores (chunk ^ key % 8). (Lanes reading 64
  // contiguous bytes, as rowilp built it, made twice the L2 requests of 2 sectors and a
  // 2-way store conflict; whole lines measured 3-5 % faster on the memory-bound shapes, with
  // L2, not DRAM, the busiest unit before: docs/decode_sm90.md.) RoPE: lane pairs read the
  // 32 bytes of one key. The key flags stay in registers (a ballot per issue, one word per
  // stage): no shared flags another warp could rewrite under a reader.
  uint32_t ok_bits0 = 0u, ok_bits1 = 0u;  // stages 0 and 1 (scalars: no local-memory array)
  auto issue_own = [&](int tile, int block) {
    const int stage = tile % STAGES;
    bool ok;
    const std::byte* src = decode_key_src<false>(a, key0 + tile * kKeyTile + lane, key1, block,
                                                 a.entry_bytes, warp == 0, ok);
    const uint32_t bits = __ballot_sync(0xffffffffu, ok);
    if (stage)
      ok_bits1 = bits;
    else
      ok_bits0 = bits;
    // (decode_key_src gives the cache's first entry for a key not loaded: never read, as
    // the copy's source size is then 0 and the destination is zero-filled.)
    const unsigned long long mine = reinterpret_cast<unsigned long long>(src);
    const int sub = lane >> 3, part = lane & 7;
    const uint32_t base = smem_addr(tiles_s + stage * kKeyTile * kRowBytes);
#pragma unroll
    for (int q = 0; q < 8; ++q) {  // keys 4 q + sub
      const int key = 4 * q + sub;
      const std::byte* const s0 =
          reinterpret_cast<const std::byte*>(__shfl_sync(0xffffffffu, mine, key)) + 256 * warp +
          16 * part;
      const uint32_t d = base + key * kRowBytes + 256 * warp + ((part ^ (key & 7)) << 4);
      const bool valid = (bits >> key) & 1u;
      cp_async16_stream(d, s0, valid);              // chunk 16 w + part
      cp_async16_stream(d + 128, s0 + 128, valid);  // chunk 16 w + 8 + part
    }
    // RoPE: chunk rc of keys rk and 16 + rk (the same low 3 bits, so the same swizzle)
    const int rk = lane >> 1, rc = 64 + 2 * warp + (lane & 1);
    const uint32_t d_rope = base + swz(rk, rc);
#pragma unroll
    for (int r2 = 0; r2 < 2; ++r2) {
      const int key = 16 * r2 + rk;
      const std::byte* const s0 =
          reinterpret_cast<const std::byte*>(__shfl_sync(0xffffffffu, mine, key));
      cp_async16_stream(d_rope + 16 * r2 * kRowBytes, s0 + 16 * rc, (bits >> key) & 1u);
    }
  };

  // Prologue: tiles 0 .. STAGES - 2 in flight, one commit group each (group 0 also holds
  // Q); the block id of the next tile to issue is always fetched one issue ahead. The
  // warp-own form issues both stages here: its refills come after each tile's P V.
  int next_block = fetch_block(0);
#pragma unroll
  for (int i = 0; i < (kWarpOwn ? STAGES : STAGES - 1); ++i) {
    if (i < ntiles) {
      const int b = next_block;
      next_block = fetch_block(i + 1);
      if constexpr (kWarpOwn)
        issue_own(i, b);
      else
        issue(i, b);
    }
    cp_async_commit();
  }

  // Per-thread state: rows lo = lane / 4 and hi = lo + 8 of the warp's row group.
  const int row_lo = group * 16 + (lane >> 2), row_hi = row_lo + 8;
  const int count_lo = key_count(row0 + row_lo), count_hi = key_count(row0 + row_hi);
  float m_lo = kNegInf, m_hi = kNegInf;  // running max of scaled scores (log2 domain)
  float l_lo = 0.0f, l_hi = 0.0f;        // this warp's partial row sums
  float acc[16][4];
#pragma unroll
  for (int n = 0; n < 16; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;

  const uint32_t q_base = smem_addr(q_s);
  const uint32_t p_base = smem_addr(p_s);
  const int key_col = slice * 8 + 2 * (lane & 3);  // this thread's 2 keys in the tile
  // The deep 16-row kernels split S by depth (below); their Q fragments live in registers.
  // Measured on H200 in the 2-stage kernel it cost ~5 % (0.844 against 0.892 of copy
  // bandwidth at (128, 12, 8k)) while it lifted the deep one from 0.65 to 0.73, so only
  // the deep form uses it.
  constexpr bool kDepthSplitS = ROWS == 16 && STAGES > kStages;
  uint32_t qa[kDepthSplitS ? kDepthSteps : 1][4];

  if constexpr (kWarpOwn) {
    // ---- the warp-own form's tile loop (the shared loop below is then skipped) ----
    // Per tile t, warp w (slice w, the CTA's 16 rows):
    //   wait for its own copies of tile t (cp.async.wait_group 1 + __syncwarp; tile 0: a
    //   CTA barrier, since Q was copied by everyone);
    //   S partial: its 9 k-steps (8 w .. 8 w + 7, 32 + w) for all 32 keys, Q in registers;
    //   store the partial [16][32] fp32 tile; CTA barrier (the one per tile);
    //   add the 4 partial tiles in warp order: every warp holds the bitwise same S of all
    //   32 keys, so the same maxima, P and row sums, with no maxima exchange;
    //   softmax on 32 keys; P V on its 128 columns with P straight from the S registers;
    //   refill the stage with tile t + 2 (its own columns only).
    // The partial tiles go to the Q buffer (free once Q is in registers), two of them
    // alternating by tile: with no barrier at the top of a tile, a warp may write tile
    // t + 1's partials while a slower one still reads tile t's; it cannot get two tiles
    // ahead, since tile t + 1's barrier waits for every warp.
    // Shared memory: the 2-stage plan unchanged (94,016 B): Q 18,432 holds 2 x 8,192 of
    // partial S; P, the key flags and the maxima are unused.
    // Registers per thread: 64 accumulators + 36 Q fragment + 16 S + 16 partial S + 8
    // fragment + addressing: ptxas 205 (sm_90a) / 202 (sm_80), no spills; two CTAs of 128
    // threads allow 255.
    static_assert(2 * 4 * 4 * 32 * int(sizeof(float4)) <= 16 * kRowBytes,
                  "two partial-S buffers fit in the Q buffer");
    uint32_t qf[kDepthSteps][4];
    // Per-thread ldmatrix offsets (relative to the stage), every row of a thread with
    // r % 8 = lane % 8: chunk c of a row sits at 128 (c / 8) + 16 ((c % 8) ^ (r % 8)).
    // S: chunk 16 w + 2 i + hb (k-step 8 w + i, i < 8; hb = lane / 8 % 2 picks the half)
    // of key row lane % 8 + 8 (lane / 16) at s_off[i % 4] + 128 (i / 4); the RoPE k-step's
    // chunk 64 + 2 w + hb at s_rope. P V: chunk 16 w + 2 np + lane / 16 of key row
    // lane % 8 + 8 (lane / 8 % 2) (+ 16 per k-step) at v_off[np % 4] + 128 (np / 4).
    const int r7 = lane & 7, hb = (lane >> 3) & 1;
    uint32_t s_off[4], v_off[4];
    const uint32_t s_row = (r7 + ((lane >> 4) << 3)) * kRowBytes + 256 * slice;
    const uint32_t v_row = (r7 + hb * 8) * kRowBytes + 256 * slice;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      s_off[m] = s_row + (((2 * m + hb) ^ r7) << 4);
      v_off[m] = v_row + (((2 * m + (lane >> 4)) ^ r7) << 4);
    }
    const uint32_t s_rope =
        (r7 + ((lane >> 4) << 3)) * kRowBytes + ((64 + ((2 * slice + hb) ^ r7)) << 4);
    const int tq = lane & 3;
    const float scale = a.score_scale_log2;
    for (int t = 0; t < ntiles; ++t) {
      cp_async_wait<1>();  // all but the newest group (tile t + 1): tile t (and Q) are in
      if (t == 0) {
        __syncthreads();  // Q, copied by every thread
#pragma unroll
        for (int i = 0; i < kDepthSteps; ++i) {
          const int ks = i < 8 ? 8 * slice + i : 32 + slice;
          ldsm_x4(q_base + swz(lane & 15, 2 * ks + (lane >> 4)), qf[i]);
        }
        __syncthreads();  // Q is in registers everywhere: its buffer takes the partial S
      } else {
        __syncwarp();  // the lanes' copies visible to the whole warp
      }
      const int stage = t % STAGES;
      const uint32_t k_base = smem_addr(tiles_s + stage * kKeyTile * kRowBytes);

      // ---- S partial: 4 independent mma chains (n-tiles of 8 keys) of 9 k-steps ----
      float sp[4][4];
#pragma unroll
      for (int n = 0; n < 4; ++n) sp[n][0] = sp[n][1] = sp[n][2] = sp[n][3] = 0.0f;
#pragma unroll
      for (int i = 0; i < kDepthSteps; ++i) {
        // x4: lanes 0-7 keys 0-7 low half of the k-step, 8-15 keys 0-7 high, 16-23 keys
        // 8-15 low, 24-31 keys 8-15 high = b0, b1 of n-tiles 0 and 1 (+16 rows: 2 and 3).
        const uint32_t off = k_base + (i < 8 ? s_off[i & 3] + 128 * (i >> 2) : s_rope);
        uint32_t b01[4], b23[4];
        ldsm_x4(off, b01);
        ldsm_x4(off + 16 * kRowBytes, b23);
        mma_16816<T>(sp[0], qf[i], b01[0], b01[1]);
        mma_16816<T>(sp[1], qf[i], b01[2], b01[3]);
        mma_16816<T>(sp[2], qf[i], b23[0], b23[1]);
        mma_16816<T>(sp[3], qf[i], b23[2], b23[3]);
      }
      // [warp][n-tile][lane] float4: each warp's stores and loads are 512 contiguous bytes.
      float4* const part = reinterpret_cast<float4*>(q_s) + (t & 1) * (4 * 4 * 32);
#pragma unroll
      for (int n = 0; n < 4; ++n)
        part[(slice * 4 + n) * 32 + lane] = make_float4(sp[n][0], sp[n][1], sp[n][2], sp[n][3]);
      __syncthreads();
      float s[4][4];
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        float4 v[4];
#pragma unroll
        for (int w = 0; w < 4; ++w)
          v[w] = w == slice ? make_float4(sp[n][0], sp[n][1], sp[n][2], sp[n][3])
                            : part[(w * 4 + n) * 32 + lane];
        s[n][0] = ((v[0].x + v[1].x) + v[2].x) + v[3].x;
        s[n][1] = ((v[0].y + v[1].y) + v[2].y) + v[3].y;
        s[n][2] = ((v[0].z + v[1].z) + v[2].z) + v[3].z;
        s[n][3] = ((v[0].w + v[1].w) + v[2].w) + v[3].w;
      }

      // ---- online softmax over the 32 keys (n-tile n: keys 8 n + 2 tq + {0, 1}); a
      // whole tile (every key loaded and visible to every row of the request) skips the
      // masks ----
      const uint32_t okmask = stage ? ok_bits1 : ok_bits0;
      const int tile0 = key0 + t * kKeyTile;
      const bool whole = okmask == 0xffffffffu &&
                         (row0 + row_lo >= nrows || tile0 + kKeyTile <= count_lo) &&
                         (row0 + row_hi >= nrows || tile0 + kKeyTile <= count_hi);
      float mx_lo = kNegInf, mx_hi = kNegInf;
      if (__all_sync(0xffffffffu, whole)) {
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            s[n][i] *= scale;
            s[n][2 + i] *= scale;
            mx_lo = fmaxf(mx_lo, s[n][i]);
            mx_hi = fmaxf(mx_hi, s[n][2 + i]);
          }
      } else {
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int key = 8 * n + 2 * tq + i;
            const bool k_ok = (okmask >> key) & 1u;
            s[n][i] = k_ok && tile0 + key < count_lo ? s[n][i] * scale : kNegInf;
            s[n][2 + i] = k_ok && tile0 + key < count_hi ? s[n][2 + i] * scale : kNegInf;
            mx_lo = fmaxf(mx_lo, s[n][i]);
            mx_hi = fmaxf(mx_hi, s[n][2 + i]);
          }
      }
      const float2 corr = softmax_fragment_step(s, mx_lo, mx_hi, m_lo, m_hi, l_lo, l_hi);
      const float corr_lo = corr.x, corr_hi = corr.y;
      // Once the running max settles corr is exactly 1: skip the 64 multiplications then
      // (x * 1 = x, bitwise the same).
      if (__any_sync(0xffffffffu, corr_lo != 1.0f || corr_hi != 1.0f)) {
#pragma unroll
        for (int n = 0; n < 16; ++n) {
          acc[n][0] *= corr_lo;
          acc[n][1] *= corr_lo;
          acc[n][2] *= corr_hi;
          acc[n][3] *= corr_hi;
        }
      }

      // ---- O[:, 128 w .. +128] += P V: the S accumulators of n-tiles 2 k and 2 k + 1 are
      // the A fragment of k-step k (keys 16 k .. 16 k + 15), rounded to T as the shared P
      // tile of the other forms is (the row sums l keep the fp32 p) ----
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const uint32_t pf[4] = {
            pack2<T>(s[2 * k][0], s[2 * k][1]), pack2<T>(s[2 * k][2], s[2 * k][3]),
            pack2<T>(s[2 * k + 1][0], s[2 * k + 1][1]), pack2<T>(s[2 * k + 1][2], s[2 * k + 1][3])};
#pragma unroll
        for (int np = 0; np < 8; ++np) {
          uint32_t b[4];
          ldsm_x4_trans(k_base + v_off[np & 3] + 16 * k * kRowBytes + 128 * (np >> 2), b);
          mma_16816<T>(acc[2 * np], pf, b[0], b[1]);
          mma_16816<T>(acc[2 * np + 1], pf, b[2], b[3]);
        }
      }
      // ---- refill this stage with tile t + 2, my columns only; __syncwarp orders the
      // warp's ldmatrix reads of the stage before its lanes' copies ----
      if (t + STAGES < ntiles) {
        __syncwarp();
        const int b = next_block;
        next_block = fetch_block(t + STAGES + 1);
        issue_own(t + STAGES, b);
      }
      cp_async_commit();  // group of tile t + 2 (maybe empty)
    }
  }

  // (!kWarpOwn: the warp-own form ran its own loop above.)
  for (int t = 0; !kWarpOwn && t < ntiles; ++t) {
    __syncthreads();  // tile t-1 fully consumed: its stage, the T tile and P are free
    if (t + STAGES - 1 < ntiles) {  // into the stage of tile t - 1
      const int b = next_block;
      next_block = fetch_block(t + STAGES);
      issue(t + STAGES - 1, b);
    }
    cp_async_commit();              // group t + STAGES - 1 (maybe empty)
    cp_async_wait<STAGES - 1>();  // all but the newest STAGES - 1 groups: Q and tile t
    __syncthreads();

    const int stage = t % STAGES;
    if constexpr (kConvert) {
      // Raw fp8 tile -> T tile. Every thread converts groups of 16 codes (one 16-byte
      // shared load, two 16-byte stores); all of a thread's loads are issued before the
      // first conversion so their latencies overlap (rows 16: 9 groups = 36 registers; the
      // 32/64-row kernels, capped at 128 registers with 64 accumulators live, go one by one).
      // Budget per thread and tile, rows 16 (128 threads), bf16: plain fp8 9 groups x
      // (1 LDS.128 + 8 pairs x 4 cvt + 2 STS.128 + ~4 address) ~ 350 instructions;
      // ds_mla 8 code groups x (LDS.128 + LDS scale + 8 x (3 cvt + 2 FMUL + 1 cvt) + 2 STS)
      // + 2 rope groups ~ 450; the old pass (8 codes per item, f32 round trips, a format
      // branch per item) took ~700 / ~1100 and had no load-level parallelism.
      const std::byte* raw = raw_s + stage * kKeyTile * a.entry_bytes;
      auto store16 = [&](int key, int chunk, uint2 lo, uint2 hi) {
        *reinterpret_cast<uint4*>(tiles_s + swz(key, chunk)) = make_uint4(lo.x, lo.y, hi.x, hi.y);
      };
      // Group i of 16 codes: key i / kGroupsPerKey, codes 16 g .. 16 g + 15 (g = i %
      // kGroupsPerKey; ds_mla: scale g / 8) -> T chunks 2g and 2g + 1. The 16-row kernel
      // has compile-time sizes per format (multiply-shift index arithmetic, no division).
      auto convert_tile = [&]<bool kPlain>() {
        constexpr int kGroupsPerKey = (kPlain ? kLatentDim : kKvLoraRank) / 16;
        constexpr int kEntry = kPlain ? kLatentDim : kDsMlaEntryBytes;
        constexpr int kGroups = kKeyTile * kGroupsPerKey;
        auto load_group = [&](int i, uint4& v, float& scale) {
          const std::byte* row = raw + (i / kGroupsPerKey) * kEntry;
          const int g = i % kGroupsPerKey;
          v = *reinterpret_cast<const uint4*>(row + g * 16);
          scale = kPlain ? 1.0f : reinterpret_cast<const float*>(row + kDsMlaScaleOffset)[g / 8];
        };
        auto convert_group = [&](int i, const uint4& v, float scale) {
          const int key = i / kGroupsPerKey, g = i % kGroupsPerKey;
          if constexpr (kPlain) {
            store16(key, 2 * g, e4m3x4_to_act<T>(v.x), e4m3x4_to_act<T>(v.y));
            store16(key, 2 * g + 1, e4m3x4_to_act<T>(v.z), e4m3x4_to_act<T>(v.w));
          } else {
            store16(key, 2 * g, e4m3x4_scaled_to_act<T>(v.x, scale),
                    e4m3x4_scaled_to_act<T>(v.y, scale));
            store16(key, 2 * g + 1, e4m3x4_scaled_to_act<T>(v.z, scale),
                    e4m3x4_scaled_to_act<T>(v.w, scale));
          }
        };
        constexpr int kPer = (kGroups + kThreads - 1) / kThreads;  // 9 plain, 8 ds_mla
        uint4 v[kPer];
        float scale[kPer];
#pragma unroll
        for (int k = 0; k < kPer; ++k)
          if (kGroups % kThreads == 0 || tid + k * kThreads < kGroups)
            load_group(tid + k * kThreads, v[k], scale[k]);
#pragma unroll
        for (int k = 0; k < kPer; ++k)
          if (kGroups % kThreads == 0 || tid + k * kThreads < kGroups)
            convert_group(tid + k * kThreads, v[k], scale[k]);
      };
      // The 32 / 64-row kernels (128 registers, 64 accumulators live) convert one group at a
      // time with the format read at run time: the per-format unrolled form spills there.
      auto convert_tile_small = [&]() {
        const bool plain = a.format == CacheFormat::fp8;
        const int groups_per_key = plain ? kLatentDim / 16 : kKvLoraRank / 16;
#pragma unroll 1
        for (int i = tid; i < kKeyTile * groups_per_key; i += kThreads) {
          const int key = i / groups_per_key, g = i % groups_per_key;
          const std::byte* row = raw + key * a.entry_bytes;
          const uint4 v = *reinterpret_cast<const uint4*>(row + g * 16);
          if (plain) {
            store16(key, 2 * g, e4m3x4_to_act<T>(v.x), e4m3x4_to_act<T>(v.y));
            store16(key, 2 * g + 1, e4m3x4_to_act<T>(v.z), e4m3x4_to_act<T>(v.w));
          } else {
            const float scale = reinterpret_cast<const float*>(row + kDsMlaScaleOffset)[g / 8];
            store16(key, 2 * g, e4m3x4_scaled_to_act<T>(v.x, scale),
                    e4m3x4_scaled_to_act<T>(v.y, scale));
            store16(key, 2 * g + 1, e4m3x4_scaled_to_act<T>(v.z, scale),
                    e4m3x4_scaled_to_act<T>(v.w, scale));
          }
        }
      };
      const bool plain = a.format == CacheFormat::fp8;
      if constexpr (ROWS != 16) {
        convert_tile_small();
      } else if (plain) {
        convert_tile.template operator()<true>();
      } else {
        convert_tile.template operator()<false>();
      }
      if (!plain) {
        // rope: 64 bf16 per key = 8 chunks, chunk 64 + q of the T row
#pragma unroll 1
        for (int i = tid; i < kKeyTile * 8; i += kThreads) {
          const int key = i / 8, q = i % 8;
          const std::byte* src = raw + key * kDsMlaEntryBytes + kDsMlaRopeOffset + q * 16;
          *reinterpret_cast<uint4*>(tiles_s + swz(key, 64 + q)) =
              bf16x8_to_act<T>(*reinterpret_cast<const uint4*>(src));
        }
      }
      __syncthreads();
    }
    const uint32_t k_base = smem_addr(tiles_s + (kConvert ? 0 : stage * kKeyTile * kRowBytes));

    // ---- S = Q K^T for rows of my group x keys [8 slice, 8 slice + 8) ----
    float s[4];
    if constexpr (kDepthSplitS) {
      // Warp `slice` multiplies its quarter of the depth (k-steps [9 slice, 9 slice + 9))
      // with all 32 keys: 4 independent chains of 9 mma instead of 2 of 18, and 18
      // ldmatrix per tile instead of 108 (its Q fragments, 36 registers, are loaded once).
      // The four partial tiles meet in shared memory (10 KB, one more barrier); each warp
      // then adds up its own 8-key slice, in slice order 0..3.
      if (t == 0) {
#pragma unroll
        for (int i = 0; i < kDepthSteps; ++i)
          ldsm_x4(q_base + swz(lane & 15, 2 * (kDepthSteps * slice + i) + (lane >> 4)), qa[i]);
      }
      float sp[4][4];
#pragma unroll
      for (int n = 0; n < 4; ++n) sp[n][0] = sp[n][1] = sp[n][2] = sp[n][3] = 0.0f;
      // ldmatrix x4: lanes 0-7 keys 0-7 low chunk, 8-15 keys 0-7 high chunk, 16-23 keys
      // 8-15 low, 24-31 keys 8-15 high = b0, b1 of n-tile 0, then of n-tile 1.
      const int kr = (lane & 7) + ((lane >> 4) << 3);
#pragma unroll
      for (int i = 0; i < kDepthSteps; ++i) {
        const int c = 2 * (kDepthSteps * slice + i) + ((lane >> 3) & 1);
        uint32_t b01[4], b23[4];
        ldsm_x4(k_base + swz(kr, c), b01);
        ldsm_x4(k_base + swz(kr + 16, c), b23);
        mma_16816<T>(sp[0], qa[i], b01[0], b01[1]);
        mma_16816<T>(sp[1], qa[i], b01[2], b01[3]);
        mma_16816<T>(sp[2], qa[i], b23[0], b23[1]);
        mma_16816<T>(sp[3], qa[i], b23[2], b23[3]);
      }
      const int g = lane >> 2, tq = 2 * (lane & 3);
      float* const mine = s_part + slice * 16 * kSPartStride;
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        *reinterpret_cast<float2*>(mine + g * kSPartStride + 8 * n + tq) =
            make_float2(sp[n][0], sp[n][1]);
        *reinterpret_cast<float2*>(mine + (g + 8) * kSPartStride + 8 * n + tq) =
            make_float2(sp[n][2], sp[n][3]);
      }
      __syncthreads();  // (the buffer is free again after the next barrier, the maxima's)
      s[0] = s[1] = s[2] = s[3] = 0.0f;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float* part = s_part + c * 16 * kSPartStride;
        const float2 lo = *reinterpret_cast<const float2*>(part + g * kSPartStride + key_col);
        const float2 hi = *reinterpret_cast<const float2*>(part + (g + 8) * kSPartStride + key_col);
        s[0] += lo.x;
        s[1] += lo.y;
        s[2] += hi.x;
        s[3] += hi.y;
      }
    } else {
      float s0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, s1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const int qr = group * 16 + (lane & 15);
      const int kr = slice * 8 + (lane & 7);
#pragma unroll 6
      for (int j = 0; j < kLatentDim / 32; ++j) {  // two k-steps (32 dims) per iteration
        uint32_t a0[4], a1[4], b[4];
        ldsm_x4(q_base + swz(qr, 4 * j + (lane >> 4)), a0);
        ldsm_x4(q_base + swz(qr, 4 * j + 2 + (lane >> 4)), a1);
        ldsm_x4(k_base + swz(kr, 4 * j + (lane >> 3)), b);
        mma_16816<T>(s0, a0, b[0], b[1]);
        mma_16816<T>(s1, a1, b[2], b[3]);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) s[i] = s0[i] + s1[i];
    }

    // ---- online softmax ----
    const int pos = key0 + t * kKeyTile + key_col;
    const uint8_t* ok = key_ok_s + stage * kKeyTile + key_col;
    float x[4];
    x[0] = ok[0] && pos < count_lo ? s[0] * a.score_scale_log2 : kNegInf;
    x[1] = ok[1] && pos + 1 < count_lo ? s[1] * a.score_scale_log2 : kNegInf;
    x[2] = ok[0] && pos < count_hi ? s[2] * a.score_scale_log2 : kNegInf;
    x[3] = ok[1] && pos + 1 < count_hi ? s[3] * a.score_scale_log2 : kNegInf;
    float mx_lo = fmaxf(x[0], x[1]), mx_hi = fmaxf(x[2], x[3]);
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, o));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, o));
    }
    float* my_red = red_max + (group * 4) * 16;
    if ((lane & 3) == 0) {
      my_red[slice * 16 + (lane >> 2)] = mx_lo;
      my_red[slice * 16 + (lane >> 2) + 8] = mx_hi;
    }
    __syncthreads();
    float tmax_lo = kNegInf, tmax_hi = kNegInf;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      tmax_lo = fmaxf(tmax_lo, my_red[c * 16 + (lane >> 2)]);
      tmax_hi = fmaxf(tmax_hi, my_red[c * 16 + (lane >> 2) + 8]);
    }
    const float mnew_lo = fmaxf(m_lo, tmax_lo), mnew_hi = fmaxf(m_hi, tmax_hi);
    // With no visible key yet (m = -inf) subtract 0 instead: -inf - -inf would be NaN.
    const float mref_lo = mnew_lo == kNegInf ? 0.0f : mnew_lo;
    const float mref_hi = mnew_hi == kNegInf ? 0.0f : mnew_hi;
    const float corr_lo = fast_exp2(m_lo - mref_lo), corr_hi = fast_exp2(m_hi - mref_hi);
    const float p0 = fast_exp2(x[0] - mref_lo), p1 = fast_exp2(x[1] - mref_lo);
    const float p2 = fast_exp2(x[2] - mref_hi), p3 = fast_exp2(x[3] - mref_hi);
    l_lo = l_lo * corr_lo + p0 + p1;
    l_hi = l_hi * corr_hi + p2 + p3;
    m_lo = mnew_lo;
    m_hi = mnew_hi;
    *reinterpret_cast<uint32_t*>(p_s + (row_lo * kPStride + key_col) * 2) = pack2<T>(p0, p1);
    *reinterpret_cast<uint32_t*>(p_s + (row_hi * kPStride + key_col) * 2) = pack2<T>(p2, p3);
    // Once the running max settles, corr is exactly 1 for whole warps: skip the 64
    // multiplications then (x * 1 = x, so the result is bitwise the same). Only in the
    // deep kernels (unmeasured elsewhere; the 128-register 32 / 64-row ones spill with it).
    if (STAGES == kStages || __any_sync(0xffffffffu, corr_lo != 1.0f || corr_hi != 1.0f)) {
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        acc[n][0] *= corr_lo;
        acc[n][1] *= corr_lo;
        acc[n][2] *= corr_hi;
        acc[n][3] *= corr_hi;
      }
    }
    __syncthreads();

    // ---- O[:, 128 slice .. +128] += P V ----
    const uint32_t pa = p_base + (group * 16 + (lane & 15)) * kPStride * 2;
#pragma unroll
    for (int ks = 0; ks < kKeyTile / 16; ++ks) {
      uint32_t pf[4];
      ldsm_x4(pa + (2 * ks + (lane >> 4)) * 16, pf);
      const int vr = 16 * ks + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int np = 0; np < 8; ++np) {
        uint32_t b[4];
        ldsm_x4_trans(k_base + swz(vr, 16 * slice + 2 * np + (lane >> 4)), b);
        mma_16816<T>(acc[2 * np], pf, b[0], b[1]);
        mma_16816<T>(acc[2 * np + 1], pf, b[2], b[3]);
      }
    }
  }
  cp_async_wait<0>();

  // ---- finish: total row sums across the 4 slices, normalise, write ----
#pragma unroll
  for (int o = 1; o <= 2; o <<= 1) {
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, o);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, o);
  }
  // (The warp-own form's sums already cover all 32 keys of every tile in every warp. Its
  // barrier stays: it keeps the next piece's Q copy behind every warp's partial-S reads.)
  float* my_sum = red_sum + (group * 4) * 16;
  if (!kWarpOwn && (lane & 3) == 0) {
    my_sum[slice * 16 + (lane >> 2)] = l_lo;
    my_sum[slice * 16 + (lane >> 2) + 8] = l_hi;
  }
  __syncthreads();
  float sum_lo = kWarpOwn ? l_lo : 0.0f, sum_hi = kWarpOwn ? l_hi : 0.0f;
#pragma unroll
  for (int c = 0; c < (kWarpOwn ? 0 : 4); ++c) {
    sum_lo += my_sum[c * 16 + (lane >> 2)];
    sum_hi += my_sum[c * 16 + (lane >> 2) + 8];
  }

#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = half ? row_hi : row_lo;
    if (row0 + row >= nrows) continue;
    const float m = half ? m_hi : m_lo, l = half ? sum_hi : sum_lo;
    const bool empty = m == kNegInf || !(l > 0.0f);
    const float inv = empty ? 0.0f : a.v_scale / l;
    const float lse = empty ? kNegInf : (m + __log2f(l)) * kLn2;
    const int col0 = 128 * slice + 2 * (lane & 3);
    if (work.direct) {
      T* out = static_cast<T*>(a.out) + (out_row0 + row) * kKvLoraRank + col0;
#pragma unroll
      for (int n = 0; n < 16; ++n)
        *reinterpret_cast<uint32_t*>(out + 8 * n) =
            pack2<T>(acc[n][2 * half] * inv, acc[n][2 * half + 1] * inv);
      if (slice == 0 && (lane & 3) == 0) a.lse[out_row0 + row] = lse;
    } else {
      const int64_t w = work.part + int64_t(row) * work.part_stride;
      if (!empty) {
        float* o = a.ws_o + w * kKvLoraRank + col0;
#pragma unroll
        for (int n = 0; n < 16; ++n)
          *reinterpret_cast<float2*>(o + 8 * n) =
              make_float2(acc[n][2 * half] * inv, acc[n][2 * half + 1] * inv);
      }
      if (slice == 0 && (lane & 3) == 0) a.ws_lse[w] = lse;
    }
  }
}

template <class T, int ROWS, bool kConvert, int STAGES, int kFp8 = kFp8Generic,
          bool kWarpOwn = false>
__global__ void __launch_bounds__(ROWS / 16 * 128, ROWS == 64 || STAGES > kStages ? 1
                                                   : kFp8 & kFp8ThreeCtas         ? 3
                                                                                  : 2)
    decode_splitkv_kernel(const DecodeArgs a) {
  if constexpr (ROWS == 16) {
    for_each_decode_work<ROWS, kKeyTile>(
        a,
        [&](const DecodeWork& w) {
          splitkv_piece<T, ROWS, kConvert, STAGES, kFp8, kWarpOwn>(a, w);
        },
        [&](const DecodeWork* cuts, int n) { merge_cut_pieces<T>(a, cuts, n); });
  } else {
    // The 32 / 64-row kernels run at their 128-register cap (64 accumulators). Inside the
    // loop over pieces the compiler would keep values it derives from the arguments (the
    // fp8 shared-memory plan, addresses) live from one piece to the next; read from shared
    // memory, which every barrier may change, they are derived again where used.
    __shared__ DecodeArgs args_s;
    if (threadIdx.x == 0) args_s = a;
    __syncthreads();
    for_each_decode_work<ROWS, kKeyTile>(
        args_s,
        [&](const DecodeWork& w) { splitkv_piece<T, ROWS, kConvert, STAGES, kFp8>(args_s, w); },
        [&](const DecodeWork* cuts, int n) { merge_cut_pieces<T>(args_s, cuts, n); });
  }
}

// ---- combine: out = sum_s exp(lse_s - LSE) O_s, LSE = log sum_s exp(lse_s) ----------
// Two forms, picked from the row and partial counts (decode_attention, below): this one, a
// warp per task, for many rows of a few partials each, and decode_combine_rows_kernel (a
// CTA per task, one pass over the LSEs) for a few rows of many partials. A task is one
// (row, column chunk): the row's 512 columns come in `chunks` chunks of 128 / chunks
// float4 (chunks 1..16). Many rows (128 requests x 12 heads: 1,536 rows of ~2 partials)
// take one warp per row, no shared memory and no barrier. Per task:
//   1. the warp reads the row's S LSEs (lane-strided; lane s keeps partial s's) and
//      reduces their max and the total weight sum_s exp(lse_s - max) by shuffles;
//   2. its lanes are col_lanes = min(32, chunk float4) column lanes x 32 / col_lanes split
//      groups; group g adds w_s O_s for s = g, g + groups, ... into 1-4 float4 per lane
//      (independent 16-byte loads; a partial's column lanes read >= 128 consecutive bytes),
//      where rows expect at least kCombineBatch partials, the loads of that many partials
//      per group at a time all issued before any add (combine_rows' kBatch: (4, 128, 4k),
//      16 partials a row, 44.0 -> 39.5 us on an H100, (16, 128, 4k) 65.1 -> 63.5,
//      2026-12-07, twenty-seventh session);
//   3. the groups' sums meet by xor shuffles; the first group scales by 1 / total and writes.
// A partial with LSE -inf wrote no output and is never added (its workspace may hold
// anything, even NaN; the batched loads may read it). Where a row's partials are: per-request
// schedule, ws_lse[item * num_splits + s] (contiguous); balanced, the slots of its pair's pieces
// (balanced_partial).
// Batch-invariant plans always use 4 chunks (partials added in order), so an element's
// arithmetic depends on nothing but its row's partials.
// Launched as a programmatic dependent of the split kernel on sm_90 (when the plan says
// so): it waits for that grid (griddepcontrol.wait) before reading any partial.
constexpr int kCombineThreads = 256;
constexpr int kCombineWarps = kCombineThreads / 32;
constexpr int kCombineInvariantChunks = 4;
constexpr int kCombineBatch = 4;

// kBatch: combine_rows' (1, or kCombineBatch for rows of at least that many partials).
template <class T, int kBatch>
__global__ void __launch_bounds__(kCombineThreads)
    decode_combine_kernel(const DecodeArgs a, int chunks) {
  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5;
  const int64_t task = int64_t(blockIdx.x) * kCombineWarps + warp;
  const int64_t item = task / chunks;  // (request, row) pair
  const int chunk = int(task % chunks);
  if (item >= int64_t(a.num_requests) * a.max_rows) return;
  const int r = int(item / a.max_rows), row = int(item % a.max_rows);
  if (row >= a.query_lens[r] * a.heads) return;
  // (Inputs, never written by the split kernel: read before row_partials waits for it, so
  // under PDL their latency overlaps the split kernel's tail.)
  const RowPartials rp[1] = {row_partials(a, item, r, row)};
  if (a.balanced && rp[0].S <= 1) return;
  combine_rows<T, 1, kBatch>(a, rp, r, chunk, chunks, lane);
}

// ---- combine, many partials per row: one CTA per (row, column chunk) ---------------------
// For a few rows with hundreds of partials each (one 64K-key request: 12 rows of 247), the
// warp-per-task combine above is latency bound: every warp walks the row's LSEs three times
// (max, total, weights), each a chain of lane-strided L2 loads, before any O is read. Here
// the CTA (256 threads) reads the S <= 1024 LSEs once, every thread up to 4 of them with
// independent loads, and then:
//   1. block max (warp shuffles, 8 warp maxima in shared memory, one barrier);
//   2. weights w_s = exp(lse_s - max) (0 for an empty partial) into shared memory, 4 KB,
//      and their block sum (one more barrier, which also publishes the weights);
//   3. the chunk's chunk_f4 float4 columns x 256 / chunk_f4 split groups: group g adds
//      w_s O_s for s = g, g + groups, ... with kCombineLoads float4 loads in flight per
//      thread (16 chunks, 247 partials: 32 groups of ~8, all loads of a thread at once);
//   4. the groups meet by xor shuffles inside a warp and in warp order through shared
//      memory (4 KB, one barrier); chunk_f4 threads scale by 1 / total and write.
// Four dependent global round trips in all (query length, LSEs, O, store), against ~25
// for the warp-per-task form at 247 partials. The order of the additions depends only on
// S and the plan's chunks (never used by batch-invariant plans, which keep the form above).
// chunks in 4..32: chunk_f4 = 128 / chunks float4 columns, at most one warp wide.
constexpr int kCombineLoads = 8;
constexpr int kCombineLsePerThread = kMaxSplits / kCombineThreads;  // 4

template <class T>
__global__ void __launch_bounds__(kCombineThreads)
    decode_combine_rows_kernel(const DecodeArgs a, int chunks) {
  __shared__ float weight_s[kMaxSplits];          // w_s = exp(lse_s - max): 4 KB
  __shared__ float max_s[kCombineWarps], sum_s[kCombineWarps];
  __shared__ float4 group_s[kCombineWarps][32];   // each warp's group sums: 4 KB
  const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int64_t item = int64_t(blockIdx.x) / chunks;  // (request, row) pair
  const int chunk = int(int64_t(blockIdx.x) % chunks);
  // Every exit before the last barrier is uniform over the CTA.
  if (item >= int64_t(a.num_requests) * a.max_rows) return;
  const int r = int(item / a.max_rows), row = int(item % a.max_rows);
  if (row >= a.query_lens[r] * a.heads) return;
  const int64_t out_row = int64_t(a.query_start[r]) * a.heads + row;
  // (Inputs, never written by the split kernel: read before row_partials waits for it, so
  // under PDL their latency overlaps the split kernel's tail.)
  const RowPartials rp = row_partials(a, item, r, row);
  const int S = rp.S;
  if (a.balanced && S <= 1) return;
  auto part = [&](int s) { return rp.part(a, s); };

  // 1. the LSEs, one pass, independent loads; block max
  float lse[kCombineLsePerThread];
  float big = kNegInf;
#pragma unroll
  for (int k = 0; k < kCombineLsePerThread; ++k) {
    const int s = tid + k * kCombineThreads;
    lse[k] = s < S ? a.ws_lse[part(s)] : kNegInf;
    big = fmaxf(big, lse[k]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) big = fmaxf(big, __shfl_xor_sync(0xffffffffu, big, o));
  if (lane == 0) max_s[warp] = big;
  __syncthreads();
  big = max_s[0];
#pragma unroll
  for (int i = 1; i < kCombineWarps; ++i) big = fmaxf(big, max_s[i]);

  const int chunk_f4 = (kKvLoraRank / 4) / chunks;  // float4 columns in the chunk, <= 32
  const int col = lane % chunk_f4, group = tid / chunk_f4;
  const int groups = kCombineThreads / chunk_f4;
  const int col0 = (chunk * chunk_f4 + col) * 4;
  T* out = static_cast<T*>(a.out) + out_row * kKvLoraRank + col0;
  if (big == kNegInf) {  // no split saw a key: zeros and -inf
    if (tid < chunk_f4) *reinterpret_cast<uint2*>(out) = make_uint2(0, 0);
    if (chunk == 0 && tid == 0) a.lse[out_row] = kNegInf;
    return;
  }

  // 2. weights and their sum
  float total = 0.0f;
#pragma unroll
  for (int k = 0; k < kCombineLsePerThread; ++k) {
    const int s = tid + k * kCombineThreads;
    if (s < S) {
      const float w = lse[k] == kNegInf ? 0.0f : expf(lse[k] - big);
      weight_s[s] = w;
      total += w;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
  if (lane == 0) sum_s[warp] = total;
  __syncthreads();  // also publishes weight_s
  total = sum_s[0];
#pragma unroll
  for (int i = 1; i < kCombineWarps; ++i) total += sum_s[i];

  // 3. this group's partials, kCombineLoads independent float4 loads at a time. A
  // partial of weight 0 is not read: an empty one may hold anything (even NaN).
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int s0 = group; s0 < S; s0 += groups * kCombineLoads) {
    float4 v[kCombineLoads];
    float w[kCombineLoads];
#pragma unroll
    for (int u = 0; u < kCombineLoads; ++u) {
      const int s = s0 + u * groups;
      w[u] = s < S ? weight_s[s] : 0.0f;
      v[u] = w[u] != 0.0f
                 ? __ldcg(reinterpret_cast<const float4*>(a.ws_o + part(s) * kKvLoraRank + col0))
                 : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int u = 0; u < kCombineLoads; ++u) {
      acc.x += w[u] * v[u].x;
      acc.y += w[u] * v[u].y;
      acc.z += w[u] * v[u].z;
      acc.w += w[u] * v[u].w;
    }
  }

  // 4. the groups' sums: inside the warp, then across the warps in warp order
  for (int o = chunk_f4; o < 32; o <<= 1) {
    acc.x += __shfl_xor_sync(0xffffffffu, acc.x, o);
    acc.y += __shfl_xor_sync(0xffffffffu, acc.y, o);
    acc.z += __shfl_xor_sync(0xffffffffu, acc.z, o);
    acc.w += __shfl_xor_sync(0xffffffffu, acc.w, o);
  }
  group_s[warp][lane] = acc;
  __syncthreads();
  if (tid >= chunk_f4) return;
  acc = group_s[0][tid];
#pragma unroll
  for (int i = 1; i < kCombineWarps; ++i) {
    const float4 g = group_s[i][tid];
    acc.x += g.x;
    acc.y += g.y;
    acc.z += g.z;
    acc.w += g.w;
  }
  const float inv = 1.0f / total;
  *reinterpret_cast<uint2*>(out) =
      make_uint2(pack2<T>(acc.x * inv, acc.y * inv), pack2<T>(acc.z * inv, acc.w * inv));
  if (chunk == 0 && tid == 0) a.lse[out_row] = big + logf(total);
}

// ---- the W_UV epilogue: combine, W_UV and the output gate in one launch ------------------
// For a layer's decode step (decode_attention_uv), in place of the combine, the batched W_UV
// GEMM and the gate: attn[t, h * 128 + n] = act(act(latent[t, h] . W_UV[h][:, n]) *
// sigmoid(g[t, h * 128 + n])), latent[t, h] being the decode output row the combine would
// write (act). The CTA of (16 tokens, head h):
//   1. starts the copy of W_UV[h] (512 x 128 act, 128 KB) into shared memory, which depends
//      on nothing the split kernel writes: cp.async, or on sm_90 multicast bulk copies shared
//      by the cluster of the head's token tiles (each CTA fetches 1 / n of the rows);
//   2. builds the 16 latent rows in shared memory, a warp per row: a row with partials is
//      merged from them in split order (weights exp(lse_s - max) over their sum), a row its
//      only piece wrote directly is read from out, a row of no request is zero; rounded to
//      act;
//   3. multiplies them by W_UV[h] on mma.sync (warp w: output columns 8w .. 8w + 7, fp32
//      accumulation), rounds to act, gates (the gate kernel's arithmetic, `gated`) and writes
//      attn; rows t >= *num_tokens get zeros.
// A row's arithmetic depends on its own partials only, so batch-invariant plans stay so.
constexpr int kUvTokens = 16;                // rows of one mma tile, a warp each
constexpr int kUvThreads = 32 * kUvTokens;   // warp w also computes output columns 8w .. 8w + 7
constexpr int kUvAStride = kKvLoraRank + 8;  // elements: 1040-byte rows, ldmatrix conflict-free
constexpr int kUvWStride = kVDim + 8;        // 272-byte rows
constexpr int kUvSmemBytes = (kUvTokens * kUvAStride + kKvLoraRank * kUvWStride) * 2;  // 155.6 KB

struct UvArgs {
  const void* w_uv;     // [heads, 512, 128] act
  void* attn;           // row t, head h at attn + t * attn_stride + h * 128 (act)
  int64_t attn_stride;  // elements
  const void* g;        // gate input at g + t * g_stride + h * 128, or null (no gate)
  int64_t g_stride;
  int64_t rows;               // tokens [0, rows) are written
  const int32_t* num_tokens;  // rows t >= *num_tokens are zero; null: none
  bool multicast;             // launched in clusters along x: W_UV[h] by multicast bulk copies
};

// Latent row (token t, head h) into v (lane's columns 4 lane + 128 k + {0..3}, k < 4) as
// fp32: zero for a token of no request or a row past the plan; warp-uniform. Three dependent
// round trips to L2: the request (a guess, r = t, checked with two loads: one token per
// request; else a scan), its query length with the row's pair entry, then the LSEs together
// with the first kUvLoads partials.
constexpr int kUvLoads = 4;  // partials read before their weights are known

template <class T>
__device__ __forceinline__ void uv_latent_row(const DecodeArgs& a, int64_t t, int h,
                                              float (&v)[16]) {
  const int lane = int(threadIdx.x) & 31;
#pragma unroll
  for (int k = 0; k < 16; ++k) v[k] = 0.0f;
  // The request holding token t: the last r with query_start[r] <= t (requests without
  // tokens repeat their start, so the last one is the request that has t).
  int r = -1;
  if (t < a.num_requests) {
    const int g0 = a.query_start[t], g1 = a.query_start[t + 1];
    if (g0 <= t && t < g1) r = int(t);
  }
  if (r < 0) {
    int count = 0;
    for (int base = 0; base <= a.num_requests; base += 32) {
      const int j = base + lane;
      count += __popc(__ballot_sync(0xffffffffu, j <= a.num_requests && a.query_start[j] <= t));
    }
    r = count - 1;
  }
  if (r < 0 || r >= a.num_requests) return;
  const int qlen = a.query_lens[r];
  const int token = int(t - a.query_start[r]);
  const int row = token * a.heads + h;
  if (token >= qlen || row >= covered_rows(a, qlen)) return;
  const RowPartials rp = row_partials(a, int64_t(r) * a.max_rows + row, r, row);
  const int S = rp.S;
  if (a.direct_out || (a.balanced && S <= 1)) {  // the only piece wrote the row
    const T* o = static_cast<const T*>(a.out) + (t * a.heads + h) * int64_t(kKvLoraRank) + 4 * lane;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint2 x = __ldcg(reinterpret_cast<const uint2*>(o + 128 * k));
      const T* e = reinterpret_cast<const T*>(&x);
#pragma unroll
      for (int c = 0; c < 4; ++c) v[4 * k + c] = to_float(e[c]);
    }
    return;
  }
  auto lse_at = [&](int s) { return __ldcg(a.ws_lse + rp.part(a, s)); };
  auto o_at = [&](int s, int k) {
    return __ldcg(
        reinterpret_cast<const float4*>(a.ws_o + rp.part(a, s) * kKvLoraRank + 4 * lane + 128 * k));
  };
  // The first partials' values with the LSEs: an empty one (its slot may hold NaN) is
  // dropped by a select below, never multiplied.
  float4 first[kUvLoads][4];
#pragma unroll
  for (int s = 0; s < kUvLoads; ++s)
#pragma unroll
    for (int k = 0; k < 4; ++k)
      first[s][k] = s < S ? o_at(s, k) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const float my_lse = lane < S ? lse_at(lane) : kNegInf;
  float big = my_lse;
  for (int s = lane + 32; s < S; s += 32) big = fmaxf(big, lse_at(s));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) big = fmaxf(big, __shfl_xor_sync(0xffffffffu, big, o));
  if (big == kNegInf) return;  // no piece saw a key: zeros
  float total = my_lse == kNegInf ? 0.0f : expf(my_lse - big);
  for (int s = lane + 32; s < S; s += 32) {
    const float l = lse_at(s);
    total += l == kNegInf ? 0.0f : expf(l - big);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
  // w_s O_s in split order; a partial of weight 0 adds nothing.
  auto add = [&](float w, const float4& x, int k) {
    v[4 * k + 0] = fmaf(w, x.x, v[4 * k + 0]);
    v[4 * k + 1] = fmaf(w, x.y, v[4 * k + 1]);
    v[4 * k + 2] = fmaf(w, x.z, v[4 * k + 2]);
    v[4 * k + 3] = fmaf(w, x.w, v[4 * k + 3]);
  };
#pragma unroll
  for (int s = 0; s < kUvLoads; ++s) {
    const float l = __shfl_sync(0xffffffffu, my_lse, s);
    const float w = s < S && l != kNegInf ? expf(l - big) : 0.0f;
    if (w != 0.0f)
#pragma unroll
      for (int k = 0; k < 4; ++k) add(w, first[s][k], k);
  }
  for (int s = kUvLoads; s < S; ++s) {
    const float l = s < 32 ? __shfl_sync(0xffffffffu, my_lse, s) : lse_at(s);
    const float w = l == kNegInf ? 0.0f : expf(l - big);
    if (w == 0.0f) continue;
#pragma unroll
    for (int k = 0; k < 4; ++k) add(w, o_at(s, k), k);
  }
  const float inv = 1.0f / total;
#pragma unroll
  for (int k = 0; k < 16; ++k) v[k] *= inv;
}

template <class T>
__global__ void __launch_bounds__(kUvThreads) decode_uv_kernel(const DecodeArgs a, const UvArgs u) {
  extern __shared__ __align__(16) std::byte uv_smem[];
  [[maybe_unused]] __shared__ __align__(8)
      uint64_t w_bar;                            // multicast: W_UV[h]'s bytes have landed
  T* const a_s = reinterpret_cast<T*>(uv_smem);  // [16][kUvAStride] latent rows
  T* const w_s = a_s + kUvTokens * kUvAStride;   // [512][kUvWStride] W_UV[h]
  const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int h = int(blockIdx.y);
  const int64_t t0 = int64_t(blockIdx.x) * kUvTokens;

  // 1. W_UV[h]: 16-byte cp.async chunks, or (u.multicast, sm_90) the cluster's CTAs (token
  // tiles of head h) each fetching 1 / n of its rows once for all of them.
  const T* w = static_cast<const T*>(u.w_uv) + int64_t(h) * kKvLoraRank * kVDim;
  if (u.multicast) {
#if KMLA_SM90A
    uint32_t rank, n;
    asm("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    asm("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(n));
    if (tid == 0) {
      sm90::mbar_init(&w_bar, 1);
      sm90::fence_mbarrier_init();
    }
    sm90::cluster_sync();  // every CTA's barrier is initialised before any copy signals it
    if (tid == 0) sm90::mbar_arrive_expect_tx(&w_bar, uint32_t(kKvLoraRank * kVDim * sizeof(T)));
    const uint16_t mask = uint16_t((1u << n) - 1u);
    for (uint32_t k = rank + uint32_t(tid) * n; k < uint32_t(kKvLoraRank); k += kUvThreads * n)
      sm90::bulk_copy_multicast(smem_addr(w_s + k * kUvWStride), w + k * kVDim,
                          uint32_t(kVDim * sizeof(T)), smem_addr(&w_bar), mask);
#endif
  } else {
    constexpr int kChunksPerRow = kVDim / 8;
#pragma unroll 4
    for (int c = tid; c < kKvLoraRank * kChunksPerRow; c += kUvThreads) {
      const int k = c / kChunksPerRow, n = (c % kChunksPerRow) * 8;
      cp_async16(smem_addr(w_s + k * kUvWStride + n), w + k * kVDim + n, true);
    }
    cp_async_commit();
  }

  // 2. the latent rows, warp i row i (num_tokens is the caller's input: read before the wait)
  const int64_t real = u.num_tokens ? int64_t(*u.num_tokens) : u.rows;
  {
    const int64_t t = t0 + warp;
    float v[16];
    if (t < u.rows && t < real) {
      uv_latent_row<T>(a, t, h, v);
    } else {
#pragma unroll
      for (int k = 0; k < 16; ++k) v[k] = 0.0f;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k)
      *reinterpret_cast<uint2*>(a_s + warp * kUvAStride + 128 * k + 4 * lane) =
          make_uint2(pack2<T>(v[4 * k], v[4 * k + 1]), pack2<T>(v[4 * k + 2], v[4 * k + 3]));
  }
  if (u.multicast) {
#if KMLA_SM90A
    sm90::mbar_wait(smem_addr(&w_bar), 0);
#endif
  } else {
    cp_async_wait<0>();
  }
  __syncthreads();

  // 3. [16 x 512] x [512 x 128]: warp w's 8 columns (one m16n8 tile), two k steps per B load
  const int n0 = warp * 8;
  float acc[4] = {};
#pragma unroll 4
  for (int kk = 0; kk < kKvLoraRank; kk += 32) {
    uint32_t a0[4], a1[4], bf[4];
    ldsm_x4(smem_addr(a_s + (lane & 15) * kUvAStride + kk + (lane >> 4) * 8), a0);
    ldsm_x4(smem_addr(a_s + (lane & 15) * kUvAStride + kk + 16 + (lane >> 4) * 8), a1);
    ldsm_x4_trans(smem_addr(w_s + (kk + lane) * kUvWStride + n0), bf);  // k rows kk .. kk + 31
    mma_16816<T>(acc, a0, bf[0], bf[1]);
    mma_16816<T>(acc, a1, bf[2], bf[3]);
  }
  const T* g = static_cast<const T*>(u.g);
  T* attn = static_cast<T*>(u.attn);
  const int col = h * kVDim + n0 + 2 * (lane & 3);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t t = t0 + (lane >> 2) + 8 * half;
    if (t >= u.rows) continue;
    float x0 = round_to<T>(acc[2 * half]), x1 = round_to<T>(acc[2 * half + 1]);
    if (t >= real) {
      x0 = x1 = 0.0f;
    } else if (g) {
      const uint32_t gv = *reinterpret_cast<const uint32_t*>(g + t * u.g_stride + col);
      const T* ge = reinterpret_cast<const T*>(&gv);
      x0 = gated(x0, to_float(ge[0]));
      x1 = gated(x1, to_float(ge[1]));
    }
    *reinterpret_cast<uint32_t*>(attn + t * u.attn_stride + col) = pack2<T>(x0, x1);
  }
#if KMLA_SM90A
  if (u.multicast) sm90::cluster_sync();  // no CTA leaves while its copies to the others may be in flight
#endif
}

// ---- host side ------------------------------------------------------------------------
// The largest deep-pipeline CTA over the cache formats (the plan does not know the format).
int deep_smem_bytes() {
  return std::max({smem_plan(16, 0, kDeepStages16).total,
                   smem_plan(16, kDsMlaEntryBytes, kDeepStagesFp8).total,
                   smem_plan(16, kLatentDim, kDeepStagesFp8).total});
}

// Whether plans pick the deep pipeline where it fits. Measured on H200 (before the
// depth-split S): one deep CTA per SM reached only 0.65 of copy bandwidth on every
// memory-bound shape, against 0.74-0.90 for two 2-stage CTAs per SM: a CTA's compute per
// tile (~1.7 us alone), not the bytes in flight, bounds it, and two CTAs overlap theirs.
// Off until a measurement says otherwise; tests force it through DecodePlan.
constexpr bool kDeepPipelineByDefault = false;

// The deep pipeline runs 16-row tiles on GPUs with ~200 KB of shared memory per block
// (sm_90: 227 KB), never on the portable path (sm_80: 163 KB).
bool deep_pipeline_fits(bool portable, int rows_per_cta, int smem_per_block) {
  return kDeepPipelineByDefault && !portable && rows_per_cta == 16 &&
         smem_per_block >= deep_smem_bytes();
}

int rows_per_cta_for(int rows_per_request) {
  return rows_per_request <= 16 ? 16 : rows_per_request <= 32 ? 32 : 64;
}

// Split-KV heuristic. `ctas` CTAs exist per split (requests x row tiles); `slots` CTAs fit
// on the GPU at once. More splits fill the GPU when there are few requests, but each one
// costs a partial write and a combine read (2 KB per row, against >= 256 x 1152 B of keys
// read: <= 1 % extra for one row of bf16, 7 % for a 16-row tile), and a split of fewer than
// kMinKeysPerSplit keys is mostly pipeline start-up. Among 1..max splits (no cap but
// kMaxSplits), take the one whose last wave is fullest (CTAs / (waves * slots)), preferring
// fewer splits when within 3.5 % of the best. On H200 (132 SMs x 2 slots of 16 rows):
//   128 req x 16 heads -> 2 splits (256 of 264 slots);  32 x 12 heads, 32K keys -> 8 (256);
//   4 x 12 heads, 256K keys -> 64 (256);  1 x 12 heads, 64K keys -> 247, 1M -> 255.
// (With the deep pipeline, 1 slot per SM: 1, 4, 32 and 128.) plan_decode then evens the
// splits of a one-wave grid out (64K: 256, 1M: 263), and on the 16-row kernels gives a
// request of up to 64 tiles per SM (8 for fp8 caches) one split per SM instead, of as few
// tiles as that takes (4K: 128 splits of one tile, 64K: 128 of 16), measured faster.
int choose_num_splits(int64_t ctas, int64_t max_seq_len, int64_t slots) {
  if (ctas <= 0) return 1;
  const int max_splits = int(std::clamp<int64_t>(max_seq_len / kMinKeysPerSplit, 1, kMaxSplits));
  auto fill = [&](int s) {
    const int64_t total = ctas * s;
    return double(total) / double(ceil_div(total, slots) * slots);
  };
  double best = 0.0;
  for (int s = 1; s <= max_splits; ++s) best = std::max(best, fill(s));
  for (int s = 1; s <= max_splits; ++s)
    if (fill(s) >= best - 0.035) return s;
  return 1;
}

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// Workspace, three 256-byte aligned parts: ws_o (fp32 partial outputs), ws_lse (their
// LSEs), and the balanced schedule's pair table (int2 per (request, row tile)).
//   per_request: ws_o [num_requests, max_query_len * heads, num_splits, 512], ws_lse
//     [..., num_splits]; empty with 1 split (unless batch invariant: the combine always runs).
//   balanced: ws_o [2 num_workers, rows_per_cta, 512], ws_lse [2 num_workers, rows_per_cta]
//     (two slots per worker: decode_sched.cuh, balanced_slot), pair table [num_requests *
//     row tiles]. 264 workers x 16 rows: 17.3 MB; 132 x 64 rows: 34.6 MB, whatever the batch.
struct WorkspaceLayout {
  size_t lse_offset = 0, table_offset = 0, bytes = 0;
};
WorkspaceLayout workspace_layout(const DecodePlan& plan, int num_requests, int heads) {
  WorkspaceLayout w;
  const size_t max_rows = size_t(plan.max_query_len) * size_t(heads);
  if (plan.schedule == DecodeSchedule::balanced) {
    const size_t rows = size_t(2) * size_t(std::max(plan.num_workers, 0)) * plan.rows_per_cta;
    const size_t pairs = size_t(num_requests) * size_t(ceil_div(int64_t(max_rows), plan.rows_per_cta));
    w.lse_offset = align256(rows * kKvLoraRank * sizeof(float));
    w.table_offset = w.lse_offset + align256(rows * sizeof(float));
    w.bytes = w.table_offset + align256(pairs * sizeof(int2));
    return w;
  }
  if (plan.num_splits <= 1 && !plan.batch_invariant) return {};  // direct out / lse
  const size_t items = size_t(num_requests) * max_rows * size_t(plan.num_splits);
  w.lse_offset = align256(items * kKvLoraRank * sizeof(float));
  w.table_offset = w.bytes = w.lse_offset + align256(items * sizeof(float));
  return w;
}

// An integer from the environment (plan-time A/B switches), or `fallback`.
int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

// The fragment-path kernel of a bf16-activation fp8 launch (Fp8Kernel) at `ctas` CTAs per
// SM (DecodePlan::fp8_ctas_per_sm; fp8_ds_mla only). Plain fp8 runs on f16 mma (one
// conversion per pair of codes instead of four; decode_fp8_tiles, kF16Mma). Measured on H200
// (2026-12-03), (128, 12, 8K): 282.6 against 307.9 us on bf16 mma. KMLA_FP8_DECODE=bf16mma
// (read once) keeps bf16 mma for A/B timing. fp8_ds_mla folds its scales into S and P
// on f16 mma (kFoldScale) when they are powers of two (`pow2_scales`: CacheRef::tile_rule,
// the default rule), where that gives the same products; amax-rule scales keep
// bf16(code * scale). KMLA_FP8_DSFOLD=0 (read at every launch, an A/B switch the tests also
// set) turns the fold off. Measured on H200 (2026-12-03, (128, 12, 8k), bf16 332-333 us):
// fp8_ds_mla 345.4 us unfolded; folded on bf16 mma 335.4 at two CTAs and 326.2-330.0 at
// three; folded on f16 mma 322.1 at two and 310.8 at three (the bf16-mma fold kernels are
// gone with their switch, KMLA_FP8_DSF16); plain fp8 256.4-257.4.
// Tried and dropped (measured slower, same session and the one before): converting half or
// all of plain fp8's key codes on the integer pipe instead of the conversion unit (276.6 /
// 301.6 against 256.7 us); the split sum for plain fp8 (276.7 with the half conversion);
// plain fp8 at three CTAs (260.1 against 255.9; with V by byte permutes 262.4); V fragments
// by byte permutes instead of movmatrix at two CTAs (283.3); a 5-stage ring (263.2); f16 mma
// for fp8_ds_mla with power-of-two scales applied after the mma (425 against 352).
int fp8_kernel_variant(CacheFormat format, int ctas, bool pow2_scales) {
  static const bool f16mma = [] {
    const char* e = std::getenv("KMLA_FP8_DECODE");
    return e == nullptr || std::string_view(e) != "bf16mma";
  }();
  if (format == CacheFormat::fp8) return f16mma ? kFp8PlainF16 : kFp8Generic;
  const int three = ctas == 3 ? kFp8ThreeCtas : 0;
  const int fold = env_int("KMLA_FP8_DSFOLD", 1);
  KMLA_CHECK(fold == 0 || fold == 1, "decode: KMLA_FP8_DSFOLD must be 0 or 1, got ", fold);
  if (fold && pow2_scales) return kFp8DsMlaF16 | three;
  return three ? kFp8DsMla | three : kFp8Generic;
}

// Launches a fragment-path kernel; its shared memory follows from its raw stages.
template <class T, int kFp8>
void launch_fp8_variant(DecodeArgs& args, dim3 grid, cudaStream_t stream) {
  auto variant = decode_splitkv_kernel<T, 16, true, kStages, kFp8>;
  const int smem_bytes = smem_plan(16, args.entry_bytes, kStages, fp8_stages(kFp8)).total;
  KMLA_CUDA_CHECK(
      cudaFuncSetAttribute(variant, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  // Three CTAs need (almost) all of the SM's 228 KB as shared memory: ask for it, rather
  // than leave the L1 / shared split to the driver's heuristic.
  if constexpr ((kFp8 & kFp8ThreeCtas) != 0)
    KMLA_CUDA_CHECK(cudaFuncSetAttribute(variant, cudaFuncAttributePreferredSharedMemoryCarveout,
                                         int(cudaSharedmemCarveoutMaxShared)));
  launch_split_kernel(variant, grid, 128, smem_bytes, stream, args);
}

// fp8_ctas: DecodePlan::fp8_ctas_per_sm; pow2_scales: fp8_ds_mla's tile scales are powers
// of two (both for the fp8 formats' 16-row 2-stage kernels only).
template <class T, int ROWS, bool kConvert, int STAGES = kStages>
void launch_splitkv(DecodeArgs& args, dim3 grid, int smem_bytes, cudaStream_t stream,
                    int fp8_ctas = 2, bool pow2_scales = false) {
  if constexpr (kConvert && std::is_same_v<T, bf16> && fp8_fragment_path(ROWS, 1, STAGES)) {
    switch (fp8_kernel_variant(args.format, fp8_ctas, pow2_scales)) {
      case kFp8PlainF16:
        return launch_fp8_variant<T, kFp8PlainF16>(args, grid, stream);
      case kFp8DsMla | kFp8ThreeCtas:
        return launch_fp8_variant<T, kFp8DsMla | kFp8ThreeCtas>(args, grid, stream);
      case kFp8DsMlaF16:
        return launch_fp8_variant<T, kFp8DsMlaF16>(args, grid, stream);
      case kFp8DsMlaF16 | kFp8ThreeCtas:
        return launch_fp8_variant<T, kFp8DsMlaF16 | kFp8ThreeCtas>(args, grid, stream);
      default:
        break;
    }
  }
  auto kernel = decode_splitkv_kernel<T, ROWS, kConvert, STAGES>;
  // A host-side attribute (no sync, allowed during graph capture), set on every launch so
  // that it holds on whichever device is current.
  KMLA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  launch_split_kernel(kernel, grid, ROWS / 16 * 128, smem_bytes, stream, args);
}

// The 16-row 16-bit-cache kernel's warp-own form (DecodePlan::row16_warp_own): the 2-stage
// plan's shared memory and grid.
template <class T>
void launch_splitkv_warp_own(DecodeArgs& args, dim3 grid, cudaStream_t stream) {
  auto kernel = decode_splitkv_kernel<T, 16, false, kStages, kFp8Generic, true>;
  const int smem_bytes = smem_plan(16, 0, kStages).total;
  KMLA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  launch_split_kernel(kernel, grid, 128, smem_bytes, stream, args);
}

// DecodePlan::row16_warp_own for a finished plan: on for plans over a 16-bit cache that are
// not portable (measured 3-7 % faster than the shared-loader form on every memory-bound shape,
// docs/decode_sm90.md); KMLA_DECODE_WARP_OWN=0 keeps the shared-loader form for A/B runs.
// Only the 2-stage 16-row kernel reads it, so a plan whose row tile a caller changes to 16
// later keeps it. It changes the bits (S is added in another order), not the tolerance.
bool choose_row16_warp_own(const DecodePlan& plan, CacheFormat format) {
  const int env = env_int("KMLA_DECODE_WARP_OWN", 1);
  KMLA_CHECK(env == 0 || env == 1, "decode: KMLA_DECODE_WARP_OWN must be 0 or 1, got ", env);
  return env == 1 && !plan.portable &&
         (format == CacheFormat::bf16 || format == CacheFormat::fp16);
}

// The partials a row expects: per-request splits, or balanced workers over the pairs.
int64_t partials_per_row(const DecodePlan& plan, int64_t pairs) {
  return plan.schedule == DecodeSchedule::balanced
             ? ceil_div(int64_t(plan.num_workers), std::max<int64_t>(pairs, 1))
             : plan.num_splits;
}

// Whether the rows of a batch of `pairs` (request, row tile) pairs collect more than 32
// partials on average (partials_per_row; a few long requests: 4 x 256K keys cut into ~66
// pieces each). Such rows take the combine's CTA-per-row form (the warp form walks the LSEs
// three times and reads the partials one after another: measured on H200 (2026-12-03),
// (4, 12, 256K) 311.4-313.2 against 320.8-322.5 us; lower thresholds
// (8, 4, 2; KMLA_DECODE_COMBINE_ROWS_PARTS) gained nothing at (32, 12, 32K) (~8 partials)
// and cost fp8_ds_mla 10 % at 2), so such balanced plans keep the combine launch rather
// than the fused merge, a warp per row (H200, 2026-12-05: (4, 12, 256K) 329.4 fused against
// 297.2).
bool many_partials(const DecodePlan& plan, int64_t pairs) {
  return partials_per_row(plan, pairs) > env_int("KMLA_DECODE_COMBINE_ROWS_PARTS", 32);
}

}  // namespace

DecodePlan plan_decode(int num_requests, int heads, int max_query_len, int64_t max_seq_len,
                       bool portable, bool batch_invariant, CacheFormat format) {
  KMLA_CHECK(num_requests >= 0, "decode: num_requests must be >= 0, got ", num_requests);
  KMLA_CHECK(heads >= 1 && heads <= 128, "decode: heads must be in [1, 128], got ", heads);
  KMLA_CHECK(max_query_len >= 1 && max_query_len <= 128,
             "decode: max_query_len must be in [1, 128], got ", max_query_len);
  KMLA_CHECK(max_seq_len >= 0, "decode: max_seq_len must be >= 0, got ", max_seq_len);
  DecodePlan plan;
  plan.max_query_len = max_query_len;
  plan.portable = portable;
  plan.batch_invariant = batch_invariant;
  if (batch_invariant) {
    // The row tile from the head count alone (a layer constant), not from the batch's
    // longest query: a row's reductions do not depend on the tile size, but pinning it
    // keeps every request on one compiled kernel, so not even the compiler's choices
    // (contractions, unrolling) can differ between batches. The grid gets enough splits
    // for the longest sequence; each request uses only as many as its own length asks for.
    plan.rows_per_cta = rows_per_cta_for(heads);
    int device = 0, smem_per_block = 0;
    KMLA_CUDA_CHECK(cudaGetDevice(&device));
    KMLA_CUDA_CHECK(cudaDeviceGetAttribute(&smem_per_block,
                                           cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    plan.deep_pipeline = deep_pipeline_fits(portable, plan.rows_per_cta, smem_per_block);
    const int64_t seq = std::min<int64_t>(max_seq_len, std::numeric_limits<int32_t>::max());
    plan.num_splits = int(std::clamp<int64_t>(ceil_div(seq, int64_t(kInvariantMinKeys)), 1,
                                              kMaxSplits));
    plan.row16_warp_own = choose_row16_warp_own(plan, format);
    plan.workspace_bytes = decode_workspace_bytes(plan, num_requests, heads);
    return plan;
  }
  plan.rows_per_cta = rows_per_cta_for(max_query_len * heads);
  // 17-32 rows per request (12 heads x 2 tokens, 16 x 2) on sm_90: the wgmma kernel's 64-row
  // tile, half empty or more, instead of the mma.sync kernel's 32-row one
  // (decode_sm90_takes_rows, DecodeSm90Options::min_rows; KMLA_DECODE_SM90_MIN_ROWS=32 keeps
  // the 32-row kernel). Measured on H100: see docs/PERF.md, eighteenth session.
  if (plan.rows_per_cta < kDecodeSm90Rows &&
      decode_sm90_takes_rows(max_query_len * heads, num_requests, max_seq_len, format, portable))
    plan.rows_per_cta = kDecodeSm90Rows;
  // fp8 caches' 17-32 rows: two 16-row tiles (the fragment path, decode_fp8_tiles; the walk
  // table runs a request's two tiles in lockstep on neighbouring CTAs) instead of the 32-row
  // kernel's conversion pass. Measured on H100 (2026-12-06, eighteenth session, (128, 12, 8k,
  // q 2), us): fp8_ds_mla 953 -> 589, plain fp8 645 -> 443.
  if (plan.rows_per_cta == 32 && !portable &&
      (format == CacheFormat::fp8 || format == CacheFormat::fp8_ds_mla))
    plan.rows_per_cta = 16;
  // KMLA_DECODE_ROWS=16|32|64 (A/B runs): that row tile whatever the rows.
  if (const int rows = env_int("KMLA_DECODE_ROWS", 0); rows != 0) {
    KMLA_CHECK(rows == 16 || rows == 32 || rows == 64,
               "decode: KMLA_DECODE_ROWS must be 16, 32 or 64, got ", rows);
    plan.rows_per_cta = rows;
  }

  int device = 0, sms = 0, smem_per_sm = 0, threads_per_sm = 0, smem_per_block = 0;
  KMLA_CUDA_CHECK(cudaGetDevice(&device));
  KMLA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  KMLA_CUDA_CHECK(
      cudaDeviceGetAttribute(&smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  KMLA_CUDA_CHECK(
      cudaDeviceGetAttribute(&threads_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device));
  KMLA_CUDA_CHECK(cudaDeviceGetAttribute(&smem_per_block,
                                         cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  plan.deep_pipeline = deep_pipeline_fits(portable, plan.rows_per_cta, smem_per_block);
  // CTAs per SM from shared memory (1 KB per CTA is reserved by the driver) and threads.
  int smem =
      (plan.deep_pipeline ? deep_smem_bytes() : smem_plan(plan.rows_per_cta, 0, kStages).total) +
      1024;
  // fp8_ds_mla's 16-row kernels at three CTAs per SM: their own shared memory (and launch
  // bounds) then allow three. Measured on H200 (2026-12-03, (128, 12, 8k)): folded scales
  // 330.0 against 335.4 us at two on bf16 mma, 310.8 against 322.1 on f16 mma (plain fp8
  // lost at three, 260.1 against 255.9, and has no such kernel). KMLA_FP8_CTAS=2 keeps two
  // (A/B).
  const int fp8_ctas = env_int("KMLA_FP8_CTAS", 3);
  KMLA_CHECK(fp8_ctas == 2 || fp8_ctas == 3, "decode: KMLA_FP8_CTAS must be 2 or 3, got ",
             fp8_ctas);
  if (format == CacheFormat::fp8_ds_mla && fp8_ctas == 3 && !portable && !plan.deep_pipeline &&
      plan.rows_per_cta == 16) {
    const int smem3 = smem_plan(16, kDsMlaEntryBytes, kStages, kFp8StagesThreeCtas).total + 1024;
    if (smem_per_sm / smem3 >= 3) {
      plan.fp8_ctas_per_sm = 3;
      smem = smem3;
    }
  }
  const int threads = plan.rows_per_cta / 16 * 128;
  const int per_sm = std::max(1, std::min(smem_per_sm / smem, threads_per_sm / threads));
  const int64_t ctas =
      int64_t(num_requests) * ceil_div(int64_t(max_query_len) * heads, plan.rows_per_cta);
  const int64_t slots = int64_t(sms) * per_sm;
  plan.num_splits = choose_num_splits(ctas, max_seq_len, slots);
  // Even splits. A request's splits are equal tile ranges of ceil(tiles / splits) tiles,
  // so the fill rule's 247 splits of a 64K-key request (2,048 tiles) give 9 tiles to 227
  // CTAs and none to the last 20, and the kernel takes as long as 9 tiles. When the grid
  // is one wave, take the fewest tiles per CTA that one wave allows instead: 2,048 tiles
  // over 264 slots -> 8 tiles x 256 splits (1M keys: 125 x 263 instead of 129 x 255).
  // KMLA_DECODE_EVEN_SPLITS=0 keeps the fill rule alone (A/B runs).
  const bool one_wave = ctas > 0 && ctas * plan.num_splits <= slots;
  const int64_t tiles = ceil_div(std::max<int64_t>(max_seq_len, 1), int64_t(kKeyTile));
  // One CTA per SM, below, while a CTA then holds at most this many key tiles.
  // KMLA_DECODE_SM_SPLIT_TILES=N sets it (0: never one per SM; A/B runs).
  const bool bits16 = format == CacheFormat::bf16 || format == CacheFormat::fp16;
  const int64_t sm_tiles = env_int("KMLA_DECODE_SM_SPLIT_TILES", bits16 ? 64 : 8);
  const bool row16 = !portable && plan.rows_per_cta == 16;
  if (one_wave && env_int("KMLA_DECODE_EVEN_SPLITS", 1) != 0) {
    const int64_t min_tiles = kMinKeysPerSplit / kKeyTile;
    const int64_t per_wave = std::min<int64_t>(slots / ctas, kMaxSplits);
    int64_t per_split = std::max(min_tiles, ceil_div(tiles, per_wave));
    // One CTA per SM. On the 16-row kernels (not the portable ones: unmeasured) a request
    // that splits anyway runs faster as one split per SM, of as few tiles as that takes
    // (down to one), than as two per SM of at least 8 tiles: a short request's few CTAs kept
    // too few tiles in flight, and for a long one half as many partials save more than the
    // second CTA per SM gains, up to 64 tiles a split over a 16-bit cache and 8 over an fp8
    // one. One request at 12 heads, H100 (2026-12-07, twenty-fifth session, two rounds;
    // docs/PERF.md), us, before -> now:
    //   bf16        4K 16.0 -> 13.5 (32 -> 128 splits), 8K 16.5 -> 15.3, 64K 38.0 -> 36.6,
    //               128K 62.2 -> 61.5, 256K 110.7 -> 109.6; past 64 tiles one per SM lost
    //               (512K 205.6 -> 206.0, 1M 394.9 -> 397.1), so two per SM stay there;
    //   fp8         4K 24.5 -> 17.5, 8K 24.8 -> 19.2, 16K 24.7 -> 21.7 (64K: 36.1 -> 36.6);
    //   fp8_ds_mla  4K 29.0 -> 18.1, 8K 29.4 -> 19.7, 16K 29.3 -> 23.8 (64K: 39.4 -> 44.9).
    // The 64-row kernel keeps the rule above ((1, 128, 16K) 37.0 -> 49.3 us on one per SM).
    const int64_t sm_splits = std::min<int64_t>(sms / ctas, kMaxSplits);
    const int64_t per_sm_split = ceil_div(tiles, std::max<int64_t>(sm_splits, 1));
    if (row16 && sm_splits > 1 && tiles > min_tiles && per_sm_split <= sm_tiles)
      per_split = per_sm_split;
    plan.num_splits = int(std::clamp<int64_t>(ceil_div(tiles, per_split), 1, kMaxSplits));
  }
  // KMLA_DECODE_SPLITS=N: N splits per request whatever the rules above say (A/B runs).
  if (const int forced = env_int("KMLA_DECODE_SPLITS", 0); forced > 0)
    plan.num_splits = std::min(forced, kMaxSplits);
  // Balanced: one wave of workers on the CTA slots (264 on H200 for 16 / 32-row tiles, 132
  // for 64-row ones), a multiple of the requests just below that when one is near
  // (decode_balanced_workers): a uniform batch then cuts no request, so no row needs the
  // combine and no CTA switches requests. For the 64-row (wgmma) kernel, measured on H100
  // (2026-12-05, eighth session, alternated): 128 workers in place of all 132 slots made
  // q 4 (128, 12, 8k) 436.8 -> 422.0 us, DSpark 235.8 -> 228.5, (64, 128, 8k) 331.5 ->
  // 320.9, (128, 128, 4k) 346.3 -> 339.9, (16, 128, 4k) 76.9 -> 69.6, and left the mixed
  // q 2..6 batch as it was (501.8 against 504.6; an H200 measurement of an older kernel had
  // it 2.8 % slower). The device takes fewer workers when the batch is small
  // (sched_min_keys; for the 16-row kernels, see below).
  const char* sched = std::getenv("KMLA_DECODE_SCHEDULE");
  // One request has nothing to balance: its equal per-request splits were faster on H200
  // (64K keys: 50.3 against 62.4 us balanced; 1M: 343.5 against 346.3).
  const bool balanced = sched && *sched ? std::string_view(sched) == "balanced"
                                        : num_requests > 1 &&
                                              num_requests <= kDecodeBalancedMaxRequests;
  // Small batches on the 16-row kernels (not the portable ones: unmeasured), as for one
  // request above: shares of as little as one key tile (the walk kept at least 8, so 2 x 4K
  // keys ran on ~33 CTAs), and one worker per SM while that gives a worker at most sm_tiles
  // tiles, every pair counted at the longest length. The combine of such a grid is launched
  // early (PDL, below), as one request's is: its CTAs fit beside one split CTA per SM. Uniform
  // batches of 12 heads, H100 (2026-12-07, twenty-sixth session, two rounds; docs/PERF.md),
  // us, before -> now:
  //   bf16        2 x 4K 28.3 -> 18.4, 4 x 4K 32.1 -> 23.9, 8 x 4K 40.5 -> 30.0, 2 x 16K
  //               32.4 -> 27.7, 8 x 16K 72.8 -> 66.7, 8 x 8K at 16 heads 55.6 -> 41.8 (of
  //               which PDL 2 x 4K 20.1 -> 18.4); 16 x 16K, 32 x 4K, 64 x 2K, 128 x 512 and
  //               128 x 1K within 1 us;
  //   fp8         2 x 4K 34.9 -> 21.9, 4 x 16K 47.7 -> 43.1 (one-tile shares alone: one per
  //               SM 44.2);
  //   fp8_ds_mla  2 x 4K 40.0 -> 22.1, 16 x 4K 53.9 -> 47.0 (one per SM 49.3), 4 x 16K 56.1 ->
  //               49.2 (one per SM 53.5).
  const bool sm_workers = balanced && row16 && ctas * tiles <= sm_tiles * sms;
  if (balanced && num_requests > 0) {
    plan.schedule = DecodeSchedule::balanced;
    if (row16) plan.sched_min_keys = kKeyTile;
    int64_t workers = decode_balanced_workers(sm_workers ? sms : slots, num_requests);
    // 64-row tiles (not the portable ones: unmeasured), whose pieces cost the most to start and
    // merge: a multiple of the (request, row tile) pairs where that idles at most 1/8 of the
    // slots, while the pairs at the longest length hold at most 40 tiles of 64 keys a slot,
    // so a uniform batch gives every worker one piece. H100 (2026-12-07, twenty-sixth session, two
    // rounds; docs/PERF.md), us, the requests' multiple (or all slots) -> the pairs': 12 x 128
    // heads x 4K 62.9 -> 57.4 (132 -> 120 workers), 20 x 128 x 4K 80.8 -> 74.1, 10 x 128 x 4K 59.2
    // -> 52.0, 7 x 128 x 4K 54.2 -> 46.3 (126), 7 x 128 x 16K 100.6 -> 93.6 (126, 27 tiles a slot),
    // 40 x 64 x 8K 156.7 -> 146.3 (39 tiles), 24 x 12 heads x 8K x 4 tokens 110.7 -> 99.3; past the
    // 40 tiles the idle slots cost more (12 x 128 x 16K, 47 tiles: 140.8 -> 144.0).
    if (!portable && plan.rows_per_cta == 64 && ctas <= slots && workers % ctas != 0) {
      const int64_t aligned = slots / ctas * ctas;
      const int64_t tiles64 = ceil_div(std::max<int64_t>(max_seq_len, 1), int64_t(64));
      if ((slots - aligned) * 8 <= slots && ctas * tiles64 <= 40 * slots) workers = aligned;
    }
    plan.num_workers =
        int(std::clamp<int64_t>(env_int("KMLA_DECODE_WORKERS", int(workers)), 1, kMaxSplits));
    plan.sched_pair_keys = env_int("KMLA_DECODE_PAIR_KEYS", plan.sched_pair_keys);
    plan.sched_min_keys = env_int("KMLA_DECODE_MIN_KEYS", plan.sched_min_keys);
    plan.sched_nosplit_keys = env_int("KMLA_DECODE_NOSPLIT_KEYS", plan.sched_nosplit_keys);
    plan.pass_major = env_int("KMLA_DECODE_PASS_ORDER", 1) != 0;
  }
  int major = 0;
  KMLA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  // Off for balanced plans of 16 / 32-row tiles: launched early, the combine's waiting CTAs
  // took SM slots from the split kernel. Measured on H200: mixed lengths 327 us without against 358
  // with, (1, 12, 64K) balanced 56.5 against 62.4; uniform (128, 12, 8K) 337.8 against 333.6. On
  // for a per-request grid of one wave (one long request): every split CTA is resident from the
  // start, so the combine's CTAs (no dynamic shared memory) only use what the split CTAs leave of
  // each SM, and the gap between the kernels goes. On for balanced plans of 64-row tiles, whose
  // combine is the heaviest (64 rows a pair; 14-18 us on H200 when skipped): on H100 (2026-12-05,
  // eighth session, alternated twice) it saved 1-3.5 us on every wgmma shape ((128, 128, 4k) 343.4
  // / 342.6 -> 339.4 / 339.7, q 4 423.5 / 423.9 -> 422.1 / 422.6, mixed q 2..6 505.5 / 505.7 ->
  // 504.5 / 502.7). The 16-row shapes gained 0.5-2 us there too but stay off (the H200 had them
  // within +-0.8 % and mixed lengths 1 % slower, 2026-12-03, night), except on one worker per SM
  // (sm_workers, above). KMLA_DECODE_PDL=0|1 overrides.
  const int pdl = env_int("KMLA_DECODE_PDL", -1);
  const bool pdl_default =
      balanced ? plan.rows_per_cta == 64 || sm_workers : one_wave && plan.num_splits > 1;
  plan.programmatic_combine = major >= 9 && (pdl >= 0 ? pdl != 0 : pdl_default);
  // The fused combine (balanced plans): the split kernel, launched cooperatively, merges the
  // rows of cut pairs itself after a grid-wide barrier, so no combine launch follows it and a
  // batch that cuts no pair merges nothing. Not for 64-row tiles with fewer (request, row
  // tile) pairs than workers, where a uniform batch cuts every pair: there the combine kernel,
  // a programmatic dependent, merges them sooner. Measured on H100 (2026-12-06, three rounds,
  // fused / not): (16, 128, 4k) 64.2 / 65.2 / 65.0 against 63.5 / 63.2 / 63.4 us, DSpark
  // 225.2 / 224.2 / 224.0 against 222.7 / 223.2 / 223.6; batches that cut no pair pay 1-4 us
  // for the launch ((128, 128, 4k) 321.4 / 323.0 / 322.5 against 325.9 / 326.6 / 325.7, q 4
  // 413.5 / 411.9 / 412.7 against 415.2 / 415.6 / 415.6) and keep it fused. A second H100
  // (fused forced / this rule): (16, 128, 4k) 63.7 / 64.2 / 63.6 against 63.4 / 64.1 / 63.0,
  // DSpark 221.8 / 221.7 / 221.6 against 221.2 / 220.9 / 220.4.
  // KMLA_DECODE_FUSED=0|1 overrides the default.
  const int fused = env_int("KMLA_DECODE_FUSED", -1);
  const bool every_pair_cut = plan.rows_per_cta == 64 && ctas < plan.num_workers;
  plan.fused_combine =
      balanced && (fused >= 0 ? fused != 0 : !many_partials(plan, ctas) && !every_pair_cut);
  plan.row16_warp_own = choose_row16_warp_own(plan, format);
  plan.workspace_bytes = decode_workspace_bytes(plan, num_requests, heads);
  return plan;
}

int64_t decode_balanced_workers(int64_t slots, int num_requests) {
  if (num_requests <= 0 || num_requests > slots) return slots;
  const int64_t aligned = slots / num_requests * num_requests;
  return (slots - aligned) * 32 <= slots ? aligned : slots;
}

size_t decode_workspace_bytes(const DecodePlan& plan, int num_requests, int heads) {
  return workspace_layout(plan, num_requests, heads).bytes;
}

namespace {

// The scheduler's fields of the split kernel's arguments (a.heads set): what the balanced
// walk reads besides the lengths, on the device and in decode_walk_table alike.
void set_sched_args(DecodeArgs& a, const DecodePlan& plan) {
  const bool balanced = plan.schedule == DecodeSchedule::balanced;
  a.max_rows = plan.max_query_len * a.heads;
  a.balanced = balanced;
  a.num_workers = plan.num_workers;
  a.rows_per_cta = plan.rows_per_cta;
  a.row_tiles = int(ceil_div(a.max_rows, plan.rows_per_cta));
  a.sched_pair_keys = plan.sched_pair_keys;
  a.sched_min_keys = plan.sched_min_keys;
  a.sched_nosplit_keys = plan.sched_nosplit_keys;
  a.pass_major = balanced && plan.pass_major;
}

}  // namespace

size_t decode_walk_table_bytes(const DecodePlan& plan, int num_requests) {
  return plan.schedule == DecodeSchedule::balanced
             ? walk_table_bytes(plan.num_workers, num_requests)
             : 0;
}

int decode_walk_table(const DecodePlan& plan, int heads, bool causal, CacheFormat format,
                      int num_requests, const int32_t* seq_lens, const int32_t* query_lens,
                      void* out) {
  if (plan.schedule != DecodeSchedule::balanced) return 0;
  DecodeParams p;  // what decode_sm90_supports reads
  p.heads = heads;
  p.cache.format = format;
  const int key_tile = decode_sm90_supports(p, plan) ? kDecodeSm90Keys : kKeyTile;
  DecodeArgs a{};  // the fields the walk reads (as decode_args sets them)
  a.seq_lens = seq_lens;
  a.query_lens = query_lens;
  a.num_requests = num_requests;
  a.heads = heads;
  a.causal = causal;
  set_sched_args(a, plan);
  static const int lockstep =
      env_int_in("KMLA_DECODE_LOCKSTEP", kLockstepAll, kLockstepOff, kLockstepAll);
  balanced_walk_table(a, plan.rows_per_cta, key_tile, plan.num_workers, out, lockstep);
  // KMLA_DECODE_UNCUT_SKIP=0 (read once): the fused combine's grid barrier even when no pair
  // is cut (A/B runs).
  static const bool uncut_skip = env_switch("KMLA_DECODE_UNCUT_SKIP", true);
  if (!uncut_skip) {
    auto* starts = reinterpret_cast<WalkStart*>(static_cast<WalkTableHead*>(out) + 1);
    for (int w = 0; w < plan.num_workers; ++w) starts[w].cuts = std::max(starts[w].cuts, 1);
  }
  return key_tile;
}

// The launch depends only on the plan, batch.num_requests and heads (never on lengths read
// from the device), so a captured graph replays with any lengths of the planned shape.
// Callers (the tests do) may overwrite the schedule, plan.num_splits (1..1024),
// plan.num_workers (1..1024), the sched_* costs and plan.rows_per_cta (16, 32, 64) after
// plan_decode, provided plan.workspace_bytes still covers decode_workspace_bytes(plan, ...)
// (workspace_layout above); run_split checks this.
namespace {

// Checks the parameters and the plan and fills the split kernel's arguments but the
// workspace pointers (run_split sets them).
DecodeArgs decode_args(const DecodeParams& p, const DecodePlan& plan) {
  const DeviceBatch& b = p.batch;
  KMLA_CHECK(p.heads >= 1 && p.heads <= 128, "decode: heads must be in [1, 128], got ", p.heads);
  KMLA_CHECK(b.num_requests >= 0 && b.num_requests <= 65535,
             "decode: num_requests must be in [0, 65535], got ", b.num_requests);
  KMLA_CHECK(plan.rows_per_cta == 16 || plan.rows_per_cta == 32 || plan.rows_per_cta == 64,
             "decode: plan.rows_per_cta must be 16, 32 or 64, got ", plan.rows_per_cta);
  KMLA_CHECK(plan.num_splits >= 1 && plan.num_splits <= kMaxSplits,
             "decode: plan.num_splits must be in [1, ", kMaxSplits, "], got ", plan.num_splits);
  const bool balanced = plan.schedule == DecodeSchedule::balanced;
  KMLA_CHECK(!balanced || !plan.batch_invariant,
             "decode: a batch-invariant plan needs the per-request schedule");
  KMLA_CHECK(!balanced || (plan.num_workers >= 1 && plan.num_workers <= kMaxSplits),
             "decode: plan.num_workers must be in [1, ", kMaxSplits, "], got ", plan.num_workers);
  KMLA_CHECK(!balanced || b.num_requests <= kDecodeBalancedMaxRequests,
             "decode: the balanced schedule takes at most ", kDecodeBalancedMaxRequests,
             " requests, got ", b.num_requests);
  KMLA_CHECK(plan.sched_pair_keys >= 0 && plan.sched_min_keys >= 0 && plan.sched_nosplit_keys >= 0,
             "decode: the plan's scheduler costs must be >= 0, got pair ", plan.sched_pair_keys,
             ", min ", plan.sched_min_keys, ", nosplit ", plan.sched_nosplit_keys, " keys");
  KMLA_CHECK(plan.max_query_len >= 1 && plan.max_query_len <= 128,
             "decode: plan.max_query_len must be in [1, 128], got ", plan.max_query_len);
  KMLA_CHECK(plan.fp8_ctas_per_sm == 2 || plan.fp8_ctas_per_sm == 3,
             "decode: plan.fp8_ctas_per_sm must be 2 or 3, got ", plan.fp8_ctas_per_sm);
  KMLA_CHECK(p.act == DType::bf16 || p.act == DType::f16,
             "decode: the activation dtype must be bf16 or f16, got ", dtype_name(p.act));
  const CacheFormat fmt = p.cache.format;
  const bool cache16 = fmt == CacheFormat::bf16 || fmt == CacheFormat::fp16;
  KMLA_CHECK(!cache16 || (fmt == CacheFormat::bf16) == (p.act == DType::bf16),
             "decode: a 16-bit cache must have the activation dtype (", dtype_name(p.act),
             "), got a ", cache_format_name(fmt), " cache");
  KMLA_CHECK(!p.q_fp8 || fmt == CacheFormat::fp8,
             "decode: fp8 queries need the plain fp8 cache, got ", cache_format_name(fmt));
  KMLA_CHECK(p.cache.block_size >= 1 && p.cache.block_size <= 1024,
             "decode: cache block size must be in [1, 1024], got ", p.cache.block_size);
  // cp.async copies 16-byte chunks: every row must start 16-byte aligned.
  KMLA_CHECK(reinterpret_cast<uintptr_t>(p.cache.base) % 16 == 0 && p.cache.block_stride % 16 == 0,
             "decode: the cache base and block stride (", p.cache.block_stride,
             " B) must be 16-byte aligned");
  KMLA_CHECK(reinterpret_cast<uintptr_t>(p.q) % 16 == 0, "decode: q must be 16-byte aligned");
  // The combine stores 4 output elements at a time; the split kernels write LSEs as floats.
  KMLA_CHECK(
      reinterpret_cast<uintptr_t>(p.out) % 8 == 0 && reinterpret_cast<uintptr_t>(p.lse) % 4 == 0,
      "decode: out must be 8-byte and lse 4-byte aligned, got out ", p.out, ", lse ", p.lse);
  DecodeArgs a{};
  a.q = p.q;
  a.q_fp8 = p.q_fp8;
  a.cache_base = p.cache.base;
  a.block_stride = p.cache.block_stride;
  a.num_blocks = p.cache.num_blocks;
  a.block_size = p.cache.block_size;
  a.block_shift = decode_block_shift(p.cache.block_size);
  a.entry_bytes = int(CacheRef::cache_entry_bytes_hd(fmt));
  a.format = fmt;
  a.block_tables = b.block_tables;
  a.seq_lens = b.seq_lens;
  a.query_lens = b.query_lens;
  a.query_start = b.query_start;
  a.max_blocks = b.max_blocks;
  a.num_requests = b.num_requests;
  a.heads = p.heads;
  a.causal = p.causal;
  const bool plain_fp8 = fmt == CacheFormat::fp8;
  const float qk_scale = (p.q_fp8 ? p.q_scale : 1.0f) * (plain_fp8 ? p.cache.k_scale : 1.0f);
  a.score_scale_log2 = p.softmax_scale * qk_scale * kLog2e;
  a.v_scale = plain_fp8 ? p.cache.k_scale : 1.0f;
  a.out = p.out;
  a.lse = p.lse;
  a.error_flag = p.error_flag;
  a.num_splits = plan.num_splits;
  a.batch_invariant = plan.batch_invariant;
  a.direct_out = !balanced && plan.num_splits == 1 && !plan.batch_invariant;
  set_sched_args(a, plan);
  a.fused_combine = balanced && plan.fused_combine && !plan.batch_invariant;
  a.merge_rows = a.fused_combine ? std::max(env_int("KMLA_DECODE_MERGE_ROWS", 0), 0) : 0;
  return a;
}

// The split kernel of decode_attention(p, plan); returns its arguments with the workspace
// pointers, which the combine (or the W_UV epilogue) then reads. Nothing runs for a batch
// without requests (a.num_requests == 0). `fused`: the plan's fused combine may run (not
// where the W_UV epilogue merges the rows).
DecodeArgs run_split(const DecodeParams& p, const DecodePlan& plan, void* workspace,
                     cudaStream_t stream, bool fused = true) {
  DecodeArgs a = decode_args(p, plan);
  a.fused_combine = a.fused_combine && fused;
  const DeviceBatch& b = p.batch;
  if (b.num_requests == 0) return a;
  const bool balanced = a.balanced;

  const WorkspaceLayout ws = workspace_layout(plan, b.num_requests, p.heads);
  KMLA_CHECK(ws.bytes <= plan.workspace_bytes, "decode: the plan's workspace (",
             plan.workspace_bytes, " B) is smaller than ", b.num_requests, " requests x ", p.heads,
             " heads x ", balanced ? plan.num_workers : plan.num_splits,
             balanced ? " workers" : " splits", " need (", ws.bytes, " B)");
  KMLA_CHECK(ws.bytes == 0 || workspace != nullptr, "decode: the plan needs a workspace of ",
             ws.bytes, " B, got none");

  if (ws.bytes) {
    std::byte* const base = static_cast<std::byte*>(workspace);
    a.ws_o = reinterpret_cast<float*>(base);
    a.ws_lse = reinterpret_cast<float*>(base + ws.lse_offset);
    if (balanced) a.pair_table = reinterpret_cast<int2*>(base + ws.table_offset);
  }

  // Balanced: one CTA per worker (the workers beyond what the lengths need exit at once).
  const dim3 grid = balanced ? dim3(unsigned(plan.num_workers))
                             : dim3(unsigned(a.row_tiles), unsigned(plan.num_splits),
                                    unsigned(b.num_requests));
  const int rows = plan.rows_per_cta;
  const bool convert = !(a.format == CacheFormat::bf16 || a.format == CacheFormat::fp16);
  const bool deep = plan.deep_pipeline && rows == 16;
  const int stages = deep ? (convert ? kDeepStagesFp8 : kDeepStages16) : kStages;
  const int smem = smem_plan(rows, convert ? a.entry_bytes : 0, stages).total;
  // More than 32 rows per request (16-bit cache) on sm_90a: the wgmma kernel (decode_sm90.cu),
  // same grid, same workspace, same combine.
  const bool sm90 = decode_sm90_supports(p, plan);
  // The host's walk starts where they were made for this kernel's key tile.
  // KMLA_DECODE_WALK_TABLE=0 (read once) ignores them (A/B runs).
  static const bool use_table = env_int("KMLA_DECODE_WALK_TABLE", 1) != 0;
  if (balanced && use_table && p.walk_key_tile == (sm90 ? kDecodeSm90Keys : kKeyTile))
    a.walk_table = p.walk_table;
  dispatch_act(p.act, [&]<class T>() {
    if (sm90) {
      launch_decode_sm90(a, p.act, grid, stream);
    } else if (deep) {
      convert ? launch_splitkv<T, 16, true, kDeepStagesFp8>(a, grid, smem, stream)
              : launch_splitkv<T, 16, false, kDeepStages16>(a, grid, smem, stream);
    } else if (rows == 16 && !convert && plan.row16_warp_own) {
      launch_splitkv_warp_own<T>(a, grid, stream);
    } else if (rows == 16) {
      convert ? launch_splitkv<T, 16, true>(a, grid, smem, stream, plan.fp8_ctas_per_sm,
                                            p.cache.tile_rule == TileScaleRule::power_of_two)
              : launch_splitkv<T, 16, false>(a, grid, smem, stream);
    } else if (rows == 32) {
      convert ? launch_splitkv<T, 32, true>(a, grid, smem, stream)
              : launch_splitkv<T, 32, false>(a, grid, smem, stream);
    } else {
      convert ? launch_splitkv<T, 64, true>(a, grid, smem, stream)
              : launch_splitkv<T, 64, false>(a, grid, smem, stream);
    }
  });
  return a;
}

// Launches `kernel` after the split kernel on `stream`, as its programmatic dependent (sm_90:
// the launch overlaps the split kernel's tail; the kernel waits with griddepcontrol.wait
// before it reads the split kernel's output) when `programmatic`.
// `cluster` > 1: thread-block clusters of that many CTAs along x.
template <class... Params, class... Args>
void launch_after_split(void (*kernel)(Params...), dim3 grid, int threads, int smem,
                        cudaStream_t stream, bool programmatic, int cluster, const Args&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = size_t(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (programmatic) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n++].val.clusterDim = {unsigned(cluster), 1, 1};
  }
  cfg.attrs = attr;
  cfg.numAttrs = unsigned(n);
  KMLA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

// The combine of a split run whose pieces left partials (every plan but a per-request one of
// one split): out / lse of every row with partials.
void run_combine(const DecodeArgs& a, const DecodePlan& plan, DType act, cudaStream_t stream) {
  if (a.num_requests == 0 || a.direct_out || a.fused_combine) return;
  dispatch_act(act, [&]<class T>() {
    // Column chunks per row and the form (see the two combine kernels): one warp per
    // (row, chunk) once the rows alone give ~2K warps (128 requests x 12 heads: 1,536
    // rows); more chunks for fewer rows; and for a few rows (one long request: 12 rows,
    // 16 chunks) a CTA per (row, chunk) that reads the LSEs once (decode_combine_rows).
    // Batch-invariant plans keep 4 chunks of one warp (their fixed order).
    const int64_t items = int64_t(a.num_requests) * a.max_rows;
    int chunks = kCombineInvariantChunks;
    bool rows_form = false;
    if (!plan.batch_invariant) {
      chunks = 1;
      while (chunks < 16 && items * chunks * 2 <= 2048) chunks *= 2;
      // Many partials per row (many_partials) take the CTA form too, with at least 4 chunks.
      const bool many_parts = many_partials(plan, int64_t(a.num_requests) * a.row_tiles);
      if (many_parts) chunks = std::max(chunks, 4);
      rows_form = chunks >= 4 && (items * chunks <= 512 || many_parts);
      // A/B switch for the many-partials form: its chunks per row (4, 8, 16 or 32).
      const int forced = env_int("KMLA_DECODE_COMBINE_CHUNKS", 0);
      if (rows_form && (forced == 4 || forced == 8 || forced == 16 || forced == 32))
        chunks = forced;
    }
    // The warp form batches its loads (kCombineBatch partials at a time) where rows expect
    // that many partials; with fewer its registers would only halve the CTAs per SM (115
    // against 64: the DSpark draft, 2 partials a row in 512 CTAs, 224.4 -> 226.1 us on an H100).
    const bool batched =
        partials_per_row(plan, int64_t(a.num_requests) * a.row_tiles) >= kCombineBatch;
    const dim3 grid(unsigned(rows_form ? items * chunks : ceil_div(items * chunks, kCombineWarps)));
    launch_after_split(rows_form ? decode_combine_rows_kernel<T>
                       : batched ? decode_combine_kernel<T, kCombineBatch>
                                 : decode_combine_kernel<T, 1>,
                       grid, kCombineThreads, 0, stream, plan.programmatic_combine, 1, a, chunks);
  });
}

}  // namespace

void decode_attention(const DecodeParams& p, const DecodePlan& plan, void* workspace,
                      cudaStream_t stream) {
  const DecodeArgs a = run_split(p, plan, workspace, stream);
  run_combine(a, plan, p.act, stream);
}

void decode_attention_uv(const DecodeParams& p, const DecodePlan& plan, void* workspace,
                         const DecodeUvParams& uv, cudaStream_t stream) {
  KMLA_CHECK(uv.rows >= 0, "decode_attention_uv: rows must be >= 0, got ", uv.rows);
  KMLA_CHECK(uv.w_uv && uv.attn, "decode_attention_uv needs w_uv and attn");
  KMLA_CHECK(uv.attn_stride >= int64_t(p.heads) * kVDim && uv.attn_stride % 2 == 0,
             "decode_attention_uv: attn_stride ", uv.attn_stride, " must be even and >= heads x ",
             kVDim);
  KMLA_CHECK(!uv.g || (uv.g_stride >= int64_t(p.heads) * kVDim && uv.g_stride % 2 == 0),
             "decode_attention_uv: g_stride ", uv.g_stride, " must be even and >= heads x ", kVDim);
  KMLA_CHECK(reinterpret_cast<uintptr_t>(uv.w_uv) % 16 == 0 &&
                 reinterpret_cast<uintptr_t>(uv.attn) % 4 == 0 &&
                 reinterpret_cast<uintptr_t>(uv.g) % 4 == 0,
             "decode_attention_uv: w_uv must be 16-byte and attn, g 4-byte aligned");
  KMLA_CHECK(decode_uv_fits(), "decode_attention_uv: the epilogue needs ", kUvSmemBytes,
             " B of shared memory per block, more than this GPU has (check decode_uv_fits())");
  const DecodeArgs a = run_split(p, plan, workspace, stream, false);
  if (uv.rows == 0) return;
  // Multicast: clusters of up to 8 token tiles (a power of two), the grid padded to whole
  // clusters (the extra CTAs fetch their share of W_UV and write nothing).
  const int64_t tiles = ceil_div(uv.rows, int64_t(kUvTokens));
  int cluster = 1;
  if (uv.multicast && decode_uv_multicast_supported())
    while (cluster < 8 && cluster < tiles) cluster *= 2;
  const UvArgs u{uv.w_uv,   uv.attn,          uv.attn_stride, uv.g,
                 uv.g_stride, uv.rows, uv.num_tokens, cluster > 1};
  dispatch_act(p.act, [&]<class T>() {
    auto* kernel = decode_uv_kernel<T>;
    KMLA_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kUvSmemBytes));
    const dim3 grid(unsigned(ceil_div(tiles, int64_t(cluster)) * cluster), unsigned(p.heads));
    launch_after_split(kernel, grid, kUvThreads, kUvSmemBytes, stream, false, cluster, a, u);
  });
}

// The multicast form is compiled into the sm_90a code only (the sm_80 code would skip the
// W_UV copies): true where that code runs (sm90a_kernel_runs_on, asked once per device).
bool decode_uv_multicast_supported() {
  static std::atomic<int> answers[kMaxSm90Devices] = {};
  int device = 0;
  KMLA_CUDA_CHECK(cudaGetDevice(&device));
  return sm90a_kernel_runs_on(device, reinterpret_cast<const void*>(&decode_uv_kernel<bf16>),
                              answers);
}

bool decode_uv_fits() {
  int device = 0, optin = 0;
  KMLA_CUDA_CHECK(cudaGetDevice(&device));
  KMLA_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return optin >= kUvSmemBytes;
}

}  // namespace kmla::cuda
