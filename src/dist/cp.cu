// Decode context parallelism on the device: a rank's shard result spread onto the full
// batch's rows, the NCCL all-gather of every rank's partial, and the W-way LSE merge.
//
// Both kernels are memory-bound copies: one 128-thread block per (row, head), threads
// striding over the D = 512 outputs (4 floats each), so every load and store is coalesced.
// Shared memory: the merge keeps W weights (W <= kMaxWorld = 64: 256 bytes); no other
// shared memory, no register pressure (a handful of scalars per thread).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "kmla/dist.hpp"
#include "kmla/error.hpp"

#define KMLA_DIST_CUDA_CHECK(expr)                                                            \
  do {                                                                                        \
    const cudaError_t e_ = (expr);                                                            \
    if (e_ != cudaSuccess)                                                                    \
      ::kmla::detail::fail(__FILE__, __LINE__, #expr, "CUDA error ", cudaGetErrorName(e_), ": ", \
                           cudaGetErrorString(e_));                                           \
  } while (0)
#define KMLA_DIST_LAUNCH_CHECK() KMLA_DIST_CUDA_CHECK(cudaGetLastError())

namespace kmla::dist {
namespace {

constexpr int kThreads = 128;
constexpr int kMaxWorld = 64;

cudaStream_t raw(cuda::Stream s) { return reinterpret_cast<cudaStream_t>(s); }

__device__ __forceinline__ float load_f(const float* p) { return *p; }
__device__ __forceinline__ float load_f(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load_f(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ void store_f(float* p, float x) { *p = x; }
__device__ __forceinline__ void store_f(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void store_f(__half* p, float x) { *p = __float2half_rn(x); }

// Rows the shard does not hold: zeros (cudaMemsetAsync) and LSE -inf (this kernel).
__global__ void fill_neg_inf(float* lse, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) lse[i] = -INFINITY;
}

// Block (i, h): shard row i, head h -> full row rows[i]. A row index outside [0, Td) (a
// corrupt upload) is skipped: nothing is written out of bounds.
template <class T>
__global__ void scatter_rows(const int64_t* __restrict__ rows, const T* __restrict__ shard_out,
                             const float* __restrict__ shard_lse, float* __restrict__ full_out,
                             float* __restrict__ full_lse, int heads, int dim, int64_t full_rows) {
  const int64_t i = blockIdx.x / heads;
  const int h = int(blockIdx.x % heads);
  const int64_t t = rows[i];
  if (t < 0 || t >= full_rows) return;
  const T* src = shard_out + (i * heads + h) * dim;
  float* dst = full_out + (t * heads + h) * dim;
  for (int d = threadIdx.x; d < dim; d += blockDim.x) dst[d] = load_f(src + d);
  if (threadIdx.x == 0) full_lse[t * heads + h] = shard_lse[i * heads + h];
}

// Block r = (row, head): the W partials of that row merged by their LSEs, with the rules of
// kmla::cp_merge (an infinite LSE is an empty partial whose output is never read; a row
// empty everywhere is zeros with LSE -inf).
template <class T>
__global__ void merge_partials(const float* __restrict__ g_out, const float* __restrict__ g_lse,
                               T* __restrict__ out, float* __restrict__ out_lse, int world, int64_t rows,
                               int dim) {
  __shared__ float weight[kMaxWorld];
  __shared__ float row_max, row_sum;
  const int64_t r = blockIdx.x;
  if (threadIdx.x == 0) {
    float m = -INFINITY;
    for (int k = 0; k < world; ++k) {
      const float l = g_lse[int64_t(k) * rows + r];
      weight[k] = isinf(l) ? -INFINITY : l;
      m = fmaxf(m, weight[k]);
    }
    float s = 0.0f;
    if (m != -INFINITY)
      for (int k = 0; k < world; ++k) {
        weight[k] = weight[k] == -INFINITY ? 0.0f : expf(weight[k] - m);
        s += weight[k];
      }
    for (int k = 0; k < world; ++k) weight[k] = m == -INFINITY ? 0.0f : weight[k] / s;
    row_max = m;
    row_sum = s;
  }
  __syncthreads();
  for (int d = threadIdx.x; d < dim; d += blockDim.x) {
    float acc = 0.0f;
    for (int k = 0; k < world; ++k)
      if (weight[k] != 0.0f) acc += weight[k] * g_out[(int64_t(k) * rows + r) * dim + d];
    store_f(out + r * dim + d, acc);
  }
  if (threadIdx.x == 0) out_lse[r] = row_max == -INFINITY ? -INFINITY : row_max + logf(row_sum);
}

void check_dev(const TensorView& t, const char* what) {
  KMLA_CHECK(t.device == Device::cuda, what, " must be in device memory");
}

}  // namespace

void cp_scatter_partial(const TensorView& rows, const TensorView& shard_out, const TensorView& shard_lse,
                        const TensorView& full_out, const TensorView& full_lse, cuda::Stream stream) {
  check_tensor(full_out, "full partial output", DType::f32, {-1, -1, -1}, Device::cuda);
  const int64_t Td = full_out.dim(0), H = full_out.dim(1), D = full_out.dim(2);
  check_tensor(full_lse, "full partial lse", DType::f32, {Td, H}, Device::cuda);
  KMLA_CHECK(shard_out.ndim == 3 && shard_out.dim(1) == H && shard_out.dim(2) == D, "shard output ",
             shard_out.shape_str(), " does not match the full output ", full_out.shape_str());
  const int64_t Ts = shard_out.dim(0);
  KMLA_CHECK(Ts <= Td, "the shard has ", Ts, " rows, more than the batch's ", Td);
  check_dev(shard_out, "shard output");
  check_tensor(shard_lse, "shard lse", DType::f32, {Ts, H}, Device::cuda);
  check_tensor(rows, "shard rows", DType::i64, {Ts}, Device::cuda);
  if (Td * H == 0) return;
  KMLA_DIST_CUDA_CHECK(cudaMemsetAsync(full_out.data, 0, full_out.bytes(), raw(stream)));
  const int64_t n = Td * H;
  fill_neg_inf<<<unsigned((n + 255) / 256), 256, 0, raw(stream)>>>(full_lse.as<float>(), n);
  KMLA_DIST_LAUNCH_CHECK();
  if (Ts == 0) return;
  const unsigned grid = unsigned(Ts * H);
  auto go = [&](auto* src) {
    scatter_rows<<<grid, kThreads, 0, raw(stream)>>>(rows.as<const int64_t>(), src, shard_lse.as<const float>(),
                                                     full_out.as<float>(), full_lse.as<float>(), int(H), int(D), Td);
    KMLA_DIST_LAUNCH_CHECK();
  };
  switch (shard_out.dtype) {
    case DType::f32: go(shard_out.as<const float>()); break;
    case DType::bf16: go(shard_out.as<const __nv_bfloat16>()); break;
    case DType::f16: go(shard_out.as<const __half>()); break;
    default: KMLA_CHECK(false, "shard output must be f32, bf16 or f16, got ", dtype_name(shard_out.dtype));
  }
}

void cp_merge_partials(const TensorView& gathered_out, const TensorView& gathered_lse, const TensorView& out,
                       const TensorView& lse, cuda::Stream stream) {
  check_tensor(gathered_out, "gathered partial outputs", DType::f32, {-1, -1, -1, -1}, Device::cuda);
  const int64_t W = gathered_out.dim(0), Td = gathered_out.dim(1), H = gathered_out.dim(2),
                D = gathered_out.dim(3);
  KMLA_CHECK(W >= 1 && W <= kMaxWorld, "context-parallel world must be in [1, ", kMaxWorld, "], got ", W);
  check_tensor(gathered_lse, "gathered partial lse", DType::f32, {W, Td, H}, Device::cuda);
  check_tensor(lse, "merged lse", DType::f32, {Td, H}, Device::cuda);
  KMLA_CHECK(out.ndim == 3 && out.dim(0) == Td && out.dim(1) == H && out.dim(2) == D, "merged output ",
             out.shape_str(), " must be [", Td, ", ", H, ", ", D, "]");
  check_dev(out, "merged output");
  const int64_t rows = Td * H;
  if (rows == 0) return;
  KMLA_CHECK(rows < (int64_t(1) << 31), "too many rows to merge: ", rows);
  auto go = [&](auto* dst) {
    merge_partials<<<unsigned(rows), kThreads, 0, raw(stream)>>>(gathered_out.as<const float>(),
                                                                 gathered_lse.as<const float>(), dst,
                                                                 lse.as<float>(), int(W), rows, int(D));
    KMLA_DIST_LAUNCH_CHECK();
  };
  switch (out.dtype) {
    case DType::f32: go(out.as<float>()); break;
    case DType::bf16: go(out.as<__nv_bfloat16>()); break;
    case DType::f16: go(out.as<__half>()); break;
    default: KMLA_CHECK(false, "merged output must be f32, bf16 or f16, got ", dtype_name(out.dtype));
  }
}

size_t cp_gather_workspace_bytes(int world, int64_t rows, int heads, int dim) {
  KMLA_CHECK(world >= 1 && rows >= 0 && heads >= 1 && dim >= 1, "bad context-parallel gather shape: world ",
             world, ", rows ", rows, ", heads ", heads, ", dim ", dim);
  // Outputs first, then the LSEs; both f32, the LSE block 256-byte aligned.
  const size_t out_bytes = size_t(world) * size_t(rows) * size_t(heads) * size_t(dim) * sizeof(float);
  const size_t lse_bytes = size_t(world) * size_t(rows) * size_t(heads) * sizeof(float);
  return (out_bytes + 255) / 256 * 256 + lse_bytes;
}

void cp_all_gather_merge(Communicator& comm, const TensorView& partial_out, const TensorView& partial_lse,
                         void* workspace, const TensorView& out, const TensorView& lse, cuda::Stream stream) {
  check_tensor(partial_out, "partial output", DType::f32, {-1, -1, -1}, Device::cuda);
  const int64_t Td = partial_out.dim(0), H = partial_out.dim(1), D = partial_out.dim(2);
  check_tensor(partial_lse, "partial lse", DType::f32, {Td, H}, Device::cuda);
  const int W = comm.world();
  KMLA_CHECK(workspace != nullptr || Td == 0, "cp_all_gather_merge needs a workspace of ",
             cp_gather_workspace_bytes(W, Td, int(H), int(D)), " bytes");
  const size_t out_bytes = size_t(W) * size_t(Td * H * D) * sizeof(float);
  char* ws = static_cast<char*>(workspace);
  const TensorView g_out(ws, DType::f32, {W, Td, H, D}, Device::cuda);
  const TensorView g_lse(ws + (out_bytes + 255) / 256 * 256, DType::f32, {W, Td, H}, Device::cuda);
  comm.all_gather(partial_out, g_out, stream);
  comm.all_gather(partial_lse, g_lse, stream);
  cp_merge_partials(g_out, g_lse, out, lse, stream);
}

}  // namespace kmla::dist
