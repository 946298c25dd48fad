// Hopper (sm_90a) building blocks shared by the wgmma attention kernels: shared-memory
// addresses and proxy fences, mbarriers, the 128-byte swizzle, wgmma matrix descriptors and
// the warpgroup MMA instructions themselves.
//
// Everything device-side here exists only when compiling for sm_90a (KMLA_SM90A is 1): the
// sm_80 compile of a file that includes this header sees no wgmma at all, and its kernels
// must compile to empty bodies under `#if KMLA_SM90A`.
//
// Layout convention (the one all descriptors below assume): an operand tile is a sequence of
// "panels", each 64 16-bit elements (128 bytes) wide and 1024-byte aligned. Inside a panel,
// the 16-byte chunk c (0..7) of row r is stored at r * 128 + ((c ^ (r & 7)) * 16): the
// hardware's 128-byte swizzle, whose pattern repeats every 8 rows (1024 bytes).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "cuda/common.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KMLA_SM90A 1
#else
#define KMLA_SM90A 0
#endif

namespace kmla::cuda {

// cuTensorMapEncodeTiled from the driver, looked up once through the runtime (no libcuda link);
// null if the driver lacks it. Host code, defined in common.cu for every TMA user.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder();

// Whether `kernel` (a __global__ function of this binary) runs its sm_90a code on `device`:
// an sm_90 GPU, and the binary holds code compiled for compute_90a (SASS 9.x from PTX 9.x:
// a build without compute_90a would run, or JIT from older PTX, the kernel's sm_80 body,
// which is empty or traps). Attribute queries only, no sync; the answer per device is kept
// in `answers` (0: not asked yet, 1: no, 2: yes), one array per kernel family. Host code,
// in common.cu.
inline constexpr int kMaxSm90Devices = 64;
bool sm90a_kernel_runs_on(int device, const void* kernel,
                          std::atomic<int> (&answers)[kMaxSm90Devices]);

}  // namespace kmla::cuda

namespace kmla::cuda::sm90 {

constexpr int kPanelElems = 64;      // 16-bit elements per panel row
constexpr int kPanelRowBytes = 128;  // one swizzle row
constexpr int kSwizzleAtomBytes = 1024;  // 8 rows: panels (and descriptor starts) align to it

// Byte offset of 16-byte chunk `chunk` (0..7) of row `row` inside a 128-byte-swizzled panel.
__host__ __device__ constexpr uint32_t swizzle128(int row, int chunk) {
  return uint32_t(row * kPanelRowBytes + ((chunk ^ (row & 7)) << 4));
}

#if KMLA_SM90A

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Named barrier kId (1..15; 0 is __syncthreads) over kCount threads (a multiple of 32): wait
// until all have arrived, or arrive without waiting. Immediate ids, so that ptxas reserves only
// the barriers a kernel uses.
template <int kId, int kCount>
__device__ __forceinline__ void named_bar_sync() {
  asm volatile("bar.sync %0, %1;\n" ::"n"(kId), "n"(kCount) : "memory");
}
template <int kId, int kCount>
__device__ __forceinline__ void named_bar_arrive() {
  asm volatile("bar.arrive %0, %1;\n" ::"n"(kId), "n"(kCount) : "memory");
}

// Makes this thread's completed generic-proxy writes to shared memory (st.shared, finished
// cp.async) visible to later async-proxy reads (wgmma operands) by any thread that
// synchronises with it afterwards.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads (a multiple of 32).
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- mbarriers ---------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint64_t* bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(arrivals));
}
// Ends `bar`'s life as an mbarrier (no arrivals or copies pending), so it may be initialised again.
__device__ __forceinline__ void mbar_inval(uint64_t* bar) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// The waits and arrivals also take the barrier's shared-memory address: a loop that computes
// it once keeps the generic-to-shared conversion (S2UR of the CTA id and address arithmetic)
// off its critical path.
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) { mbar_arrive(smem_u32(bar)); }
// Waits for the phase of `bar` with parity `parity` to complete. A wait still pending after
// 2^26 polls (seconds) means a broken pipeline: trap, so the launch fails visibly instead of
// hanging the GPU.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      " .reg .pred ready, stuck;\n"
      " .reg .u32 n;\n"
      " mov.u32 n, 0;\n"
      "poll_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 ready, [%0], %1;\n"
      " @ready bra done_%=;\n"
      " add.u32 n, n, 1;\n"
      " setp.gt.u32 stuck, n, 67108864;\n"
      " @stuck trap;\n"
      " bra poll_%=;\n"
      "done_%=:\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  mbar_wait(smem_u32(bar), parity);
}

