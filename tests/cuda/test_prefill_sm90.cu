// Building blocks of the Hopper prefill kernel (prefill_sm90.cu), checked on their own so a
// wrong descriptor, swizzle or fragment layout shows up here with row/column coordinates
// rather than as a wrong attention output: prefill_sm90_probe runs the kernel's copy path
// into 128-byte-swizzled panels, S = A K^T by smem-descriptor wgmma (K-major A and B), and
// O = round(S) V by register-A wgmma with the MN-major V descriptor. The whole kernel is
// tested against the CPU reference in test_prefill.cu.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <vector>

#include "core/random.hpp"
#include "cuda/attention.cuh"
#include "cuda/gpu.hpp"
#include "cuda/prefill_attention.cuh"
#include "kmla/numeric.hpp"

namespace kmla {
namespace {

using test::DevBuf;

bool on_sm90() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess)
    return false;
  return major == 9;
}

float act_value(uint16_t code, DType act) {
  return act == DType::bf16 ? bf16_to_float(code) : fp16_to_float(code);
}
uint16_t act_code(float x, DType act) {
  return act == DType::bf16 ? float_to_bf16(x) : float_to_fp16(x);
}

void run_probe(DType act, int pattern, uint64_t seed) {
  SCOPED_TRACE(std::string(dtype_name(act)) + " pattern " + std::to_string(pattern));
  constexpr int kM = 64, kN = 128, kK = 192, kV = 128;
  Random rng(seed);
  // pattern 0: Gaussian values. pattern 1: a one-hot (row i of a selects dim (5i) % 192 with
  // weight i + 1) so S[i][j] = (i + 1) k[j][(5i) % 192], which names the dim the MMA read for
  // each (row, key); O then only tests the V path.
  std::vector<uint16_t> a(kM * kK), k(kN * kK), v(kN * kV);
  for (int i = 0; i < kM; ++i)
    for (int d = 0; d < kK; ++d)
      a[i * kK + d] = pattern == 0 ? act_code(float(rng.normal()), act)
                                   : act_code(d == (5 * i) % kK ? float(i + 1) : 0.f, act);
  for (auto& x : k) x = act_code(float(rng.normal()), act);
  for (auto& x : v) x = act_code(float(rng.normal()), act);

  DevBuf<uint16_t> d_a(a), d_k(k), d_v(v);
  DevBuf<float> d_s(kM * kN), d_o(kM * kV);
  d_s.fill_bytes(0xFF);
  d_o.fill_bytes(0xFF);
  cuda::prefill_sm90_probe(act, d_a.ptr, d_k.ptr, d_v.ptr, d_s.ptr, d_o.ptr, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> s = d_s.download(), o = d_o.download();

  int bad = 0;
  auto report = [&](const std::string& m) {
    if (++bad <= 10) ADD_FAILURE() << m;
  };
  for (int i = 0; i < kM; ++i)
    for (int j = 0; j < kN; ++j) {
      double want = 0, mag = 0;
      for (int d = 0; d < kK; ++d) {
        const double x = double(act_value(a[i * kK + d], act)) * act_value(k[j * kK + d], act);
        want += x;
        mag += std::fabs(x);
      }
      // Products of two act values are exact in fp32; only the fp32 accumulation of 192 terms
      // rounds: |error| <= 192 * 2^-24 * sum |a k| < 2e-5 * mag.
      const double tol = 2e-5 * mag + 1e-6;
      const float got = s[i * kN + j];
      if (!(std::fabs(got - want) <= tol)) {
        std::ostringstream m;
        m << "S[" << i << "][" << j << "] got " << got << " want " << want;
        report(m.str());
      }
    }
  EXPECT_EQ(bad, 0) << "S = A K^T mismatches (smem descriptors / swizzle / accumulator layout)";
  bad = 0;
  for (int i = 0; i < kM; ++i)
    for (int d = 0; d < kV; ++d) {
      double want = 0, mag = 0;
      for (int j = 0; j < kN; ++j) {
        // P is the kernel's own S rounded to act (so an S error does not show up twice).
        const double x =
            double(act_value(act_code(s[i * kN + j], act), act)) * act_value(v[j * kV + d], act);
        want += x;
        mag += std::fabs(x);
      }
      // Exact products in fp32, 128 fp32 additions: < 2e-5 * mag (f16 P may be subnormal-free
      // here: |S| >= 2^-14 or exactly representable).
      const double tol = 2e-5 * mag + 1e-6;
      const float got = o[i * kV + d];
      if (!(std::fabs(got - want) <= tol)) {
        std::ostringstream m;
        m << "O[" << i << "][" << d << "] got " << got << " want " << want;
        report(m.str());
      }
    }
  EXPECT_EQ(bad, 0) << "O = P V mismatches (register A fragment / MN-major V descriptor)";
  if (bad > 0) {
    // Diagnostic for the one layout choice the PTX text leaves most room to misread: does the
    // V descriptor with its two byte offsets exchanged give the right O?
    d_o.fill_bytes(0xFF);
    cuda::prefill_sm90_probe(act, d_a.ptr, d_k.ptr, d_v.ptr, d_s.ptr, d_o.ptr, nullptr, true);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> o2 = d_o.download();
    double worst = 0;
    for (int i = 0; i < kM; ++i)
      for (int d = 0; d < kV; ++d) {
        double want = 0;
        for (int j = 0; j < kN; ++j)
          want +=
              double(act_value(act_code(s[i * kN + j], act), act)) * act_value(v[j * kV + d], act);
        worst = std::max(worst, std::fabs(o2[i * kV + d] - want) / (std::fabs(want) + 1.0));
      }
    std::printf(
        "diagnostic: with the V descriptor's byte offsets swapped, worst relative O "
        "error %g (%s)\n",
        worst, worst < 1e-3 ? "swapping fixes it" : "swapping does not fix it");
  }
}

TEST(CudaPrefillSm90, WgmmaBuildingBlocks) {
  KMLA_REQUIRE_GPU();
  if (!on_sm90()) GTEST_SKIP() << "not an sm_90 GPU";
  uint64_t seed = 300;
  for (DType act : {DType::bf16, DType::f16})
    for (int pattern : {1, 0}) run_probe(act, pattern, ++seed);
}

// prefill_attention_sm90 refuses other GPUs instead of launching a kernel without a body.
TEST(CudaPrefillSm90, RefusesOtherGpus) {
  KMLA_REQUIRE_GPU();
  if (on_sm90()) GTEST_SKIP() << "an sm_90 GPU";
  cuda::PrefillParams p;
  EXPECT_FALSE(cuda::prefill_sm90_supported(p));
  EXPECT_FALSE(cuda::prefill_uses_sm90(p));
}

}  // namespace
}  // namespace kmla
