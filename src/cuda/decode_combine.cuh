// The combine's arithmetic for one row of partials: out / lse of the row from its pieces'
// normalised outputs and LSEs. Shared by the combine kernel (decode_attention.cu) and by the
// balanced split kernels that merge their cut pairs themselves (DecodeArgs::fused_combine:
// after a grid-wide barrier each worker merges its share of the rows of the cut pairs it ran
// a piece of, so a batch that cuts nothing needs no second launch), and the cooperative
// launch that the fused form needs.
#pragma once

#include <cstdint>
#include <limits>

#include "cuda/common.cuh"
#include "cuda/decode_args.cuh"
#include "cuda/decode_sched.cuh"
#include "kmla/config.hpp"

namespace kmla::cuda {

// -inf: the LSE of a piece (or row) that saw no key. Shared by every decode kernel.
inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#ifdef __CUDACC__
// Where the partials of (request r, row `row`) are, for both forms: S of them, partial s's
// LSE at a.ws_lse[part(s)] and its output at a.ws_o + part(s) * 512. On a balanced plan
// S <= 1 means the tile's only piece wrote out / lse itself (nothing to merge); a
// batch-invariant grid's later splits are empty (LSE -inf, weight exactly 0) and not visited.
struct RowPartials {
  int64_t item;  // (request, row) pair
  int row, S, w0;
  __device__ int64_t part(const DecodeArgs& a, int s) const {
    return a.balanced ? balanced_partial(w0, S, s, a.rows_per_cta, row % a.rows_per_cta)
                      : item * a.num_splits + s;
  }
};

// Waits for the split grid first (a no-op unless launched as its programmatic dependent): the
// pair table and the partials are its output.
__device__ __forceinline__ RowPartials row_partials(const DecodeArgs& a, int64_t item, int r,
                                                    int row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  RowPartials p{item, row, a.num_splits, 0};
  if (a.balanced) {
    const int2 pieces = a.pair_table[int64_t(r) * a.row_tiles + row / a.rows_per_cta];
    p.w0 = pieces.x;
    p.S = pieces.y;
  } else if (a.batch_invariant) {
    p.S = invariant_splits(a.seq_lens[r], a.num_splits);
  }
  return p;
}

// Chunk `chunk` of `chunks` (128 / chunks float4 columns each) of K rows of request r,
// rp[0..K) with the same number of partials S: the warp's part of the combine (lane = this
// thread's lane). A row whose partials are all empty gets zeros and LSE -inf. The K rows'
// loads go out together (the fused combine merges two rows at a time: one round trip for
// both instead of one each); a row's arithmetic does not depend on K. kBatch > 1 (the
// combine kernel; the split kernels' merges keep 1, for their registers): with S <= 32 the
// loads of kBatch partials per split group go out before any of them is added.
template <class T, int K, int kBatch = 1>
__device__ __forceinline__ void combine_rows(const DecodeArgs& a, const RowPartials (&rp)[K], int r,
                                             int chunk, int chunks, int lane) {
  const int S = rp[0].S;
  auto lse_at = [&](int k, int s) { return a.ws_lse[rp[k].part(a, s)]; };
  auto o_at = [&](int k, int s) { return a.ws_o + rp[k].part(a, s) * kKvLoraRank; };

  // Lane s keeps partial s's LSE (and below its weight) in a register: with S <= 32 (all
  // but one long request) the O loop takes the weight by a shuffle and the LSEs cost one
  // round trip instead of three. The arithmetic is the general loop's, value for value.
  float my_lse[K], big[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    my_lse[k] = lane < S ? lse_at(k, lane) : kNegInf;
    big[k] = my_lse[k];
    for (int s = lane + 32; s < S; s += 32) big[k] = fmaxf(big[k], lse_at(k, s));
    for (int o = 16; o > 0; o >>= 1)
      big[k] = fmaxf(big[k], __shfl_xor_sync(0xffffffffu, big[k], o));
  }

  const int chunk_f4 = (kKvLoraRank / 4) / chunks;  // float4 columns in the chunk
  const int col_lanes = chunk_f4 < 32 ? chunk_f4 : 32;
  const int groups = 32 / col_lanes, per_lane = chunk_f4 / col_lanes;  // per_lane <= 4
  const int group = lane / col_lanes;
  const int col0 = (chunk * chunk_f4 + lane % col_lanes) * 4;  // + 4 col_lanes j
  const int64_t start = int64_t(a.query_start[r]) * a.heads;
  T* out[K];
  float my_w[K], total[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    out[k] = static_cast<T*>(a.out) + (start + rp[k].row) * kKvLoraRank + col0;
    if (big[k] == kNegInf) {  // no split saw a key: zeros and -inf (uniform)
      if (group == 0)
        for (int j = 0; j < per_lane; ++j)
          *reinterpret_cast<uint2*>(out[k] + 4 * col_lanes * j) = make_uint2(0, 0);
      if (chunk == 0 && lane == 0) a.lse[start + rp[k].row] = kNegInf;
    }
    my_w[k] = my_lse[k] == kNegInf ? 0.0f : expf(my_lse[k] - big[k]);
    total[k] = 0.0f;
    total[k] += my_w[k];
    for (int s = lane + 32; s < S; s += 32) {
      const float l = lse_at(k, s);
      total[k] += l == kNegInf ? 0.0f : expf(l - big[k]);
    }
    for (int o = 16; o > 0; o >>= 1) total[k] += __shfl_xor_sync(0xffffffffu, total[k], o);
  }

  float4 sum[K][4];
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int j = 0; j < 4; ++j) sum[k][j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  // Adds w_s O_s. A weight of 0 adds nothing: an empty partial (LSE -inf, its slot may
  // hold NaN) is never read, and one whose weight underflowed would add exact zeros (an
  // empty row's weights are all 0).
  auto accumulate = [&](int k, int j, float w, const float4& v) {
    sum[k][j].x += w * v.x;
    sum[k][j].y += w * v.y;
    sum[k][j].z += w * v.z;
    sum[k][j].w += w * v.w;
  };
  auto add = [&](int k, int s, float w) {
    const float* o = o_at(k, s) + col0;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (j < per_lane)
        accumulate(k, j, w, *reinterpret_cast<const float4*>(o + 4 * col_lanes * j));
  };
  if (S <= 32) {
    if constexpr (kBatch > 1) {
      // kBatch partials per group at a time, all their loads first: a load tests only that its
      // partial exists (an empty one loads whatever its slot holds) and only the adds test the
      // weight, so the loads of a batch go out together instead of one round trip per partial
      // behind each test. Same partials, same order, same sums.
      for (int s0 = 0; s0 < S; s0 += kBatch * groups) {  // uniform over the warp (the shuffle)
        float4 v[kBatch][K][4];
        float w[kBatch][K];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int s = s0 + b * groups + group;
#pragma unroll
          for (int k = 0; k < K; ++k) {
            w[b][k] = __shfl_sync(0xffffffffu, my_w[k], s & 31);
            if (s >= S) w[b][k] = 0.0f;
            const float* o = o_at(k, min(s, S - 1)) + col0;
#pragma unroll
            for (int j = 0; j < 4; ++j)
              v[b][k][j] = j < per_lane && s < S
                               ? *reinterpret_cast<const float4*>(o + 4 * col_lanes * j)
                               : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          }
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
#pragma unroll
          for (int k = 0; k < K; ++k) {
            if (w[b][k] == 0.0f) continue;  // never adds an empty partial's (maybe NaN) slot
#pragma unroll
            for (int j = 0; j < 4; ++j)
              if (j < per_lane) accumulate(k, j, w[b][k], v[b][k][j]);
          }
        }
      }
    } else {
#pragma unroll 4
      for (int s0 = 0; s0 < S; s0 += groups) {  // uniform over the warp (the shuffle)
        const int s = s0 + group;
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const float w = __shfl_sync(0xffffffffu, my_w[k], s & 31);
          if (s < S && w != 0.0f) add(k, s, w);
        }
      }
    }
  } else {
#pragma unroll 4
    for (int s = group; s < S; s += groups) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const float l = lse_at(k, s);
        const float w = l == kNegInf ? 0.0f : expf(l - big[k]);
        if (w != 0.0f) add(k, s, w);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (big[k] == kNegInf) continue;            // written above
    for (int o = col_lanes; o < 32; o <<= 1) {  // the warp's split groups, lane by lane
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        sum[k][j].x += __shfl_xor_sync(0xffffffffu, sum[k][j].x, o);
        sum[k][j].y += __shfl_xor_sync(0xffffffffu, sum[k][j].y, o);
        sum[k][j].z += __shfl_xor_sync(0xffffffffu, sum[k][j].z, o);
        sum[k][j].w += __shfl_xor_sync(0xffffffffu, sum[k][j].w, o);
      }
    }
    const float inv = 1.0f / total[k];
    if (group == 0) {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (j < per_lane)
          *reinterpret_cast<uint2*>(out[k] + 4 * col_lanes * j) =
              make_uint2(pack2<T>(sum[k][j].x * inv, sum[k][j].y * inv),
                         pack2<T>(sum[k][j].z * inv, sum[k][j].w * inv));
    }
    if (chunk == 0 && lane == 0) a.lse[start + rp[k].row] = big[k] + logf(total[k]);
  }
}

