// Shared by every CUDA translation unit of the backend: error checks that throw
// kmla::Error, the activation element types, scalar conversions usable in kernels, and
// the device error flag. Internal: the public headers never include CUDA headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kmla/cache.hpp"
#include "kmla/error.hpp"
#include "kmla/numeric.hpp"
#include "kmla/tensor.hpp"

// Throws kmla::Error naming the call and the CUDA error when `expr` fails.
#define KMLA_CUDA_CHECK(expr)                                                              \
  do {                                                                                     \
    const cudaError_t kmla_err_ = (expr);                                                  \
    if (kmla_err_ != cudaSuccess)                                                          \
      ::kmla::detail::fail(__FILE__, __LINE__, #expr, "CUDA error ",                       \
                           cudaGetErrorName(kmla_err_), ": ", cudaGetErrorString(kmla_err_)); \
  } while (0)

// After every kernel launch: a bad configuration surfaces here, not at a later sync.
#define KMLA_LAUNCH_CHECK() KMLA_CUDA_CHECK(cudaGetLastError())

namespace kmla::cuda {

using bf16 = __nv_bfloat16;
using fp16 = __half;

// Bits of the device error flag (an int in device memory that kernels OR into). A set bit
// means a kernel refused a write; nothing was written out of bounds.
enum DeviceErrorBits : int {
  kErrBadSlot = 1,       // a cache slot outside the cache
  kErrBadBlockId = 2,    // a block table entry outside the cache
  kErrBadPosition = 4,   // a position outside the RoPE table
};

// An L2 cache policy (createpolicy) under which the lines a load brings in are the first to
// go when L2 needs room: for the decode kernels' key streams, which nothing reads again soon.
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

__device__ inline void raise_error(int* flag, int bit) {
  if (flag) atomicOr(flag, bit);
}

// Activation element type <-> fp32. Conversions to 16-bit round to nearest even.
template <class T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<bf16>(bf16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_float<fp16>(fp16 x) { return __half2float(x); }
template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ bf16 from_float<bf16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ fp16 from_float<fp16>(float x) { return __float2half_rn(x); }
// x rounded to T and read back (the semantics' "round to act").
template <class T> __device__ __forceinline__ float round_to(float x) { return to_float(from_float<T>(x)); }
// The output gate: a * sigmoid(g) with every step rounded to fp32 (expf), the value the gate
// kernel and the decode W_UV epilogue both round to act.
__device__ __forceinline__ float gated(float a, float g) {
  return __fmul_rn(a, __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g))));
}
// Two fp32 values rounded to T (nearest even) and packed, lo in the low half (the lower
// column index): one mma operand register.
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
// 2^x by ex2.approx (relative error ~2^-22; 2^-inf = 0): the softmax exponentials.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The largest of m[0 .. W - 1] as a balanced tree (ceil(log2 W) levels, not a chain of W - 1).
template <int W>
__device__ __forceinline__ float tree_max(float* m) {
  if constexpr (W == 1) {
    return m[0];
  } else {
    constexpr int h = (W + 1) / 2;
#pragma unroll
    for (int i = 0; i < W - h; ++i) m[i] = fmaxf(m[i], m[i + h]);
    return tree_max<h>(m);
  }
}