// Arrives on `bar` and raises its transaction count by `bytes` in one step: the phase then
// completes only when the bulk copies that signal `bar` have delivered that many bytes.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile(
      "{\n .reg .b64 state;\n mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(
          smem_u32(bar)),
      "r"(bytes)
      : "memory");
}
// Makes mbarrier.init of this thread visible to the async proxy (bulk copies signalling it).
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// All threads of every CTA of the cluster meet (release / acquire: shared-memory writes and
// mbarrier inits before it are visible to the cluster's CTAs after it).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::
                   : "memory");
}

// `bytes` (a multiple of 16, 16-byte aligned both sides) from global `src` into shared memory
// at offset `dst` of every CTA of the cluster in `mask`, each CTA's mbarrier at offset `bar`
// receiving the bytes as transactions.
__device__ __forceinline__ void bulk_copy_multicast(uint32_t dst, const void* src, uint32_t bytes,
                                                    uint32_t bar, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1], %2, [%3], %4;\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "h"(mask)
      : "memory");
}

// ---- bulk tensor copies (TMA) ----------------------------------------------------------
// One box of the 3-D tensor map `map` (a __grid_constant__ kernel parameter) at coordinates
// (c0, c1, c2), innermost first, into shared memory at `dst`; completion is signalled to
// `bar` as transaction bytes. With a 128-byte swizzled map and `dst` 1024-byte aligned the
// box lands in the panel layout above.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* map, int c0, int c1, int c2,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar))
      : "memory");
}

// The same under an L2 cache policy (e.g. l2_evict_first_policy()).
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* map, int c0, int c1, int c2,
                                            uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar)),
      "l"(policy)
      : "memory");
}

// A 4-D box under an L2 cache policy: coordinates c0 (innermost) .. c3.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* map, int c0, int c1, int c2,
                                            int c3, uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(bar)),
      "l"(policy)
      : "memory");
}

// ---- wgmma matrix descriptors ---------------------------------------------------------
// PTX "matrix descriptor": bits 0-13 start address >> 4, 16-29 leading-dimension byte offset
// >> 4, 32-45 stride-dimension byte offset >> 4, 62-63 swizzle mode (1 = 128 B). The base
// offset field (49-51) stays 0 because every panel starts 1024-byte aligned.
__device__ __forceinline__ uint64_t make_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(lbo >> 4) << 16) |
         (uint64_t(sbo >> 4) << 32) | (uint64_t(1) << 62);
}
// The same descriptor as two 32-bit halves, for loops: lo = start address >> 4 | leading offset
// >> 4 << 16, hi = stride offset >> 4 | swizzle mode << 30 (make_desc_halves(lo, hi) joins them).
// Shared addresses stay below 2^18, so the start field never carries into the next: adding
// bytes >> 4 to lo moves the start by `bytes`, and a loop forms each k-step's descriptor by
// one add to a low half computed once, instead of masking and shifting an address per MMA
// on its critical path.
__device__ __forceinline__ uint32_t desc_lo(uint32_t addr, uint32_t lbo) {
  return (addr >> 4) | ((lbo >> 4) << 16);
}
__host__ __device__ constexpr uint32_t desc_hi(uint32_t sbo, uint32_t swizzle_mode) {
  return (sbo >> 4) | (swizzle_mode << 30);
}
__device__ __forceinline__ uint64_t make_desc_halves(uint32_t lo, uint32_t hi) {
  return (uint64_t(hi) << 32) | lo;
}
// K-major operand (each row holds 64 consecutive reduction elements of one panel): 8-row
// groups are 1024 bytes apart; the leading offset is ignored for swizzled K-major layouts.
// Step k (16 elements) inside the panel: addr + 32 k.
__device__ __forceinline__ uint64_t desc_k_major(uint32_t addr) {
  return make_desc(addr, 16, kSwizzleAtomBytes);
}
// MN-major B (rows = the reduction dim, 64 output columns per panel row): the leading offset
// is the distance between consecutive 64-column panels, the stride offset the distance
// between 8-row groups. Step k (16 reduction rows): addr + 16 * 128.
__device__ __forceinline__ uint64_t desc_mn_major(uint32_t addr, uint32_t panel_bytes) {
  return make_desc(addr, panel_bytes, kSwizzleAtomBytes);
}