// The rows of its pair that the fused combine gives the worker of piece s of a pair cut into
// n pieces: [s R / n, (s + 1) R / n) of the pair's R rows, as [x, y).
__device__ __forceinline__ int2 merge_rows_of(const DecodeArgs& a, const DecodeWork& piece) {
  const int rows = min(a.rows_per_cta, piece.nrows - piece.row0);
  return make_int2(piece.piece * rows / piece.pieces, (piece.piece + 1) * rows / piece.pieces);
}

// Those rows of `piece` (from worker piece.w0 on), whole rows (one chunk), each warp two rows
// at a time from global memory. The arithmetic per row is the combine kernel's.
// merge_cut_pieces (below) uses it for pieces of more partials than its shared memory holds.
template <class T>
__device__ __forceinline__ void merge_cut_piece(const DecodeArgs& a, const DecodeWork& piece) {
  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5;
  const int warps = int(blockDim.x) >> 5;
  const int n = piece.pieces;
  const int2 range = merge_rows_of(a, piece);
  const int lo = range.x, hi = range.y;
  auto partials = [&](int local) {
    const int row = piece.row0 + local;
    return RowPartials{int64_t(piece.r) * a.max_rows + row, row, n, piece.w0};
  };
  // Two rows at a time (H200, 2026-12-05: four at a time made the split kernels slower, e.g.
  // (16, 128, 4k) 79 against 67 us, mixed lengths 311 against 298).
  for (int local = lo + warp; local < hi; local += 2 * warps) {
    if (local + warps < hi) {
      const RowPartials rp[2] = {partials(local), partials(local + warps)};
      combine_rows<T, 2>(a, rp, piece.r, 0, 1, lane);
    } else {
      const RowPartials rp[1] = {partials(local)};
      combine_rows<T, 1>(a, rp, piece.r, 0, 1, lane);
    }
  }
}

