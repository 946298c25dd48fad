// Variable-length prefill attention (qk head 192 = [k_nope 128 | k_rope 64], v head 128):
// a FlashAttention-2 style kernel on mma.sync m16n8k16 tensor-core instructions, ldmatrix
// fragment loads and cp.async double buffering. It is compiled for sm_80 and sm_90a alike.
// On sm_90 prefill_attention runs the wgmma kernel of prefill_sm90.cu instead, unless
// p.portable or KMLA_PREFILL_SM90=0 (see prefill_uses_sm90).
//
// Two tilings of the same kernel (template parameter kRows, query rows per CTA):
//   128 rows / 8 warps, 1 CTA per SM (register bound: 256 threads x ~250 registers);
//   64 rows / 4 warps, 2 CTAs per SM: two independent CTAs on one SM let one CTA's softmax
//   (MUFU ex2, FMUL, shuffles) overlap the other's mma.sync, which the barrier-synchronised
//   8 warps of one CTA cannot do. It reads K/V from L2 twice as often per FLOP.
// prefill_rows_per_cta() picks one; see there.
//
// Numerics (docs/SEMANTICS.md, item 7): scores and the softmax are fp32; the probabilities P
// are rounded to the activation dtype for the P.V product (as every tensor-core attention
// does), while the row sum l adds the unrounded fp32 values; the output is rounded to act
// once, after the division by l. LSE is the natural log of sum(exp(scale * s)).
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "cuda/attention.cuh"
#include "cuda/prefill_attention.cuh"
#include "cuda/prefill_fp8_sm90.cuh"

