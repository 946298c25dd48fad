// kmla_wgmma_rate: how fast the tensor pipe runs the wgmma decode kernel's MMA shapes
// (src/cuda/decode_sm90.cu), alone and side by side, with nothing else in the loop.
//
//   build/kmla_wgmma_rate        # Hopper only; prints one line per mode
//
// One CTA of two warpgroups on every SM. Shared memory holds the kernel's operands in its
// layout (64-column panels of 128-byte-swizzled rows): Q (64 rows x 576), two key stages (64
// keys x 576 each, the same bytes) and the P panel (64 x 64), filled with random finite bf16.
// Each warpgroup runs its own loop of one operation (issue, commit, wait), so no wgmma sits on
// a path that diverges between the warpgroups. Per warpgroup: cycles per iteration from
// clock64; over the grid: TFLOP/s from %globaltimer and the SM clock those two imply. "ideal"
// is the cycles the iteration's MMAs take at 2,048 bf16 FMA per clock per SM (the dense rate
// H100 / H200 data sheets give: ~990 TFLOP/s at 1.83 GHz on 132 SMs); "of it" above 100 %
// means faster than that rate, which the hardware is not specified to reach.
//
// The S modes also check their result: warpgroup 0 of CTA 0 writes its S accumulators after
// the last iteration, and the host compares them with S computed in fp64 from the same bytes
// (the line ends "S ok" or "S WRONG" with the largest error relative to the sum of the
// products' magnitudes), so a rate from MMAs that did not compute S is not taken for one.
// "S, stage by iteration": the kernel's form of S, where the key tile's address changes with
// the stage (tile parity) and the loop count is not a compile-time constant: the descriptors
// depend on the iteration, as in the kernel (whose SASS moves each one from an ordinary
// register to a uniform one, `R2UR`, before its wgmma).
// The first run (2026-12-08, H100) read S alone at 695 cycles, 1.66x the dense rate, while
// the kernel's own clock stamps put its S at ~1,240 (docs/decode_sm90.md, "Where a tile's
// cycles go, by clock stamps"): these two modes say which is the tensor pipe's rate.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/sm90.cuh"
#include "kmla/numeric.hpp"