// A worker's merges after the fused combine's grid barrier: the rows (merge_rows_of) of each of
// its (at most two) cut pieces. The split is over, so the kernel's dynamic shared memory is
// free: every partial row the merges read (2 KB each) is copied into it at once with its LSE
// (cp.async), so the merge waits one round trip instead of one per partial and row. Rows go in
// batches that fit (DecodeArgs::merge_rows); in a batch, each partial's ws index is worked out
// once and shared (a first version that divided it out again for every 16-byte copy was slower
// than the warp-per-row merge on H100), then the copies go out, then one thread per row turns
// its LSEs into weights exp(lse_s - max) and 1 / their sum as the combine kernel does, then a
// thread sums four columns of a row in split order. A piece of more partials than fit (a long
// request cut over most of the grid, about one row per worker) goes to merge_cut_piece.
// Measured on H200 (2026-12-05, eleventh session, against merge_cut_piece for every piece,
// alternated twice): (128, 12, 8k) 305.2 / 303.2 -> 298.9 / 296.1 us, (128, 16, 4k) 162.8 /
// 162.7 -> 160.5 / 160.7, (32, 12, 32k) 302.0 / 302.4 -> 299.2 / 298.8, mixed lengths
// 302.3 / 300.2 -> 296.2 / 297.7, block size 16 307.1 / 307.4 -> 300.9 / 301.9; per-CTA
// timer stamps put the merge of (128, 12, 4k) at 4.1 us against 5.3; q 4, DSpark and the
// 128-head shapes unchanged.
// Every loop here runs once per CTA, from a cold instruction cache, so none is unrolled: on H100
// (2026-12-05, twelfth session, alternated twice, bitwise the same results) the 64-row shapes
// that cut pairs gained ~2 us (DSpark 226.6 / 225.8 -> 224.3 / 223.9, (16, 128, 4k) 68.5 / 67.0
// -> 66.1 / 65.3, mixed q 2..6 505.2 / 506.5 -> 504.3 / 503.2), the 16-row ones moved within
// +-1.6 us both ways.
template <class T>
__device__ __forceinline__ void merge_cut_pieces(const DecodeArgs& a, const DecodeWork* cuts,
                                                 int ncuts) {
  extern __shared__ __align__(16) std::byte merge_smem[];
  uint32_t smem_bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(smem_bytes));
  constexpr int kCols = kKvLoraRank / 4;  // float4 columns of a row
  // Per partial (slot): its columns, ws index and LSE (then weight); per row (item, at most
  // one per slot): output row, first slot, partials and 1 / the weights' sum.
  constexpr int kPerSlot = kKvLoraRank * 4 + 8 + 4 + 8 + 4 + 4 + 4;
  int cap = int(smem_bytes / kPerSlot);
  if (a.merge_rows > 0) cap = min(cap, a.merge_rows);
  float* o_s = reinterpret_cast<float*>(merge_smem);
  int64_t* index_s = reinterpret_cast<int64_t*>(o_s + int64_t(cap) * kKvLoraRank);
  int64_t* out_s = index_s + cap;
  float* w_s = reinterpret_cast<float*>(out_s + cap);
  int* slot0_s = reinterpret_cast<int*>(w_s + cap);
  int* n_s = slot0_s + cap;
  float* inv_s = reinterpret_cast<float*>(n_s + cap);
  const int tid = int(threadIdx.x), threads = int(blockDim.x);
  int lo[2] = {0, 0}, n_rows[2] = {0, 0}, S[2] = {1, 1};  // piece i: first row, rows, partials