namespace kmla::cuda {
namespace {

constexpr int kNopeDim = 128;
constexpr int kRopeDim = 64;
constexpr int kQkDim = kNopeDim + kRopeDim;  // 192
constexpr int kVDim = 128;

constexpr int kBlockK = 64;  // keys per tile

// Shared memory rows are 16-byte chunks; a row of K holds 24 chunks, a row of V 16.
constexpr int kQkChunks = kQkDim / 8;      // 24 (16 from k_nope, 8 from k_rope)
constexpr int kNopeChunks = kNopeDim / 8;  // 16
constexpr int kVChunks = kVDim / 8;        // 16
constexpr int kQkRowBytes = kQkDim * 2;    // 384
constexpr int kVRowBytes = kVDim * 2;      // 256

constexpr int kKTileBytes = kBlockK * kQkRowBytes;      // 24576
constexpr int kVTileBytes = kBlockK * kVRowBytes;       // 16384
constexpr int kStageBytes = kKTileBytes + kVTileBytes;  // 40960

// Shared-memory plan (bytes), per CTA of kRows query rows:
//   stage s (s = 0, 1) at s * kStageBytes: K tile 64 x 384 = 24576, then V tile 64 x 256 = 16384
//   Q block kRows x 384 at kStageBytes, i.e. overlapping stage 1: Q is copied into registers
//   before the first write to stage 1 (the copy of tile 1 waits for it; a separate Q region
//   would only let that one copy start earlier, and with 2 CTAs per SM the other CTA covers
//   the wait).
//   128 rows: Q 49152 sticks out of stage 1: total 40960 + 49152 = 90112 (88 KiB).
//   64 rows:  Q 24576 fits in stage 1: total 2 x 40960 = 81920 (80 KiB); two CTAs need
//             2 x (80 + 1 reserved) = 162 KiB: fits sm_80's 164 KiB and sm_90's 228 KiB per SM.
// Registers: 128 rows x 256 threads x 1 CTA and 64 rows x 128 threads x 2 CTAs both allow 255
// per thread (65536 / 256), so both tilings keep the same per-warp register plan.
template <int kRows>
struct Tiling {
  static_assert(kRows == 64 || kRows == 128, "64 or 128 query rows per CTA");
  static constexpr int kWarps = kRows / 16;  // each warp owns 16 query rows
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kCtasPerSm = kRows == 64 ? 2 : 1;
  static constexpr int kQBytes = kRows * kQkRowBytes;
  static constexpr int kSmemBytes = kStageBytes + (kQBytes > kStageBytes ? kQBytes : kStageBytes);
  static_assert(kBlockK * kQkChunks % kThreads == 0 && kBlockK * kVChunks % kThreads == 0 &&
                    kRows * kQkChunks % kThreads == 0,
                "every thread copies the same number of chunks");
};
static_assert(Tiling<128>::kSmemBytes == 90112 && Tiling<64>::kSmemBytes == 81920);

// Every smem row is XOR-swizzled in 16-byte chunks: logical chunk c of row r lives at chunk
// c ^ (r & 7). Rows are a multiple of 128 bytes long, so without it the 8 row addresses of
// one ldmatrix 8x8 matrix (8 consecutive rows, same chunk) would hit the same 4 banks; with
// it they cover all 32 banks. The XOR only touches the low 3 bits, so a chunk stays inside
// its aligned group of 8 (rows have 24 or 16 chunks).
__device__ __forceinline__ uint32_t swizzled(int row, int chunk, int row_bytes) {
  return uint32_t(row * row_bytes + ((chunk ^ (row & 7)) << 4));
}

// ---- PTX wrappers ---------------------------------------------------------------------
// 16-byte async copy global -> shared; src_bytes 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a (16x16, row major) * b (16x8, column major), fp32 accumulate.
template <class T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  if constexpr (std::is_same_v<T, bf16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Copies a tile of kTileRows rows x kChunks 16-byte chunks from global memory (row r at
// src + r * row_stride) to chunks [chunk0, chunk0 + kChunks) of the swizzled smem rows at dst
// (row_bytes apart). Rows >= valid_rows (>= 1) are zero-filled without reading memory; their
// copies name row 0, an address that exists. Thread tid
// always takes chunk tid % kChunks of rows tid / kChunks + i * kRowsPerPass: consecutive
// threads read consecutive 16 bytes of a row (coalesced), the global address advances by a
// fixed stride per i, and since kRowsPerPass is a multiple of 8 the swizzle (row & 7) is the
// same for all i, so the smem addresses differ by compile-time constants.
template <int kTileRows, int kChunks, int kThreads, class T>
__device__ __forceinline__ void copy_rows(uint32_t dst, int row_bytes, int chunk0, const T* src,
                                          int64_t row_stride, int valid_rows, int tid) {
  constexpr int kRowsPerPass = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0 && kRowsPerPass % 8 == 0 && kTileRows % kRowsPerPass == 0);
  const int c = tid % kChunks, r0 = tid / kChunks;
  const T* thread_src = src + int64_t(r0) * row_stride + c * 8;
  const uint32_t thread_dst = dst + swizzled(r0, chunk0 + c, row_bytes);
#pragma unroll
  for (int i = 0; i < kTileRows / kRowsPerPass; ++i) {
    const bool valid = r0 + i * kRowsPerPass < valid_rows;
    cp_async_16(thread_dst + i * kRowsPerPass * row_bytes,
                valid ? thread_src + i * kRowsPerPass * row_stride : src, valid);
  }
}

// ---- the kernel ---------------------------------------------------------------------
// Grid: x = head, y = query block in *reverse* order (y = 0 is the last, for causal the most
// expensive block of the longest sequence, so the heaviest CTAs start first and the cheap ones
// fill the tail), z = sequence. A CTA whose query block starts past its sequence exits.
//
// Per CTA: kRows query rows of one head of one sequence against that sequence's keys.
// Warp w owns query rows [16w, 16w + 16) of the block; the 4 threads of a quad (lane / 4 = g)
// hold rows g and g + 8 of the warp's 16.
//
// Pipeline, per key tile j (64 keys):
//   wait for tile j's cp.async copies; __syncthreads (tile j visible to all warps, and every
//   warp is done with tile j - 1, whose stage the next copy overwrites)
//   issue cp.async for tile j + 1 into stage (j + 1) & 1
//   S = Q K^T (12 k-steps x 8 n-tiles = 96 mma), mask (diagonal / last tile only),
//   online softmax, O += P V (4 k-steps x 16 n-tiles = 64 mma).
// Tile 0 is loaded together with Q; Q goes to registers once, then a barrier frees its smem.
//
// Registers per thread (fp32 unless noted):
//   Q fragments 12 k-steps x 4 = 48 (packed 16-bit pairs), S 8 n-tiles x 4 = 32,
//   O 16 n-tiles x 4 = 64, softmax state 4: ~150 live across the loop, the rest addressing.
//   8 warps x 1 CTA and 4 warps x 2 CTAs per SM both allow 255 (see Tiling); ptxas (nvcc
//   13.0) uses 237 (128 rows) / 236 (64 rows) on sm_90a and 233 on sm_80, no spills or stack.
//
// Shared-memory traffic bounds the speed: per 64-key tile a warp reads the whole K and V tiles
// (40 KiB) through ldmatrix for 16 x 64 x 320 MACs, i.e. 320 KiB per SM per round of 8 warps =
// 2560 cycles at 128 B/cycle, against ~1900 cycles of mma.sync: a ceiling of about half the
// H200's dense peak, whichever tiling. Going past it needs wgmma (operands straight from smem,
// 64-row warpgroups). The MUFU is the next limit: 32 ex2 per thread per tile = 256 cycles of a
// sub-partition's MUFU per warp, against ~800 cycles of its mma.sync.
//
// Masking: query row i of a sequence with n queries and m keys sees keys [0, limit(i)),
// limit(i) = min(m, m - n + i + 1) when causal, m otherwise (may be <= 0: no keys). A tile
// needs masking only if it reaches past the smallest limit of the warp's rows; tiles past
// the largest limit of the whole block are never loaded, and a warp skips the math of tiles
// past its own rows' largest limit. Keys past m are zero-filled in smem (cp.async src-size
// 0) so that a masked P = 0 never meets a NaN from memory that does not belong to us.
template <class T, int kRows>
__global__ void __launch_bounds__(Tiling<kRows>::kThreads, Tiling<kRows>::kCtasPerSm)
    prefill_attention_mma_kernel(const PrefillParams p, float scale_log2) {
  constexpr int kBlockQ = kRows;
  constexpr int kThreads = Tiling<kRows>::kThreads;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t smem_base = uint32_t(__cvta_generic_to_shared(smem));
  const uint32_t q_smem = smem_base + kStageBytes;

  const int head = blockIdx.x;
  const int q0 = int(gridDim.y - 1 - blockIdx.y) * kBlockQ;
  const int seq = blockIdx.z;
  const int q_begin = p.cu_q[seq];
  const int n = p.cu_q[seq + 1] - q_begin;
  if (q0 >= n) return;
  const int k_begin = p.cu_k[seq];
  const int m = p.cu_k[seq + 1] - k_begin;
  const bool causal = p.causal;
  auto limit = [&](int i) { return causal ? min(m, m - n + i + 1) : m; };

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;  // row within an 8-row half of the warp's 16
  const int t = lane & 3;   // column pair within an 8-column n-tile

  const int block_last_row = min(q0 + kBlockQ, n) - 1;
  const int num_tiles = (max(0, limit(block_last_row)) + kBlockK - 1) / kBlockK;

  const int warp_first_row = q0 + warp * 16;
  const bool warp_active = warp_first_row < n;
  const int warp_min_limit = limit(warp_first_row);
  const int warp_max_limit = limit(min(warp_first_row + 15, n - 1));
  const int row_limit[2] = {limit(warp_first_row + g), limit(warp_first_row + g + 8)};

  const T* q_ptr = static_cast<const T*>(p.q.ptr) + int64_t(q_begin) * p.q.row_stride +
                   int64_t(head) * p.q.head_stride;
  const T* nope_ptr = static_cast<const T*>(p.k_nope.ptr) + int64_t(k_begin) * p.k_nope.row_stride +
                      int64_t(head) * p.k_nope.head_stride;
  const T* rope_ptr = static_cast<const T*>(p.k_rope.ptr) + int64_t(k_begin) * p.k_rope.row_stride +
                      int64_t(head) * p.k_rope.head_stride;
  const T* v_ptr = static_cast<const T*>(p.v.ptr) + int64_t(k_begin) * p.v.row_stride +
                   int64_t(head) * p.v.head_stride;

  // Copies key tile `tile` into stage `stage` (K = [k_nope | k_rope] rows, then V rows).
  auto load_kv_tile = [&](int tile, int stage) {
    const uint32_t k_smem = smem_base + stage * kStageBytes;
    const int key0 = tile * kBlockK;
    const int rows = m - key0;
    copy_rows<kBlockK, kNopeChunks, kThreads>(k_smem, kQkRowBytes, 0,
                                              nope_ptr + int64_t(key0) * p.k_nope.row_stride,
                                              p.k_nope.row_stride, rows, tid);
    copy_rows<kBlockK, kRopeDim / 8, kThreads>(k_smem, kQkRowBytes, kNopeChunks,
                                               rope_ptr + int64_t(key0) * p.k_rope.row_stride,
                                               p.k_rope.row_stride, rows, tid);
    copy_rows<kBlockK, kVChunks, kThreads>(k_smem + kKTileBytes, kVRowBytes, 0,
                                           v_ptr + int64_t(key0) * p.v.row_stride, p.v.row_stride,
                                           rows, tid);
  };

  // Q fragments (A operand of S = Q K^T) for the warp's 16 rows, all 192 dims.
  uint32_t q_frag[kQkDim / 16][4];
  if (num_tiles > 0) {
    // Rows past the sequence are zeros (and never stored).
    const T* q_rows = q_ptr + int64_t(q0) * p.q.row_stride;
    copy_rows<kBlockQ, kNopeChunks, kThreads>(q_smem, kQkRowBytes, 0, q_rows, p.q.row_stride,
                                              n - q0, tid);
    copy_rows<kBlockQ, kRopeDim / 8, kThreads>(q_smem, kQkRowBytes, kNopeChunks, q_rows + kNopeDim,
                                               p.q.row_stride, n - q0, tid);
    load_kv_tile(0, 0);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    // ldmatrix x4 matrices: (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15),
    // (rows 8-15, k 8-15) = a0..a3; lane L addresses row L % 8 of matrix L / 8.
    const int q_row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int ks = 0; ks < kQkDim / 16; ++ks)
      ldmatrix_x4(q_frag[ks], q_smem + swizzled(q_row, 2 * ks + (lane >> 4), kQkRowBytes));
    __syncthreads();  // Q smem (overlapping stage 1) is free from here on
  }

  float o_acc[kVDim / 8][4];
#pragma unroll
  for (int nt = 0; nt < kVDim / 8; ++nt)
    o_acc[nt][0] = o_acc[nt][1] = o_acc[nt][2] = o_acc[nt][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};  // raw score units
  float row_sum[2] = {0.f, 0.f};              // this thread's share of l (quad-reduced at the end)

  // Lane parts of the K (non-transposed) and V (transposed) ldmatrix addresses.
  // K: matrices (keys 0-7, k 0-7), (keys 0-7, k 8-15), (keys 8-15, k 0-7), (keys 8-15, k 8-15)
  //    = b0, b1 of n-tile 2np and b0, b1 of n-tile 2np + 1.
  const int k_lane_row = (lane & 7) + (lane >> 4) * 8;
  const int k_lane_chunk = (lane >> 3) & 1;
  // V: matrices (keys 0-7, dims 0-7), (keys 8-15, dims 0-7), (keys 0-7, dims 8-15),
  //    (keys 8-15, dims 8-15), transposed = b0, b1 of dim n-tile 2np and of 2np + 1.
  const int v_lane_row = (lane & 7) + ((lane >> 3) & 1) * 8;
  const int v_lane_chunk = lane >> 4;

  for (int j = 0; j < num_tiles; ++j) {
    if (j > 0) {
      cp_async_wait_all();
      __syncthreads();
    }
    if (j + 1 < num_tiles) {
      load_kv_tile(j + 1, (j + 1) & 1);
      cp_async_commit();
    }
    const int key0 = j * kBlockK;
    if (!warp_active || key0 >= warp_max_limit) continue;  // nothing visible to this warp
    const uint32_t k_smem = smem_base + (j & 1) * kStageBytes;
    const uint32_t v_smem = k_smem + kKTileBytes;

    // S = Q K^T for 16 rows x 64 keys.
    float s[kBlockK / 8][4];
#pragma unroll
    for (int nt = 0; nt < kBlockK / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < kQkDim / 16; ++ks) {
#pragma unroll
      for (int np = 0; np < kBlockK / 16; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, k_smem + swizzled(np * 16 + k_lane_row, 2 * ks + k_lane_chunk, kQkRowBytes));
        mma_16816<T>(s[2 * np], q_frag[ks], b[0], b[1]);
        mma_16816<T>(s[2 * np + 1], q_frag[ks], b[2], b[3]);
      }
    }

    if (key0 + kBlockK > warp_min_limit) {  // some key of this tile is hidden from some row
#pragma unroll
      for (int nt = 0; nt < kBlockK / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + nt * 8 + 2 * t + (e & 1);
          if (key >= row_limit[e >> 1]) s[nt][e] = -INFINITY;
        }
      }
    }

