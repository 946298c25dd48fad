// kmla_wgmma_rate: how fast the tensor pipe runs the wgmma decode kernel's MMA shapes
// (src/cuda/decode_sm90.cu), alone and side by side, with nothing else in the loop.
//
//   build/kmla_wgmma_rate        # Hopper only; prints one line per mode
//
// One CTA of two warpgroups on every SM. Shared memory holds the kernel's operands in its
// layout (64-column panels of 128-byte-swizzled rows): Q (64 rows x 576), one key tile (64
// keys x 576) and the P panel (64 x 64), filled with random finite bf16. Each warpgroup runs
// its own loop of one operation (issue, commit, wait), so no wgmma sits on a path that diverges
// between the warpgroups. Per warpgroup: cycles per iteration from clock64; over the grid:
// TFLOP/s from %globaltimer and the SM clock those two imply. "ideal" is the cycles the
// iteration's MMAs take at 2,048 bf16 FMA per clock per SM (the dense rate H100 / H200 data
// sheets give: ~990 TFLOP/s at 1.83 GHz on 132 SMs). docs/PERF.md (2026-12-08) has a run.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/sm90.cuh"

namespace kmla::cuda::sm90 {
namespace {

constexpr int kPanel = 8192;               // 64 rows x 128 bytes
constexpr int kSmem = 19 * kPanel + 1024;  // + alignment slack
constexpr int kIters = 2000;

// What one warpgroup runs per iteration. S: the kernel's wide S, 36 x m64n64k16 over the 9
// panels, Q and K K-major. P V: the kernel's half, 64 rows x 256 columns over 64 keys, as
// 4 x m64n256k16 with V read MN-major (kPv), or K-major as if V were stored transposed (kPvK),
// or as 16 x m64n64k16 / 8 x m64n128k16 (P from shared memory or from registers).
enum class Op { kNone, kS, kPv, kPvK, kPv64, kPv128, kPv128Regs };

constexpr double fma_of(Op op) {
  return op == Op::kNone ? 0.0 : op == Op::kS ? 36.0 * 64 * 64 * 16 : 4.0 * 64 * 256 * 16;
}

#if KMLA_SM90A
constexpr int kQ = 0, kK = 9 * kPanel, kP = 18 * kPanel;  // byte offsets of Q, the tile, P

__device__ __forceinline__ uint64_t v_desc(uint32_t base, int panel, int k) {
  return desc_mn_major(base + kK + panel * kPanel + k * 16 * kPanelRowBytes, kPanel);
}

template <Op kOp>
__device__ __forceinline__ void issue(float (&acc)[128], uint32_t base, int first,
                                      const uint32_t (&pa)[4][4]) {
  if constexpr (kOp == Op::kS) {
    float(&s)[32] = *reinterpret_cast<float(*)[32]>(&acc[0]);
#pragma unroll
    for (int k = 0; k < 36; ++k) {
      const uint32_t off = (k / 4) * kPanel + (k % 4) * 32;
      wgmma_ss_m64n64k16<bf16, false>(s, desc_k_major(base + kQ + off),
                                      desc_k_major(base + kK + off), k > 0);
    }
  } else if constexpr (kOp == Op::kPv || kOp == Op::kPvK) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint64_t a = desc_k_major(base + kP + k * 32);
      if constexpr (kOp == Op::kPv)
        wgmma_ss_m64n256k16<bf16, true>(acc, a, v_desc(base, first, k), true);
      else  // 256 rows of 64 keys (32 KB from the tile's panel `first` on), K-major
        wgmma_ss_m64n256k16<bf16, false>(acc, a, desc_k_major(base + kK + first * kPanel + k * 32),
                                         true);
    }
  } else if constexpr (kOp != Op::kNone) {  // P V in column blocks of 64 or 128 columns
    constexpr int kN = kOp == Op::kPv64 ? 64 : 128, kBlocks = 256 / kN;
    float(&o)[kBlocks][kN / 2] = *reinterpret_cast<float(*)[kBlocks][kN / 2]>(&acc[0]);
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
      for (int n = 0; n < kBlocks; ++n) {
        const uint64_t a = desc_k_major(base + kP + k * 32),
                       b = v_desc(base, first + n * kN / 64, k);
        if constexpr (kOp == Op::kPv64)
          wgmma_ss_m64n64k16<bf16, true>(o[n], a, b, true);
        else if constexpr (kOp == Op::kPv128)
          wgmma_ss_m64n128k16<bf16, true>(o[n], a, b, true);
        else
          wgmma_rs_m64n128k16<bf16, true>(o[n], pa[k], b, true);
      }
  }
}

template <Op kOp>
__device__ __forceinline__ void run_loop(float (&acc)[128], uint32_t base, int first,
                                         const uint32_t (&pa)[4][4]) {
  for (int it = 0; it < kIters; ++it) {
    wgmma_fence();
    issue<kOp>(acc, base, first, pa);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(acc);
  }
}
#endif