// ---- warpgroup MMA --------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most N committed wgmma groups of this warpgroup are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses to an accumulator across the (volatile asm) issue
// and wait of an asynchronous MMA.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Accumulator layout of m64nN (fp32): warp w of the warpgroup holds rows 16w..16w+15; lane
// (g = lane / 4, t = lane % 4) holds, for each 8-column block i, d[4i], d[4i+1] = row g,
// columns 8i + 2t, 8i + 2t + 1 and d[4i+2], d[4i+3] = row g + 8, the same columns.

// Multiplies this thread's two rows of an m64nN accumulator (layout above) by c[0] (row g)
// and c[1] (row g + 8): the online softmax's rescale of O.
template <int N>
__device__ __forceinline__ void scale_acc_rows(float (&d)[N], const float (&c)[2]) {
#pragma unroll
  for (int i = 0; i < N / 4; ++i) {
    d[4 * i + 0] *= c[0];
    d[4 * i + 1] *= c[0];
    d[4 * i + 2] *= c[1];
    d[4 * i + 3] *= c[1];
  }
}

#define KMLA_SM90_REGS16 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define KMLA_SM90_REGS32 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, " \
  "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define KMLA_SM90_REGS64 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, " \
  "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, " \
  "%35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, " \
  "%52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define KMLA_SM90_REGS128 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, " \
  "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, " \
  "%35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, " \
  "%52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, " \
  "%69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, " \
  "%86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, " \
  "%102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, " \
  "%116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
#define KMLA_SM90_ACC8(i)                                                                \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]),            \
      "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define KMLA_SM90_ACC16 KMLA_SM90_ACC8(0), KMLA_SM90_ACC8(8)
#define KMLA_SM90_ACC32 KMLA_SM90_ACC16, KMLA_SM90_ACC8(16), KMLA_SM90_ACC8(24)
#define KMLA_SM90_ACC64                                                              \
  KMLA_SM90_ACC16, KMLA_SM90_ACC8(16), KMLA_SM90_ACC8(24), KMLA_SM90_ACC8(32),         \
      KMLA_SM90_ACC8(40), KMLA_SM90_ACC8(48), KMLA_SM90_ACC8(56)
#define KMLA_SM90_ACC128                                                                 \
  KMLA_SM90_ACC64, KMLA_SM90_ACC8(64), KMLA_SM90_ACC8(72), KMLA_SM90_ACC8(80),             \
      KMLA_SM90_ACC8(88), KMLA_SM90_ACC8(96), KMLA_SM90_ACC8(104), KMLA_SM90_ACC8(112),    \
      KMLA_SM90_ACC8(120)
// Expands MMA(type, trans_b) for the activation type T and kTransB, all immediates literal.
#define KMLA_SM90_DISPATCH(MMA)                                                  \
  if constexpr (std::is_same_v<T, bf16>) {                                       \
    if constexpr (kTransB) MMA("bf16", "1"); else MMA("bf16", "0");             \
  } else {                                                                       \
    if constexpr (kTransB) MMA("f16", "1"); else MMA("f16", "0");               \
  }

// d (64 x N fp32) = (accumulate ? d : 0) + A (64 x 16, K-major, shared memory through
// desc_a) x B (16 x N, shared memory through desc_b: MN-major when kTransB, else K-major).
template <class T, bool kTransB>
__device__ __forceinline__ void wgmma_ss_m64n32k16(float (&d)[16], uint64_t desc_a,
                                                   uint64_t desc_b, bool accumulate) {
#define KMLA_SM90_MMA(TY, TB)                                                            \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %18, 0;\n"                            \
               " wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " " KMLA_SM90_REGS16 \
               ", %16, %17, p, 1, 1, 0, " TB ";\n}\n"                                    \
               : KMLA_SM90_ACC16                                                         \
               : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)))
  KMLA_SM90_DISPATCH(KMLA_SM90_MMA)
#undef KMLA_SM90_MMA
}

template <class T, bool kTransB>
__device__ __forceinline__ void wgmma_ss_m64n64k16(float (&d)[32], uint64_t desc_a,
                                                   uint64_t desc_b, bool accumulate) {
#define KMLA_SM90_MMA(TY, TB)                                                            \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"                            \
               " wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " KMLA_SM90_REGS32 \
               ", %32, %33, p, 1, 1, 0, " TB ";\n}\n"                                    \
               : KMLA_SM90_ACC32                                                         \
               : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)))
  KMLA_SM90_DISPATCH(KMLA_SM90_MMA)