    // Online softmax in base 2: p = 2^(s * scale_log2 - m * scale_log2), one FFMA + EX2.
    float correction[2];
    const bool max_moved =
        online_softmax_rows<kBlockK / 8>(&s[0][0], row_max, row_sum, correction, scale_log2);
    // An unchanged max has correction exactly 2^0 = 1, so the 64 FMULs of the O rescale are
    // skipped unless some row of the warp got a new max (the vote keeps the branch uniform).
    // Late tiles of long rows rarely raise the max. A row whose max stays -inf has O = 0.
    if (__any_sync(0xffffffffu, max_moved)) {
#pragma unroll
      for (int nt = 0; nt < kVDim / 8; ++nt) {
        o_acc[nt][0] *= correction[0];
        o_acc[nt][1] *= correction[0];
        o_acc[nt][2] *= correction[1];
        o_acc[nt][3] *= correction[1];
      }
    }

    // O += P V. The S accumulators of n-tiles 2kk and 2kk + 1 are exactly the A fragment of
    // keys [16kk, 16kk + 16) (a0 = row g cols 2t.., a1 = row g+8, a2/a3 = cols 2t+8..).
#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; ++kk) {
      const uint32_t a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]),
                             pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                             pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int np = 0; np < kVDim / 16; ++np) {
        uint32_t b[4];
        ldmatrix_x4_trans(
            b, v_smem + swizzled(kk * 16 + v_lane_row, 2 * np + v_lane_chunk, kVRowBytes));
        mma_16816<T>(o_acc[2 * np], a, b[0], b[1]);
        mma_16816<T>(o_acc[2 * np + 1], a, b[2], b[3]);
      }
    }
  }

  // Epilogue: O / l rounded once to T; lse = ln(l) + scale * max. A row that saw no key has
  // l = 0: zeros and -inf.
  if (!warp_active) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = warp_first_row + g + 8 * h;
    float l = row_sum[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (row >= n) continue;
    const bool any = l > 0.f;
    const float inv = any ? 1.f / l : 0.f;
    const int64_t grow = int64_t(q_begin) + row;
    T* out = static_cast<T*>(p.out) + grow * p.out_row_stride + int64_t(head) * p.out_head_stride;
#pragma unroll
    for (int nt = 0; nt < kVDim / 8; ++nt)
      *reinterpret_cast<uint32_t*>(out + nt * 8 + 2 * t) =
          pack2<T>(o_acc[nt][2 * h] * inv, o_acc[nt][2 * h + 1] * inv);
    if (t == 0)
      p.lse[grow * p.lse_row_stride + head] =
          any ? (row_max[h] * scale_log2 + log2f(l)) * 0.69314718055994531f : -INFINITY;
  }
}