// out[4 * cta + 2 * wg] = clock64 cycles of warpgroup wg's loop, [.. + 1] its nanoseconds.
template <Op kOp0, Op kOp1>
__global__ void __launch_bounds__(256, 1) rate_kernel(long long* out, float* sink) {
#if KMLA_SM90A
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw), base = (raw + 1023u) & ~1023u;
  uint32_t* const words = reinterpret_cast<uint32_t*>(smem_raw + (base - raw));
  for (int i = threadIdx.x; i < 19 * kPanel / 4; i += 256) {
    uint32_t h = uint32_t(i) * 2654435761u;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    // Two bf16: random sign and 7-bit mantissa, exponents 2^-8 .. 2^-1.
    words[i] =
        (h & 0x807f807fu) | ((0x77u + (h >> 8 & 7u)) << 7) | ((0x77u + (h >> 24 & 7u)) << 23);
  }
  fence_proxy_async();
  __syncthreads();
  const int wg = threadIdx.x / 128;
  uint32_t pa[4][4];  // P as register A fragments (Op::kPv128Regs)
  for (int k = 0; k < 4; ++k)
    for (int j = 0; j < 4; ++j) pa[k][j] = 0x3c003c00u ^ (threadIdx.x * 77u + k * 5u + j);
  float acc[128] = {};
  unsigned long long ns0, ns1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns0));
  const long long c0 = clock64();
  if (wg == 0)
    run_loop<kOp0>(acc, base, 0, pa);
  else
    run_loop<kOp1>(acc, base, 4, pa);
  const long long c1 = clock64();
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns1));
  float sum = 0.0f;
  for (float v : acc) sum += v;
  if (sum == 1234.5f) sink[threadIdx.x] = sum;  // keeps the MMAs
  if (threadIdx.x % 128 == 0) {
    out[4 * blockIdx.x + 2 * wg] = c1 - c0;
    out[4 * blockIdx.x + 2 * wg + 1] = static_cast<long long>(ns1 - ns0);
  }
#else
  (void)out, (void)sink;
#endif
}

template <Op kOp0, Op kOp1>
void run_mode(const char* name, int sms, long long* d_out, float* sink) {
  auto kernel = rate_kernel<kOp0, kOp1>;
  KMLA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  for (int run = 0; run < 2; ++run) {  // the first run warms up
    kernel<<<sms, 256, kSmem>>>(d_out, sink);
    KMLA_LAUNCH_CHECK();
  }
  KMLA_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<long long> v(4 * size_t(sms));
  KMLA_CUDA_CHECK(
      cudaMemcpy(v.data(), d_out, v.size() * sizeof(long long), cudaMemcpyDeviceToHost));
  double cyc[2] = {0, 0}, ns = 0;
  for (int c = 0; c < sms; ++c) {
    for (int w = 0; w < 2; ++w) cyc[w] += double(v[4 * c + 2 * w]) / (double(sms) * kIters);
    ns = std::max({ns, double(v[4 * c + 1]), double(v[4 * c + 3])});
  }
  const double fma = fma_of(kOp0) + fma_of(kOp1), slow = std::max(cyc[0], cyc[1]);
  const double ideal = fma / 2048.0;
  std::printf("%-46s %8.1f %8.1f %8.1f %6.1f %% %8.1f  %5.3f\n", name, cyc[0], cyc[1], ideal,
              100.0 * ideal / slow, 2.0 * fma * sms * kIters / ns * 1e-3, slow * kIters / ns);
}

}  // namespace
}  // namespace kmla::cuda::sm90

int main() {
  using namespace kmla::cuda::sm90;
  try {
    int dev = 0, major = 0, sms = 0;
    KMLA_CUDA_CHECK(cudaGetDevice(&dev));
    KMLA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    KMLA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    if (major != 9) {
      std::fprintf(stderr, "kmla_wgmma_rate: needs a Hopper GPU (sm_90), found sm_%d0\n", major);
      return 2;
    }
    long long* d_out = nullptr;
    float* sink = nullptr;
    KMLA_CUDA_CHECK(cudaMalloc(&d_out, 4 * size_t(sms) * sizeof(long long)));
    KMLA_CUDA_CHECK(cudaMalloc(&sink, 256 * sizeof(float)));
    std::printf("%-46s %8s %8s %8s %8s %8s  %5s\n", "warpgroup 0 | warpgroup 1", "wg0 cyc",
                "wg1 cyc", "ideal", "of it", "TFLOP/s", "GHz");
    run_mode<Op::kS, Op::kNone>("S | -", sms, d_out, sink);
    run_mode<Op::kS, Op::kS>("S | S", sms, d_out, sink);
    run_mode<Op::kPv, Op::kNone>("P V (V MN-major) | -", sms, d_out, sink);
    run_mode<Op::kPv, Op::kPv>("P V (V MN-major) | P V", sms, d_out, sink);
    run_mode<Op::kPvK, Op::kPvK>("P V (V K-major) | P V (V K-major)", sms, d_out, sink);
    run_mode<Op::kPv64, Op::kPv64>("P V as 16 x n64 | the same", sms, d_out, sink);
    run_mode<Op::kPv128, Op::kPv128>("P V as 8 x n128 | the same", sms, d_out, sink);
    run_mode<Op::kPv128Regs, Op::kPv128Regs>("P V as 8 x n128, P in registers | the same", sms,
                                             d_out, sink);
    run_mode<Op::kS, Op::kPv>("S | P V", sms, d_out, sink);
    std::printf("(%d SMs, one CTA each, %d iterations; cycles per iteration)\n", sms, kIters);
    KMLA_CUDA_CHECK(cudaFree(d_out));
    KMLA_CUDA_CHECK(cudaFree(sink));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kmla_wgmma_rate: %s\n", e.what());
    return 1;
  }
  return 0;
}