namespace kmla::cuda::sm90 {
namespace {

constexpr int kPanel = 8192;                    // 64 rows x 128 bytes
constexpr int kPanels = 28;                     // Q 9, key stage 0 9, P 1, key stage 1 9
constexpr int kSmem = kPanels * kPanel + 1024;  // + alignment slack
constexpr int kIters = 2000;
constexpr int kQ = 0, kK = 9 * kPanel, kK1 = 19 * kPanel;  // byte offsets of Q and the stages
[[maybe_unused]] constexpr int kP = 18 * kPanel;           // of P (device code only)

// Word i (4 bytes from the aligned shared-memory base) of the operands: two bf16 with random
// sign and 7-bit mantissa, exponents 2^-8 .. 2^-1. Key stage 1 repeats stage 0's words.
__host__ __device__ constexpr uint32_t operand_word(uint32_t i) {
  if (i >= uint32_t(kK1 / 4)) i -= uint32_t((kK1 - kK) / 4);
  uint32_t h = i * 2654435761u;
  h ^= h >> 13;
  h *= 0x5bd1e995u;
  h ^= h >> 15;
  return (h & 0x807f807fu) | ((0x77u + (h >> 8 & 7u)) << 7) | ((0x77u + (h >> 24 & 7u)) << 23);
}

// What one warpgroup runs per iteration. S: the kernel's wide S, 36 x m64n64k16 over the 9
// panels, Q and K K-major. P V: the kernel's half, 64 rows x 256 columns over 64 keys, as
// 4 x m64n256k16 with V read MN-major (kPv), or K-major as if V were stored transposed (kPvK),
// or as 16 x m64n64k16 / 8 x m64n128k16 (P from shared memory or from registers).
enum class Op { kNone, kS, kSStaged, kPv, kPvK, kPv64, kPv128, kPv128Regs };

constexpr bool is_s(Op op) { return op == Op::kS || op == Op::kSStaged; }
constexpr double fma_of(Op op) {
  return op == Op::kNone ? 0.0 : is_s(op) ? 36.0 * 64 * 64 * 16 : 4.0 * 64 * 256 * 16;
}

#if KMLA_SM90A

__device__ __forceinline__ uint64_t v_desc(uint32_t base, int panel, int k) {
  return desc_mn_major(base + kK + panel * kPanel + k * 16 * kPanelRowBytes, kPanel);
}

// kt: the key tile's shared-memory address (stage 0's, or by iteration for kSStaged).
template <Op kOp>
__device__ __forceinline__ void issue(float (&acc)[128], uint32_t base, uint32_t kt, int first,
                                      const uint32_t (&pa)[4][4]) {
  if constexpr (is_s(kOp)) {
    float(&s)[32] = *reinterpret_cast<float(*)[32]>(&acc[0]);
#pragma unroll
    for (int k = 0; k < 36; ++k) {
      const uint32_t off = (k / 4) * kPanel + (k % 4) * 32;
      wgmma_ss_m64n64k16<bf16, false>(s, desc_k_major(base + kQ + off), desc_k_major(kt + off),
                                      k > 0);
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

// iters: kIters, read from global memory (kSStaged: a loop count the compiler cannot see).
template <Op kOp>
__device__ __forceinline__ void run_loop(float (&acc)[128], uint32_t base, int first,
                                         const uint32_t (&pa)[4][4], const int* iters) {
  const int n = kOp == Op::kSStaged ? *iters : kIters;
  for (int it = 0; it < n; ++it) {
    const uint32_t kt = base + (kOp == Op::kSStaged && (it & 1) ? kK1 : kK);
    wgmma_fence();
    issue<kOp>(acc, base, kt, first, pa);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(acc);
  }
}
#endif

// out[4 * cta + 2 * wg] = clock64 cycles of warpgroup wg's loop, [.. + 1] its nanoseconds;
// s_out[32 * thread + i]: S accumulator i of thread 0-127 of CTA 0 (S modes on warpgroup 0).
template <Op kOp0, Op kOp1>
__global__ void __launch_bounds__(256, 1)
    rate_kernel(long long* out, float* sink, float* s_out, const int* iters) {
#if KMLA_SM90A
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw), base = (raw + 1023u) & ~1023u;
  uint32_t* const words = reinterpret_cast<uint32_t*>(smem_raw + (base - raw));
  for (int i = threadIdx.x; i < kPanels * kPanel / 4; i += 256) words[i] = operand_word(i);
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
    run_loop<kOp0>(acc, base, 0, pa, iters);
  else
    run_loop<kOp1>(acc, base, 4, pa, iters);
  const long long c1 = clock64();
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns1));
  float sum = 0.0f;
  for (float v : acc) sum += v;
  if (sum == 1234.5f) sink[threadIdx.x] = sum;  // keeps the MMAs
  if (is_s(kOp0) && blockIdx.x == 0 && wg == 0)
    for (int i = 0; i < 32; ++i) s_out[32 * threadIdx.x + i] = acc[i];
  if (threadIdx.x % 128 == 0) {
    out[4 * blockIdx.x + 2 * wg] = c1 - c0;
    out[4 * blockIdx.x + 2 * wg + 1] = static_cast<long long>(ns1 - ns0);
  }
#else
  (void)out, (void)sink, (void)s_out, (void)iters;
#endif
}

// The operand element at byte `region` + (row, column d) of the panel layout, as a double.
double operand(int region, int row, int d) {
  const uint32_t byte =
      uint32_t(region + (d / 64) * kPanel) + swizzle128(row, d % 64 / 8) + uint32_t(d % 8 * 2);
  const uint32_t w = operand_word(byte / 4);
  return bf16_to_float(uint16_t(byte % 4 ? w >> 16 : w));
}

// The largest |S - Q K^T| over the 64 x 64 tile, relative to the sum of the products'
// magnitudes of its entry; got: the accumulators of threads 0-127 in the m64nN layout.
double s_error(const std::vector<float>& got) {
  double worst = 0.0;
  for (int tid = 0; tid < 128; ++tid)
    for (int i = 0; i < 32; ++i) {
      const int lane = tid % 32, row = 16 * (tid / 32) + lane / 4 + (i % 4 >= 2 ? 8 : 0);
      const int key = 8 * (i / 4) + 2 * (lane % 4) + i % 2;
      double ref = 0.0, mag = 0.0;
      for (int d = 0; d < 576; ++d) {
        const double x = operand(kQ, row, d) * operand(kK, key, d);
        ref += x;
        mag += std::fabs(x);
      }
      worst = std::max(worst, std::fabs(double(got[32 * tid + i]) - ref) / mag);
    }
  return worst;
}

struct Buffers {
  long long* out;
  float* sink;
  float* s_out;
  int* iters;
};

template <Op kOp0, Op kOp1>
void run_mode(const char* name, int sms, const Buffers& b) {
  auto kernel = rate_kernel<kOp0, kOp1>;
  KMLA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  for (int run = 0; run < 2; ++run) {  // the first run warms up
    kernel<<<sms, 256, kSmem>>>(b.out, b.sink, b.s_out, b.iters);
    KMLA_LAUNCH_CHECK();
  }
  KMLA_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<long long> v(4 * size_t(sms));
  KMLA_CUDA_CHECK(
      cudaMemcpy(v.data(), b.out, v.size() * sizeof(long long), cudaMemcpyDeviceToHost));
  double cyc[2] = {0, 0}, ns = 0;
  for (int c = 0; c < sms; ++c) {
    for (int w = 0; w < 2; ++w) cyc[w] += double(v[4 * c + 2 * w]) / (double(sms) * kIters);
    ns = std::max({ns, double(v[4 * c + 1]), double(v[4 * c + 3])});
  }
  const double fma = fma_of(kOp0) + fma_of(kOp1), slow = std::max(cyc[0], cyc[1]);
  const double ideal = fma / 2048.0;
  std::printf("%-46s %8.1f %8.1f %8.1f %6.1f %% %8.1f  %5.3f", name, cyc[0], cyc[1], ideal,
              100.0 * ideal / slow, 2.0 * fma * sms * kIters / ns * 1e-3, slow * kIters / ns);
  if (is_s(kOp0)) {
    // fp32 accumulation of 576 exact products: a relative error near 2^-23 * 576 ~ 7e-5 at
    // worst; an MMA that read the wrong operands (or none) is off by O(1).
    std::vector<float> got(128 * 32);
    KMLA_CUDA_CHECK(
        cudaMemcpy(got.data(), b.s_out, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
    const double err = s_error(got);
    std::printf("  S %s (%.1e)", err < 1e-3 ? "ok" : "WRONG", err);
  }
  std::printf("\n");
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
    Buffers b{};
    KMLA_CUDA_CHECK(cudaMalloc(&b.out, 4 * size_t(sms) * sizeof(long long)));
    KMLA_CUDA_CHECK(cudaMalloc(&b.sink, 256 * sizeof(float)));
    KMLA_CUDA_CHECK(cudaMalloc(&b.s_out, 128 * 32 * sizeof(float)));
    KMLA_CUDA_CHECK(cudaMalloc(&b.iters, sizeof(int)));
    KMLA_CUDA_CHECK(cudaMemcpy(b.iters, &kIters, sizeof(int), cudaMemcpyHostToDevice));
    std::printf("%-46s %8s %8s %8s %8s %8s  %5s\n", "warpgroup 0 | warpgroup 1", "wg0 cyc",
                "wg1 cyc", "ideal", "of it", "TFLOP/s", "GHz");
    run_mode<Op::kS, Op::kNone>("S | -", sms, b);
    run_mode<Op::kSStaged, Op::kNone>("S, stage by iteration | -", sms, b);
    run_mode<Op::kS, Op::kS>("S | S", sms, b);
    run_mode<Op::kPv, Op::kNone>("P V (V MN-major) | -", sms, b);
    run_mode<Op::kPv, Op::kPv>("P V (V MN-major) | P V", sms, b);
    run_mode<Op::kPvK, Op::kPvK>("P V (V K-major) | P V (V K-major)", sms, b);
    run_mode<Op::kPv64, Op::kPv64>("P V as 16 x n64 | the same", sms, b);
    run_mode<Op::kPv128, Op::kPv128>("P V as 8 x n128 | the same", sms, b);
    run_mode<Op::kPv128Regs, Op::kPv128Regs>("P V as 8 x n128, P in registers | the same", sms, b);
    run_mode<Op::kS, Op::kPv>("S | P V", sms, b);
    std::printf("(%d SMs, one CTA each, %d iterations; cycles per iteration)\n", sms, kIters);
    KMLA_CUDA_CHECK(cudaFree(b.out));
    KMLA_CUDA_CHECK(cudaFree(b.sink));
    KMLA_CUDA_CHECK(cudaFree(b.s_out));
    KMLA_CUDA_CHECK(cudaFree(b.iters));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kmla_wgmma_rate: %s\n", e.what());
    return 1;
  }
  return 0;
}