// 16-byte cp.async needs every row and head start 16-byte aligned.
void check_operand(const Operand& o, const char* name, bool need_ptr) {
  KMLA_CHECK(!need_ptr || o.ptr != nullptr, "prefill_attention: ", name, ".ptr is null");
  KMLA_CHECK(reinterpret_cast<uintptr_t>(o.ptr) % 16 == 0, "prefill_attention: ", name,
             ".ptr must be 16-byte aligned, got ", o.ptr);
  KMLA_CHECK(o.row_stride % 8 == 0, "prefill_attention: ", name,
             ".row_stride must be a multiple of 8 elements (16 bytes), got ", o.row_stride);
  KMLA_CHECK(o.head_stride % 8 == 0, "prefill_attention: ", name,
             ".head_stride must be a multiple of 8 elements (16 bytes), got ", o.head_stride);
}

// fp8 operands are read by TMA (whole boxes) and 16-byte cp.async (partial ones): 16-byte
// aligned rows and heads (strides in elements are bytes here), positive row strides, positive
// head strides except a shared k_rope (0), each below the TMA limit of 2^40 bytes.
void check_fp8_operand(const Operand& o, const char* name, bool need_ptr, bool may_share) {
  KMLA_CHECK(!need_ptr || o.ptr != nullptr, "prefill_attention: ", name, ".ptr is null");
  KMLA_CHECK(reinterpret_cast<uintptr_t>(o.ptr) % 16 == 0, "prefill_attention: fp8 ", name,
             ".ptr must be 16-byte aligned, got ", o.ptr);
  constexpr int64_t kMax = int64_t(1) << 40;
  KMLA_CHECK(o.row_stride > 0 && o.row_stride % 16 == 0 && o.row_stride < kMax,
             "prefill_attention: fp8 ", name,
             ".row_stride must be a positive multiple of 16 (bytes) below 2^40, got ",
             o.row_stride);
  KMLA_CHECK((o.head_stride > 0 || (may_share && o.head_stride == 0)) && o.head_stride % 16 == 0 &&
                 o.head_stride < kMax,
             "prefill_attention: fp8 ", name, ".head_stride must be a positive multiple of 16",
             may_share ? " (or 0: shared by all heads)" : "", " below 2^40, got ", o.head_stride);
}