// One online-softmax step (base 2) of a thread's two rows over NB column blocks of the
// mma accumulator layout (v[4i + 2h], v[4i + 2h + 1]: row h of block i; masked scores -inf),
// as both 16-bit prefill kernels run it: the rows' new maxima (over the 4 lanes of a row),
// p = 2^(s * scale_log2 - max * scale_log2) in place, l = l * correction + sum p, and the
// correction 2^(old max - new max) of O. A row with no visible key yet keeps max -inf and
// subtracts 0 instead, so its p = 2^-inf = 0 (not NaN). Returns whether a row of this thread
// moved its max (correction exactly 1 otherwise).
template <int NB>
__device__ __forceinline__ bool online_softmax_rows(float* v, float (&row_max)[2],
                                                    float (&row_sum)[2], float (&correction)[2],
                                                    float scale_log2) {
  bool moved = false;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = row_max[h];
#pragma unroll
    for (int i = 0; i < NB; ++i) mx = fmaxf(mx, fmaxf(v[4 * i + 2 * h], v[4 * i + 2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mx_scaled = mx == -INFINITY ? 0.f : mx * scale_log2;
    correction[h] = fast_exp2(row_max[h] * scale_log2 - mx_scaled);
    moved |= mx != row_max[h];
    row_max[h] = mx;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < NB; ++i) {
      v[4 * i + 2 * h] = fast_exp2(fmaf(v[4 * i + 2 * h], scale_log2, -mx_scaled));
      v[4 * i + 2 * h + 1] = fast_exp2(fmaf(v[4 * i + 2 * h + 1], scale_log2, -mx_scaled));
      sum += v[4 * i + 2 * h] + v[4 * i + 2 * h + 1];
    }
    row_sum[h] = row_sum[h] * correction[h] + sum;
  }
  return moved;
}

// e4m3 code -> fp32, exact.
__device__ __forceinline__ float e4m3_value(uint8_t c) {
  __nv_fp8_e4m3 v;
  v.__x = c;
  return float(v);
}

// Calls fn.template operator()<T>() with T the element type of activation dtype `act`
// (bf16 or f16); anything else throws.
template <class Fn>
void dispatch_act(DType act, Fn&& fn) {
  if (act == DType::bf16) {
    fn.template operator()<bf16>();
  } else {
    KMLA_CHECK(act == DType::f16, "CUDA kernels take bf16 or f16 activations, got ", dtype_name(act));
    fn.template operator()<fp16>();
  }
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The paged latent cache as kernels see it.
struct CacheRef {
  std::byte* base = nullptr;
  int64_t block_stride = 0;  // bytes
  int block_size = 0;
  int64_t num_blocks = 0;
  CacheFormat format = CacheFormat::bf16;
  float k_scale = 1.0f;       // plain fp8: stored = x / k_scale
  TileScaleRule tile_rule = TileScaleRule::power_of_two;

  __host__ __device__ int64_t num_slots() const { return num_blocks * block_size; }
  __host__ __device__ std::byte* row(int64_t slot) const {
    return base + (slot / block_size) * block_stride +
           (slot % block_size) * int64_t(cache_entry_bytes_hd(format));
  }
  __host__ __device__ static size_t cache_entry_bytes_hd(CacheFormat f) {
    return f == CacheFormat::fp8 ? 576 : f == CacheFormat::fp8_ds_mla ? 656 : 1152;
  }
};

CacheRef cache_ref(const LatentCache& cache);

// A 0|1 switch from the environment (A/B runs); unset or empty: `fallback`. Any other value
// is an error.
bool env_switch(const char* name, bool fallback);
// An integer in [lo, hi] from the environment (A/B runs); unset or empty: `fallback`. Anything
// else is an error.
int env_int_in(const char* name, int fallback, int lo, int hi);

// Whether `stream` is capturing a graph, or cannot tell (the legacy stream while another stream
// captures in global mode answers with an error, which is cleared): work that must not be
// captured (timing, synchronization) checks this first.
bool stream_capturing(cudaStream_t stream);

// A batch's request metadata in device memory, in the layout order of BatchMetadata.
// Arrays are sized for a captured capacity; request slots past the real ones have
// query_len 0 and seq_len 0, rows past the real ones have slot -1.
struct DeviceBatch {
  const int32_t* block_tables = nullptr;  // [num_requests, max_blocks]
  const int32_t* seq_lens = nullptr;      // [num_requests] context + query
  const int32_t* query_lens = nullptr;    // [num_requests]
  const int32_t* query_start = nullptr;   // [num_requests + 1] first row of each request
  const int64_t* slot_mapping = nullptr;  // [num_rows], -1 = no write
  const int32_t* num_tokens = nullptr;    // device scalar: real rows (the rest is padding)
  int num_requests = 0;
  int max_blocks = 0;
  int64_t num_rows = 0;
};

}  // namespace kmla::cuda