#pragma unroll 1
  for (int i = 0; i < ncuts; ++i) {
    const int2 range = merge_rows_of(a, cuts[i]);
    lo[i] = range.x;
    n_rows[i] = range.y - range.x;
    S[i] = cuts[i].pieces;
  }
#pragma unroll 1
  for (int i = 0; i < ncuts; ++i) {
    if (S[i] > cap) {  // (uniform)
      merge_cut_piece<T>(a, cuts[i]);
      n_rows[i] = 0;
    }
  }
  // (piece, row) items in order: piece 0's rows, then piece 1's; a batch is [b0, b1).
  const int items = n_rows[0] + (ncuts > 1 ? n_rows[1] : 0);
  auto piece_of = [&](int item) { return item < n_rows[0] ? 0 : 1; };
#pragma unroll 1
  for (int b0 = 0; b0 < items;) {
    // The batch: whole items while their partials fit; slots are numbered in item order.
    int b1 = b0, slots = 0;
#pragma unroll 1
    while (b1 < items && slots + S[piece_of(b1)] <= cap) slots += S[piece_of(b1++)];
    const int first0 = n_rows[0] > b0 ? min(b1, n_rows[0]) - b0 : 0;  // batch items of piece 0
    __syncthreads();  // the previous batch (or the split's last piece) is done with smem
    // 1. each row's output and slots, and where its partials are (a thread per row)
#pragma unroll 1
    for (int i = tid; i < b1 - b0; i += threads) {
      const int item = b0 + i, pi = piece_of(item);
      const DecodeWork& p = cuts[pi];
      const int local = item - (pi ? n_rows[0] : 0);
      const int slot0 = i < first0 ? i * S[0] : first0 * S[0] + (i - first0) * S[1];
      out_s[i] = int64_t(a.query_start[p.r]) * a.heads + p.row0 + lo[pi] + local;
      slot0_s[i] = slot0;
      n_s[i] = S[pi];
#pragma unroll 1
      for (int s = 0; s < S[pi]; ++s)
        index_s[slot0 + s] = balanced_partial(p.w0, p.pieces, s, a.rows_per_cta, lo[pi] + local);
    }
    __syncthreads();
    // 2. the copies: LSEs and columns, one round trip
    auto smem = [](const void* p) { return uint32_t(__cvta_generic_to_shared(p)); };
#pragma unroll 1
    for (int k = tid; k < slots; k += threads)
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem(w_s + k)),
                   "l"(a.ws_lse + index_s[k]));