template <class T, int kRows>
void launch_prefill(const PrefillParams& p, float scale_log2, cudaStream_t stream) {
  using Tile = Tiling<kRows>;
  auto* kernel = prefill_attention_mma_kernel<T, kRows>;
  // 80 / 88 KiB of dynamic smem needs the opt-in (per device; cheap to repeat, no sync). The
  // 64-row tiling also asks for the largest smem carveout so that two CTAs fit on an SM.
  KMLA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes));
  if (Tile::kCtasPerSm > 1)
    KMLA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                         int(cudaSharedmemCarveoutMaxShared)));
  const dim3 grid(unsigned(p.heads), unsigned(ceil_div(p.max_q_len, kRows)), unsigned(p.num_seqs));
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p, scale_log2);
  KMLA_LAUNCH_CHECK();
}

// KMLA_PREFILL_ROWS=64|128 (read once per process) forces the tiling, so that one GPU run can
// time both, e.g. `KMLA_PREFILL_ROWS=64 kmla bench --only prefill` and again with 128. Unset
// or empty: the heuristic decides. Any other value is an error.
int forced_rows_from_env() {
  static const int forced = [] {
    const char* env = std::getenv("KMLA_PREFILL_ROWS");
    if (env == nullptr || *env == '\0') return 0;
    KMLA_CHECK(std::strcmp(env, "64") == 0 || std::strcmp(env, "128") == 0,
               "KMLA_PREFILL_ROWS must be 64 or 128, got '", env, "'");
    return std::atoi(env);
  }();
  return forced;
}

}  // namespace

