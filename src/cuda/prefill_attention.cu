// Variable-length prefill attention (qk head 192 = [k_nope 128 | k_rope 64], v head 128):
// a FlashAttention-2 style kernel on mma.sync m16n8k16 tensor-core instructions, ldmatrix
// fragment loads and cp.async double buffering. It is compiled for sm_80 and sm_90a alike;
// the `portable` flag selects this same kernel (there is no wgmma path yet).
//
// Numerics (docs/SEMANTICS.md, item 7): scores and the softmax are fp32; the probabilities P
// are rounded to the activation dtype for the P.V product (as every tensor-core attention
// does), while the row sum l adds the unrounded fp32 values; the output is rounded to act
// once, after the division by l. LSE is the natural log of sum(exp(scale * s)).
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/attention.cuh"

namespace kmla::cuda {
namespace {

constexpr int kNopeDim = 128;
constexpr int kRopeDim = 64;
constexpr int kQkDim = kNopeDim + kRopeDim;  // 192
constexpr int kVDim = 128;

constexpr int kBlockQ = 128;  // query rows per CTA
constexpr int kBlockK = 64;   // keys per tile
constexpr int kWarps = 8;     // each warp owns 16 query rows
constexpr int kThreads = kWarps * 32;

// Shared memory rows are 16-byte chunks; a row of K holds 24 chunks, a row of V 16.
constexpr int kQkChunks = kQkDim / 8;      // 24 (16 from k_nope, 8 from k_rope)
constexpr int kNopeChunks = kNopeDim / 8;  // 16
constexpr int kVChunks = kVDim / 8;        // 16
constexpr int kQkRowBytes = kQkDim * 2;    // 384
constexpr int kVRowBytes = kVDim * 2;      // 256

// Shared-memory plan (bytes):
//   stage s (s = 0, 1) at s * kStageBytes:  K tile 64 x 384 = 24576, then V tile 64 x 256 = 16384
//   Q block 128 x 384 = 49152 at kStageBytes, i.e. overlapping stage 1: Q is copied into
//   registers before the first write to stage 1.
//   total = 40960 + 49152 = 90112 (88 KiB: fits sm_80's 163 KiB and sm_90's 227 KiB opt-in).
constexpr int kKTileBytes = kBlockK * kQkRowBytes;
constexpr int kVTileBytes = kBlockK * kVRowBytes;
constexpr int kStageBytes = kKTileBytes + kVTileBytes;
constexpr int kQBytes = kBlockQ * kQkRowBytes;
constexpr int kSmemBytes = kStageBytes + kQBytes;
static_assert(kSmemBytes >= 2 * kStageBytes, "stage 1 must fit inside the Q region's extent");

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

// Two fp32 values rounded to T and packed, lo in the low half (the lower column index).
template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t r;
  if constexpr (std::is_same_v<T, bf16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    r = *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    r = *reinterpret_cast<const uint32_t*>(&v);
  }
  return r;
}

__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx: rel. error ~2^-22, 2^-inf = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---- the kernel ---------------------------------------------------------------------
// Grid: x = head, y = query block in *reverse* order (y = 0 is the last, for causal the most
// expensive block of the longest sequence, so the heaviest CTAs start first and the cheap ones
// fill the tail), z = sequence. A CTA whose query block starts past its sequence exits.
//
// Per CTA: 128 query rows of one head of one sequence against that sequence's keys.
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
//   256 threads x 1 CTA per SM allow 255; ptxas (nvcc 13.0) uses 246 on sm_90a and 252 on
//   sm_80, with no spills and no stack.
//
// Shared-memory traffic bounds the speed: per 64-key tile a warp reads the whole K and V tiles
// (40 KiB) through ldmatrix for 16 x 64 x 320 MACs, i.e. 320 KiB per SM per round of 8 warps =
// 2560 cycles at 128 B/cycle, against ~1900 cycles of mma.sync: a ceiling of about half the
// H200's dense peak. Going past it needs wgmma (operands straight from smem, 64-row warpgroups).
//
// Masking: query row i of a sequence with n queries and m keys sees keys [0, limit(i)),
// limit(i) = min(m, m - n + i + 1) when causal, m otherwise (may be <= 0: no keys). A tile
// needs masking only if it reaches past the smallest limit of the warp's rows; tiles past
// the largest limit of the whole block are never loaded, and a warp skips the math of tiles
// past its own rows' largest limit. Keys past m are zero-filled in smem (cp.async src-size
// 0) so that a masked P = 0 never meets a NaN from memory that does not belong to us.
template <class T>
__global__ void __launch_bounds__(kThreads, 1)
    prefill_attention_mma_kernel(const PrefillParams p, float scale_log2) {
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

  // Copies key tile `tile` into stage `stage`: 64 x 24 K chunks (6 per thread) and 64 x 16 V
  // chunks (4 per thread); consecutive threads take consecutive chunks of a row (coalesced).
  auto load_kv_tile = [&](int tile, int stage) {
    const uint32_t k_smem = smem_base + stage * kStageBytes;
    const uint32_t v_smem = k_smem + kKTileBytes;
    const int key0 = tile * kBlockK;
#pragma unroll
    for (int i = 0; i < kBlockK * kQkChunks / kThreads; ++i) {
      const int idx = tid + i * kThreads;
      const int r = idx / kQkChunks, c = idx % kQkChunks;
      const bool valid = key0 + r < m;
      const T* src = c < kNopeChunks ? nope_ptr + int64_t(key0 + r) * p.k_nope.row_stride + c * 8
                                     : rope_ptr + int64_t(key0 + r) * p.k_rope.row_stride +
                                           (c - kNopeChunks) * 8;
      cp_async_16(k_smem + swizzled(r, c, kQkRowBytes), valid ? src : p.k_nope.ptr, valid);
    }
#pragma unroll
    for (int i = 0; i < kBlockK * kVChunks / kThreads; ++i) {
      const int idx = tid + i * kThreads;
      const int r = idx / kVChunks, c = idx % kVChunks;
      const bool valid = key0 + r < m;
      const T* src = v_ptr + int64_t(key0 + r) * p.v.row_stride + c * 8;
      cp_async_16(v_smem + swizzled(r, c, kVRowBytes), valid ? src : p.v.ptr, valid);
    }
  };

  // Q fragments (A operand of S = Q K^T) for the warp's 16 rows, all 192 dims.
  uint32_t q_frag[kQkDim / 16][4];
  if (num_tiles > 0) {
#pragma unroll
    for (int i = 0; i < kBlockQ * kQkChunks / kThreads; ++i) {
      const int idx = tid + i * kThreads;
      const int r = idx / kQkChunks, c = idx % kQkChunks;
      const bool valid = q0 + r < n;  // rows past the sequence are zeros (never stored)
      cp_async_16(q_smem + swizzled(r, c, kQkRowBytes),
                  valid ? q_ptr + int64_t(q0 + r) * p.q.row_stride + c * 8 : p.q.ptr, valid);
    }
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
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // h = 0: row g, h = 1: row g + 8
      float mx = row_max[h];
#pragma unroll
      for (int nt = 0; nt < kBlockK / 8; ++nt)
        mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // A row that has seen no key yet keeps max -inf; subtracting 0 instead keeps its
      // p = 2^-inf = 0 (not NaN), and its correction 2^(-inf) = 0 multiplies zeros.
      const float mx_scaled = mx == -INFINITY ? 0.f : mx * scale_log2;
      const float correction = fast_exp2(row_max[h] * scale_log2 - mx_scaled);
      row_max[h] = mx;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < kBlockK / 8; ++nt) {
        s[nt][2 * h] = fast_exp2(fmaf(s[nt][2 * h], scale_log2, -mx_scaled));
        s[nt][2 * h + 1] = fast_exp2(fmaf(s[nt][2 * h + 1], scale_log2, -mx_scaled));
        sum += s[nt][2 * h] + s[nt][2 * h + 1];
      }
      row_sum[h] = row_sum[h] * correction + sum;
#pragma unroll
      for (int nt = 0; nt < kVDim / 8; ++nt) {
        o_acc[nt][2 * h] *= correction;
        o_acc[nt][2 * h + 1] *= correction;
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

}  // namespace

void prefill_attention(const PrefillParams& p, cudaStream_t stream) {
  KMLA_CHECK(p.heads >= 1 && p.heads <= 128, "prefill_attention: heads must be in [1, 128], got ",
             p.heads);
  KMLA_CHECK(p.num_seqs >= 0 && p.num_seqs <= 65535,
             "prefill_attention: num_seqs must be in [0, 65535], got ", p.num_seqs);
  KMLA_CHECK(p.max_q_len >= 0, "prefill_attention: max_q_len must be >= 0, got ", p.max_q_len);
  KMLA_CHECK(ceil_div(p.max_q_len, kBlockQ) <= 65535,
             "prefill_attention: max_q_len too large: ", p.max_q_len);
  // The running max is kept in raw score units, which needs a positive scale.
  KMLA_CHECK(p.softmax_scale > 0.f && std::isfinite(p.softmax_scale),
             "prefill_attention: softmax_scale must be positive and finite, got ", p.softmax_scale);
  const bool work = p.num_seqs > 0 && p.max_q_len > 0;
  check_operand(p.q, "q", work);
  check_operand(p.k_nope, "k_nope", work);
  check_operand(p.k_rope, "k_rope", work);
  check_operand(p.v, "v", work);
  check_operand(Operand{p.out, p.out_row_stride, p.out_head_stride}, "out", work);
  KMLA_CHECK(!work || (p.lse != nullptr && p.cu_q != nullptr && p.cu_k != nullptr),
             "prefill_attention: lse, cu_q and cu_k must be set");
  if (!work) return;

  // p.portable needs nothing special: this kernel is the sm_80 code path on every GPU.
  const float scale_log2 = p.softmax_scale * 1.4426950408889634f;
  const dim3 grid(unsigned(p.heads), unsigned(ceil_div(p.max_q_len, kBlockQ)),
                  unsigned(p.num_seqs));
  dispatch_act(p.act, [&]<class T>() {
    auto* kernel = prefill_attention_mma_kernel<T>;
    // 88 KiB of dynamic smem needs the opt-in (per device; cheap to repeat, no sync).
    KMLA_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    kernel<<<grid, kThreads, kSmemBytes, stream>>>(p, scale_log2);
    KMLA_LAUNCH_CHECK();
  });
}

}  // namespace kmla::cuda