#undef KMLA_SM90_MMA
}

template <class T, bool kTransB>
__device__ __forceinline__ void wgmma_ss_m64n128k16(float (&d)[64], uint64_t desc_a,
                                                    uint64_t desc_b, bool accumulate) {
#define KMLA_SM90_MMA(TY, TB)                                                             \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"                             \
               " wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " KMLA_SM90_REGS64 \
               ", %64, %65, p, 1, 1, 0, " TB ";\n}\n"                                     \
               : KMLA_SM90_ACC64                                                          \
               : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)))
  KMLA_SM90_DISPATCH(KMLA_SM90_MMA)
#undef KMLA_SM90_MMA
}

template <class T, bool kTransB>
__device__ __forceinline__ void wgmma_ss_m64n256k16(float (&d)[128], uint64_t desc_a,
                                                    uint64_t desc_b, bool accumulate) {
#define KMLA_SM90_MMA(TY, TB)                                                               \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"                              \
               " wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " " KMLA_SM90_REGS128 \
               ", %128, %129, p, 1, 1, 0, " TB ";\n}\n"                                     \
               : KMLA_SM90_ACC128                                                           \
               : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)))
  KMLA_SM90_DISPATCH(KMLA_SM90_MMA)
#undef KMLA_SM90_MMA
}

// d (64 x 128 fp32) = (accumulate ? d : 0) + A (64 x 16 in registers: each warp's 16 rows as
// the mma.sync m16n8k16 A fragment) x B (16 x 128 through desc_b, MN-major when kTransB).
template <class T, bool kTransB>
__device__ __forceinline__ void wgmma_rs_m64n128k16(float (&d)[64], const uint32_t (&a)[4],
                                                    uint64_t desc_b, bool accumulate) {
#define KMLA_SM90_MMA(TY, TB)                                                             \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"                             \
               " wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " KMLA_SM90_REGS64 \
               ", {%64, %65, %66, %67}, %68, p, 1, 1, " TB ";\n}\n"                       \
               : KMLA_SM90_ACC64                                                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b),                 \
                 "r"(int(accumulate)))
  KMLA_SM90_DISPATCH(KMLA_SM90_MMA)
#undef KMLA_SM90_MMA
}

// d (64 x N fp32, N = 16 or 32) = (accumulate ? d : 0) + A (64 x 16 through desc_a: MN-major
// when kTransA, else K-major) x B (16 x N, K-major, through desc_b): the thin tiles' S^T = K Q^T
// (A the key tile) and O^T = V^T P^T (A the V panel read transposed).
template <class T, int N, bool kTransA>
__device__ __forceinline__ void wgmma_ss_thin(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                              bool accumulate) {
  static_assert(N == 16 || N == 32, "thin tiles are 16 or 32 rows");
  constexpr bool kTransB = kTransA;  // KMLA_SM90_DISPATCH's switch: here it picks A's form
#define KMLA_SM90_MMA(TY, TA)                                                           \
  do {                                                                                  \
    if constexpr (N == 16)                                                              \
      asm volatile(                                                                     \
          "{\n .reg .pred p;\n setp.ne.b32 p, %10, 0;\n"                                \
          " wgmma.mma_async.sync.aligned.m64n16k16.f32." TY "." TY                      \
          " {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, " TA ", 0;\n}\n"         \
          : KMLA_SM90_ACC8(0)                                                           \
          : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)));                            \
    else                                                                                \
      asm volatile(                                                                     \
          "{\n .reg .pred p;\n setp.ne.b32 p, %18, 0;\n"                                \
          " wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " " KMLA_SM90_REGS16 \
          ", %16, %17, p, 1, 1, " TA ", 0;\n}\n"                                        \
          : KMLA_SM90_ACC16                                                             \
          : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)));                            \
  } while (0)
  KMLA_SM90_DISPATCH(KMLA_SM90_MMA)
#undef KMLA_SM90_MMA
}

#undef KMLA_SM90_DISPATCH
#undef KMLA_SM90_ACC128
#undef KMLA_SM90_ACC64
#undef KMLA_SM90_ACC32
#undef KMLA_SM90_ACC16
#undef KMLA_SM90_ACC8
#undef KMLA_SM90_REGS128
#undef KMLA_SM90_REGS64
#undef KMLA_SM90_REGS32
#undef KMLA_SM90_REGS16

#endif  // KMLA_SM90A

}  // namespace kmla::cuda::sm90