// The heuristic: 64 rows whenever two 64-row CTAs fit in one SM's shared memory (sm_80:
// 164 KiB, sm_90: 228 KiB per SM; both fit 2 x (80 + 1) KiB), since then the co-resident CTA
// hides the softmax behind mma and a 64-row grid also has twice the CTAs for short
// sequences. Otherwise (e.g. 100 KiB on sm_86 / sm_89, where a 64-row CTA would run alone on
// its SM with half the warps) 128 rows. Registers never decide it: both tilings allow 255 per
// thread. To be revisited with the lead's measurements of both tilings (the 64-row tiling
// doubles the L2 -> SM traffic for K and V, which may cap it at very high head counts).
int prefill_rows_per_cta(const PrefillParams& p) {
  (void)p;  // the choice depends on the GPU only, for now
  if (const int forced = forced_rows_from_env()) return forced;
  // Measured on the H200 (kmla bench, 2026-12-02, bf16 causal): 128 rows 306.8 / 304.7 / 320.3
  // TFLOP/s at 8k x 64, 8k x 16 and 32k x 16 heads, 64 rows (2 CTAs/SM) 309.7 / 292.2 / 315.6:
  // equal within noise at 64 heads, 128 rows ahead at 16. So 128 rows where a CTA of it fits
  // (sm_80, sm_90); 64 rows only where the shared memory holds just the smaller tiling.
  int device = 0, smem_per_block = 0;
  KMLA_CUDA_CHECK(cudaGetDevice(&device));
  KMLA_CUDA_CHECK(cudaDeviceGetAttribute(&smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return Tiling<128>::kSmemBytes <= smem_per_block ? 128 : 64;
}

namespace {

// Validates everything host-side, before any CUDA call (so it also runs without a GPU);
// returns whether there is anything to compute.
bool check_params(const PrefillParams& p) {
  KMLA_CHECK(p.act == DType::bf16 || p.act == DType::f16,
             "prefill_attention: act must be bf16 or f16, got ", dtype_name(p.act));
  KMLA_CHECK(p.heads >= 1 && p.heads <= 128, "prefill_attention: heads must be in [1, 128], got ",
             p.heads);
  KMLA_CHECK(p.num_seqs >= 0 && p.num_seqs <= 65535,
             "prefill_attention: num_seqs must be in [0, 65535], got ", p.num_seqs);
  KMLA_CHECK(p.max_q_len >= 0, "prefill_attention: max_q_len must be >= 0, got ", p.max_q_len);
  KMLA_CHECK(p.total_q >= 0 && p.total_q <= INT32_MAX,  // cu_q is int32
             "prefill_attention: total_q must be in [0, 2^31 - 1] (0: not known), got ", p.total_q);
  KMLA_CHECK(ceil_div(p.max_q_len, 64) <= 65535,  // grid.y for the smaller tiling
             "prefill_attention: max_q_len too large: ", p.max_q_len);
  // The running max is kept in raw score units, which needs a positive scale.
  KMLA_CHECK(p.softmax_scale > 0.f && std::isfinite(p.softmax_scale),
             "prefill_attention: softmax_scale must be positive and finite, got ", p.softmax_scale);
  const bool work = p.num_seqs > 0 && p.max_q_len > 0;
  if (p.fp8) {
    KMLA_CHECK(!p.portable,
               "prefill_attention: fp8 inputs run only on the Hopper kernel; portable must be false");
    check_fp8_operand(p.q, "q", work, false);
    check_fp8_operand(p.k_nope, "k_nope", work, false);
    check_fp8_operand(p.k_rope, "k_rope", work, true);
    check_fp8_operand(p.v, "v", work, false);
    KMLA_CHECK(!work || (p.q_scale != nullptr && p.k_scale != nullptr && p.v_scale != nullptr),
               "prefill_attention: fp8 needs q_scale, k_scale and v_scale (device pointers)");
  } else {
    check_operand(p.q, "q", work);
    check_operand(p.k_nope, "k_nope", work);
    check_operand(p.k_rope, "k_rope", work);
    check_operand(p.v, "v", work);
  }
  check_operand(Operand{p.out, p.out_row_stride, p.out_head_stride}, "out", work);
  KMLA_CHECK(!work || (p.lse != nullptr && p.cu_q != nullptr && p.cu_k != nullptr),
             "prefill_attention: lse, cu_q and cu_k must be set");
  return work;
}

void launch_checked(const PrefillParams& p, int rows_per_cta, cudaStream_t stream) {
  // p.portable needs nothing special: this kernel is the sm_80 code path on every GPU.
  const float scale_log2 = p.softmax_scale * 1.4426950408889634f;
  dispatch_act(p.act, [&]<class T>() {
    if (rows_per_cta == 64)
      launch_prefill<T, 64>(p, scale_log2, stream);
    else
      launch_prefill<T, 128>(p, scale_log2, stream);
  });
}

}  // namespace

void prefill_attention_rows(const PrefillParams& p, int rows_per_cta, cudaStream_t stream) {
  KMLA_CHECK(rows_per_cta == 64 || rows_per_cta == 128,
             "prefill_attention: rows_per_cta must be 64 or 128, got ", rows_per_cta);
  KMLA_CHECK(!p.fp8, "prefill_attention_rows: the mma.sync kernel takes no fp8 inputs");
  if (check_params(p)) launch_checked(p, rows_per_cta, stream);
}

namespace {

// KMLA_PREFILL_SM90=0 (read once per process) keeps prefill_attention on the mma.sync kernel
// on sm_90 too; unset, empty or 1: the wgmma kernel where it runs.
bool sm90_allowed_by_env() {
  static const bool allowed = env_switch("KMLA_PREFILL_SM90", true);
  return allowed;
}

// The wgmma kernel's variant for prefill_attention (read once per process), for A/B timing:
// KMLA_PREFILL_SM90_OVERLAP=0 runs the in-order consumer schedule, KMLA_PREFILL_SM90_PINGPONG=1
// makes the consumer warpgroups take turns issuing MMAs, KMLA_PREFILL_SM90_EARLY_RESCALE=0
// rescales O at the end of each tile (round 1), KMLA_PREFILL_SM90_HEAD_GROUP=N (0..128) sets
// the CTA order (0: round 1's heads one after the other), KMLA_PREFILL_SM90_TMA=0 loads every
// tile with cp.async instead of TMA, KMLA_PREFILL_SM90_COMPACT=0 launches the 3-D grid for
// batches of several sequences too, KMLA_PREFILL_SM90_CTAS=-1 gives the compact grid a CTA per
// item (N > 0: N CTAs) instead of one per SM.
// Unset: the Sm90Options defaults.
const Sm90Options& sm90_options_from_env() {
  static const Sm90Options opt = [] {
    Sm90Options o;
    o.overlap = env_switch("KMLA_PREFILL_SM90_OVERLAP", o.overlap);
    o.pingpong = env_switch("KMLA_PREFILL_SM90_PINGPONG", o.pingpong);
    o.early_rescale = env_switch("KMLA_PREFILL_SM90_EARLY_RESCALE", o.early_rescale);
    o.tma = env_switch("KMLA_PREFILL_SM90_TMA", o.tma);
    o.compact = env_switch("KMLA_PREFILL_SM90_COMPACT", o.compact);
    o.head_group = env_int_in("KMLA_PREFILL_SM90_HEAD_GROUP", o.head_group, 0, 128);
    o.ctas = env_int_in("KMLA_PREFILL_SM90_CTAS", o.ctas, -1, 1 << 20);
    return o;
  }();
  return opt;
}

// The fp8 kernel's variant for prefill_attention (read once per process):
// KMLA_PREFILL_FP8_PINGPONG=0|1, KMLA_PREFILL_FP8_HEAD_GROUP=N (0..128),
// KMLA_PREFILL_FP8_LAZY=0|1, KMLA_PREFILL_FP8_CTAS=N (-1: one CTA per item, N > 0: N CTAs on
// the work counter). Unset: the defaults.
const Fp8PrefillOptions& fp8_options_from_env() {
  static const Fp8PrefillOptions opt = [] {
    Fp8PrefillOptions o;
    o.pingpong = env_switch("KMLA_PREFILL_FP8_PINGPONG", o.pingpong);
    o.lazy_rescale = env_switch("KMLA_PREFILL_FP8_LAZY", o.lazy_rescale);
    o.ctas = env_int_in("KMLA_PREFILL_FP8_CTAS", o.ctas, -1, 1 << 20);
    o.head_group = env_int_in("KMLA_PREFILL_FP8_HEAD_GROUP", o.head_group, 0, 128);
    return o;
  }();
  return opt;
}

void check_fp8_device() {
  if (prefill_fp8_supported()) return;
  int device = 0, major = 0, minor = 0;
  KMLA_CUDA_CHECK(cudaGetDevice(&device));
  KMLA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  KMLA_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  KMLA_CHECK(false, "prefill_attention: fp8 inputs need an sm_90 GPU and sm_90a code in this build; "
             "device ", device, " is sm_", major, minor);
}

}  // namespace

void prefill_attention_fp8(const PrefillParams& p, cudaStream_t stream,
                           const Fp8PrefillOptions& opt) {
  KMLA_CHECK(p.fp8, "prefill_attention_fp8: p.fp8 must be set");
  if (!check_params(p)) return;
  check_fp8_device();
  prefill_attention_fp8_launch(p, opt, stream);
}

bool prefill_uses_sm90(const PrefillParams& p) {
  return !p.portable && sm90_allowed_by_env() && prefill_sm90_supported(p);
}

void prefill_attention_sm90(const PrefillParams& p, cudaStream_t stream,
                            const Sm90Options& opt) {
  KMLA_CHECK(!p.fp8, "prefill_attention_sm90: the 16-bit wgmma kernel takes no fp8 inputs");
  if (!check_params(p)) return;
  KMLA_CHECK(prefill_sm90_supported(p),
             "prefill_attention_sm90: the current device is not an sm_90 GPU");
  prefill_attention_sm90_launch(p, opt, stream);
}

void prefill_attention(const PrefillParams& p, cudaStream_t stream) {
  if (!check_params(p)) return;
  if (p.fp8) {
    check_fp8_device();
    prefill_attention_fp8_launch(p, fp8_options_from_env(), stream);
    return;
  }
  if (prefill_uses_sm90(p))
    prefill_attention_sm90_launch(p, sm90_options_from_env(), stream);
  else
    launch_checked(p, prefill_rows_per_cta(p), stream);
}

}  // namespace kmla::cuda