#pragma unroll 1
    for (int c = tid; c < slots * kCols; c += threads) {
      const float* src = a.ws_o + index_s[c / kCols] * kKvLoraRank + (c % kCols) * 4;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem(o_s + c * 4)),
                   "l"(src));
    }
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
    __syncthreads();
    // 3. a row's weights (in place of its LSEs), 1 / their sum and its LSE
#pragma unroll 1
    for (int i = tid; i < b1 - b0; i += threads) {
      const int slot0 = slot0_s[i], n = n_s[i];
      float big = kNegInf;
#pragma unroll 1
      for (int s = 0; s < n; ++s) big = fmaxf(big, w_s[slot0 + s]);
      float total = 0.0f;
#pragma unroll 1
      for (int s = 0; s < n; ++s) {  // no split saw a key: weights 0, zeros and -inf
        const float l = w_s[slot0 + s];
        const float w = l == kNegInf ? 0.0f : expf(l - big);
        w_s[slot0 + s] = w;
        total += w;
      }
      inv_s[i] = big == kNegInf ? 0.0f : 1.0f / total;
      a.lse[out_s[i]] = big == kNegInf ? kNegInf : big + logf(total);
    }
    __syncthreads();
    // 4. the sums, four columns a thread
#pragma unroll 1
    for (int c = tid; c < (b1 - b0) * kCols; c += threads) {
      const int i = c / kCols, col = c % kCols;
      const int slot0 = slot0_s[i], n = n_s[i];
      float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 1
      for (int s = 0; s < n; ++s) {
        const float w = w_s[slot0 + s];
        if (w != 0.0f) {  // an empty partial's slot may hold NaN: never added
          const float4 v =
              *reinterpret_cast<const float4*>(o_s + (slot0 + s) * kKvLoraRank + col * 4);
          sum.x += w * v.x;
          sum.y += w * v.y;
          sum.z += w * v.z;
          sum.w += w * v.w;
        }
      }
      const float inv = inv_s[i];
      *reinterpret_cast<uint2*>(static_cast<T*>(a.out) + out_s[i] * kKvLoraRank + col * 4) =
          make_uint2(pack2<T>(sum.x * inv, sum.y * inv), pack2<T>(sum.z * inv, sum.w * inv));
    }
    b0 = b1;
  }
}

// Launches a split kernel over `grid`, its first argument `a`; cooperatively when
// a.fused_combine, which the kernel's grid-wide barrier needs (every CTA resident at once).
// Where the grid would not fit at once (another GPU, a plan's worker count forced above
// the slots, or a launch the driver still refuses as too large: a GPU shared under MPS, say)
// a.fused_combine is cleared instead and the caller runs the combine kernel.
template <class... Params, class... Rest>
void launch_split_kernel(void (*kernel)(Params...), dim3 grid, int threads, int smem,
                         cudaStream_t stream, DecodeArgs& a, const Rest&... rest) {
  if (a.fused_combine) {
    int device = 0, sms = 0, coop = 0, per_sm = 0;
    KMLA_CUDA_CHECK(cudaGetDevice(&device));
    KMLA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    KMLA_CUDA_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device));
    KMLA_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, size_t(smem)));
    a.fused_combine = coop != 0 && int64_t(per_sm) * sms >= int64_t(grid.x) * grid.y * grid.z;
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = size_t(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = a.fused_combine ? 1 : 0;
  cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, a, rest...);
  if (e == cudaErrorCooperativeLaunchTooLarge && a.fused_combine) {
    (void)cudaGetLastError();  // not sticky: launch plainly instead
    a.fused_combine = false;
    cfg.numAttrs = 0;
    e = cudaLaunchKernelEx(&cfg, kernel, a, rest...);
  }
  KMLA_CUDA_CHECK(e);
}
#endif

}  // namespace kmla::cuda
