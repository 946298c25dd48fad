// The projection GEMMs of the CUDA backend (src/cuda/gemm.cu) against fp64 host references:
// 16-bit linear and the strided-batched absorbed products through cuBLASLt, the fp8 activation
// quantizer bit for bit against the CPU rule, and the W8A8 GEMM on both of its paths (cuBLASLt
// block scaling on sm_90, the fallback kernel everywhere else). Outputs are poisoned with 0xFF
// (NaN in bf16/f16) before every call, so unwritten elements fail and padding must stay poisoned.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/gemm.cuh"
#include "cuda/gpu.hpp"
#include "kmla/numeric.hpp"
#include "kmla/weights.hpp"

namespace kmla::cuda {
namespace {

using test::DevBuf;
constexpr uint16_t kPoison16 = 0xFFFF;

uint16_t act_bits(float x, DType act) {
  return act == DType::bf16 ? float_to_bf16(x) : float_to_fp16(x);
}
float act_float(uint16_t b, DType act) {
  return act == DType::bf16 ? bf16_to_float(b) : fp16_to_float(b);
}

// Uniform values in [-scale, scale], rounded to act.
std::vector<uint16_t> random_act(size_t n, DType act, std::mt19937& rng, float scale = 1.0f) {
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = act_bits(u(rng), act);
  return v;
}

// Bound on |gpu - ref| for one output: fp32 accumulation then one rounding to act. The rounded
// result is within half an act ulp of the fp32 sum (2^-9 bf16, 2^-12 f16 relative), which is
// within ~sqrt(K) * 2^-24 * sum|terms| of the exact sum (K <= 1536 here, < 3e-6; the bound
// allows 1e-5 for a different accumulation order). One full ulp of |ref| covers a rounding that
// flips because of the fp32 error. A layout or scale bug is off by O(|ref|).
constexpr double kFp32SumError = 1e-5;
// Hopper's fp8 MMA adds the products of each instruction in a narrower fixed-point accumulator
// (about 14 bits, per the DeepSeek-V3 report) before cuBLASLt promotes every 128-group to fp32
// and scales it: allow 2^-12 of sum |terms| on that path. Still ~100x below a wrong scale.
constexpr double kFp8MmaSumError = 0x1p-12;

double tolerance(double ref, double abs_sum, DType act, double sum_error = kFp32SumError) {
  const double ulp = act == DType::bf16 ? 0x1p-8 : 0x1p-11;
  const double tiny = act == DType::bf16 ? 0.0 : 0x1p-24;  // f16 subnormal spacing
  return ulp * std::fabs(ref) + sum_error * abs_sum + tiny;
}

// Checks C[m, n] (row stride ldc) against ref/abs_sum ([M, N] dense) and that the columns
// [N, ldc) of every row were left poisoned. Reports at most a few mismatches.
void expect_close(const std::vector<uint16_t>& C, int64_t M, int64_t N, int64_t ldc,
                  const std::vector<double>& ref, const std::vector<double>& abs_sum, DType act,
                  const char* what, double sum_error = kFp32SumError) {
  int bad = 0;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < ldc; ++n) {
      const uint16_t bits = C[m * ldc + n];
      if (n >= N) {
        if (bits != kPoison16 && ++bad <= 5)
          ADD_FAILURE() << what << ": padding (" << m << ", " << n << ") was written";
        continue;
      }
      const double got = act_float(bits, act), want = ref[m * N + n];
      const double tol = tolerance(want, abs_sum[m * N + n], act, sum_error);
      if (!(std::fabs(got - want) <= tol) && ++bad <= 5)
        ADD_FAILURE() << what << ": C(" << m << ", " << n << ") = " << got << ", want " << want
                      << " +- " << tol;
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " bad elements";
}

// ---- linear ------------------------------------------------------------------------------

// C = A . W^T with A at row stride lda starting `a_offset` elements into its buffer (an odd
// offset makes A only 2-byte aligned). in_graph: the call is captured on a stream of its own
// (thread-local mode) and the graph replayed once.
void check_linear(Blas& blas, DType act, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldc,
                  int64_t a_offset, uint32_t seed, bool in_graph = false) {
  SCOPED_TRACE(testing::Message() << dtype_name(act) << " M=" << M << " N=" << N << " K=" << K
                                  << " lda=" << lda << " ldc=" << ldc << " a_offset=" << a_offset
                                  << (in_graph ? " in a graph" : ""));
  std::mt19937 rng(seed);
  const auto a = random_act(size_t(a_offset + M * lda), act, rng);
  const auto w = random_act(size_t(N * K), act, rng);
  DevBuf<uint16_t> da(a), dw(w), dc(size_t(std::max<int64_t>(M, 1) * ldc));
  dc.fill_bytes(0xFF);
  if (in_graph) {
    cudaStream_t stream = nullptr;
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    blas.linear(M, N, K, da.ptr + a_offset, lda, dw.ptr, dc.ptr, ldc, act, stream);
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  } else {
    blas.linear(M, N, K, da.ptr + a_offset, lda, dw.ptr, dc.ptr, ldc, act, nullptr);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto c = dc.download();
  if (M == 0) {
    for (uint16_t bits : c) ASSERT_EQ(bits, kPoison16) << "M == 0 must write nothing";
    return;
  }
  std::vector<double> ref(size_t(M * N)), abs_sum(size_t(M * N));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0.0, sa = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double p =
            double(act_float(a[a_offset + m * lda + k], act)) * act_float(w[n * K + k], act);
        s += p;
        sa += std::fabs(p);
      }
      ref[m * N + n] = s;
      abs_sum[m * N + n] = sa;
    }
  expect_close(c, M, N, ldc, ref, abs_sum, act, "linear");
}

TEST(CudaGemm, LinearBf16) {
  KMLA_REQUIRE_GPU();
  Blas blas;
  check_linear(blas, DType::bf16, 1, 2112, 1024, 1024, 2112, 0, 1);  // decode front end shape
  check_linear(blas, DType::bf16, 3, 576, 1536, 1600, 600, 0, 2);    // non-dense lda, ldc
  check_linear(blas, DType::bf16, 129, 320, 1024, 1032, 328, 0, 3);  // odd M past a tile
  check_linear(blas, DType::bf16, 5, 40, 72, 75, 41, 1, 4);          // 2-byte aligned A and C rows
  check_linear(blas, DType::bf16, 0, 64, 128, 128, 64, 0, 5);        // M == 0: a no-op
}

TEST(CudaGemm, LinearF16) {
  KMLA_REQUIRE_GPU();
  Blas blas;
  check_linear(blas, DType::f16, 1, 2112, 1024, 1024, 2112, 0, 11);
  check_linear(blas, DType::f16, 3, 576, 1536, 1600, 600, 0, 12);
  check_linear(blas, DType::f16, 129, 320, 1024, 1032, 328, 0, 13);
  check_linear(blas, DType::f16, 5, 40, 72, 75, 41, 1, 14);
}

TEST(CudaGemm, LinearRejectsBadShapes) {
  KMLA_REQUIRE_GPU();
  Blas blas;
  EXPECT_THROW(blas.linear(2, 8, 16, nullptr, 8, nullptr, nullptr, 8, DType::bf16, nullptr), Error);
  EXPECT_THROW(blas.linear(2, 8, 16, nullptr, 16, nullptr, nullptr, 4, DType::bf16, nullptr),
               Error);
  EXPECT_THROW(blas.linear(2, 8, 16, nullptr, 16, nullptr, nullptr, 8, DType::f32, nullptr), Error);
}

// ---- batched_nn --------------------------------------------------------------------------

// C_b = A_b . B_b for b < batch with the MLA absorption's strides; C's buffer has `c_elems`
// elements and every element not in some C_b must stay poisoned.
void check_batched(Blas& blas, DType act, int batch, int64_t M, int64_t N, int64_t K, int64_t lda,
                   int64_t strideA, int64_t a_elems, int64_t ldb, int64_t strideB, int64_t ldc,
                   int64_t strideC, int64_t c_elems, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << dtype_name(act) << " batch=" << batch << " M=" << M
                                  << " N=" << N << " K=" << K);
  std::mt19937 rng(seed);
  const auto a = random_act(size_t(a_elems), act, rng);
  const auto b = random_act(size_t(batch * strideB), act, rng, 0.25f);
  DevBuf<uint16_t> da(a), db(b), dc{size_t(c_elems)};
  dc.fill_bytes(0xFF);
  blas.batched_nn(batch, M, N, K, da.ptr, lda, strideA, db.ptr, ldb, strideB, dc.ptr, ldc, strideC,
                  act, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto c = dc.download();
  std::vector<char> written(size_t(c_elems), 0);
  int bad = 0;
  for (int h = 0; h < batch; ++h)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double s = 0.0, sa = 0.0;
        for (int64_t k = 0; k < K; ++k) {
          const double p = double(act_float(a[h * strideA + m * lda + k], act)) *
                           act_float(b[h * strideB + k * ldb + n], act);
          s += p;
          sa += std::fabs(p);
        }
        const int64_t at = h * strideC + m * ldc + n;
        written[at] = 1;
        const double got = act_float(c[at], act), tol = tolerance(s, sa, act);
        if (!(std::fabs(got - s) <= tol) && ++bad <= 5)
          ADD_FAILURE() << "C_" << h << "(" << m << ", " << n << ") = " << got << ", want " << s;
      }
  for (int64_t i = 0; i < c_elems; ++i)
    if (!written[i] && c[i] != kPoison16 && ++bad <= 10)
      ADD_FAILURE() << "element " << i << " outside every C_b was written";
  EXPECT_EQ(bad, 0);
}

TEST(CudaGemm, BatchedNnMlaAbsorption) {
  KMLA_REQUIRE_GPU();
  Blas blas;
  constexpr int H = 3;
  constexpr int64_t T = 5;
  // ql_nope[t, h, :512] = q_nope[t, h, :128] . W_UK_T[h] (128 x 512): q rows [T, H, 192], the
  // result written into rows [T, H, 576] (its rope tail 512..575 must stay untouched).
  check_batched(blas, DType::bf16, H, T, 512, 128, H * 192, 192, T * H * 192, 512, 128 * 512,
                H * 576, 576, T * H * 576, 21);
  // out[t, h, :128] = latent[t, h, :512] . W_UV[h] (512 x 128): latent rows [T, H, 576], out
  // rows of H * 128 + 8 (8 padding elements per token).
  check_batched(blas, DType::bf16, H, T, 128, 512, H * 576, 576, T * H * 576, 128, 512 * 128,
                H * 128 + 8, 128, T * (H * 128 + 8), 22);
  check_batched(blas, DType::f16, H, T, 128, 512, H * 576, 576, T * H * 576, 128, 512 * 128,
                H * 128 + 8, 128, T * (H * 128 + 8), 23);
  // One head, one token.
  check_batched(blas, DType::bf16, 1, 1, 512, 128, 192, 192, 192, 512, 128 * 512, 576, 576, 576,
                24);
}

// ---- tuning --------------------------------------------------------------------------------

// KMLA_GEMM_TUNE=0 turns Blas tuning into a no-op (A/B timings): the tuning tests skip then.
bool tuning_off() {
  const char* env = std::getenv("KMLA_GEMM_TUNE");
  return env != nullptr && std::strcmp(env, "0") == 0;
}

// Tuning times its candidates with the call's own operands and then runs the winner: results
// stay within the fp32-accumulation rule (split-K forms add their parts in fp32), padding stays
// untouched, a tuned plan serves later calls of its shape, a shape met first inside a capture
// is not tuned there (a synchronizing capture would fail) but at its next eager call, and
// tuning off stops tuning new shapes.
TEST(CudaGemm, TuningKeepsResults) {
  KMLA_REQUIRE_GPU();
  if (tuning_off()) GTEST_SKIP() << "KMLA_GEMM_TUNE=0";
  Blas blas;
  blas.set_tuning(true);
  // The K3 decode step's q_b (deep K, few CTAs without split-K) with a padded ldc.
  check_linear(blas, DType::bf16, 64, 2304, 1536, 1536, 2312, 0, 71);
  EXPECT_EQ(blas.tuned_shapes(), 1);
  check_linear(blas, DType::bf16, 64, 2304, 1536, 1536, 2312, 0, 72);  // the tuned plan
  EXPECT_EQ(blas.tuned_shapes(), 1);
  check_linear(blas, DType::f16, 5, 40, 72, 75, 41, 1, 73);  // 2-byte aligned rows
  EXPECT_EQ(blas.tuned_shapes(), 2);
  // W_UV of the absorption, batched.
  check_batched(blas, DType::bf16, 3, 17, 128, 512, 3 * 576, 576, 17 * 3 * 576, 128, 512 * 128,
                3 * 128 + 8, 128, 17 * (3 * 128 + 8), 74);
  EXPECT_EQ(blas.tuned_shapes(), 3);
  check_linear(blas, DType::bf16, 32, 1024, 2048, 2048, 1024, 0, 75, true);  // captured
  EXPECT_EQ(blas.tuned_shapes(), 3);
  check_linear(blas, DType::bf16, 32, 1024, 2048, 2048, 1024, 0, 76);  // now eager: tuned
  EXPECT_EQ(blas.tuned_shapes(), 4);
  blas.set_tuning(false);
  check_linear(blas, DType::bf16, 16, 512, 1024, 1024, 512, 0, 77);
  EXPECT_EQ(blas.tuned_shapes(), 4);
  EXPECT_THROW(blas.set_tuning(false), Error);
}

// ---- activation quantization ---------------------------------------------------------------

// The CPU rule (kmla::quantize_activation_fp8) written out to produce codes and scales.
// Scales are stored at act_scale_index (the layout is Blas-internal; ScaleLayout checks it).
void host_quantize(const std::vector<float>& x, int64_t M, int64_t K, int64_t lda,
                   std::vector<uint8_t>& codes, std::vector<float>& scales) {
  const int64_t groups = (K + 127) / 128;
  codes.assign(size_t(M * K), 0);
  scales.assign(act_scale_elems(M, K), 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t end = std::min(K, g * 128 + 128);
      float amax = 0.0f;
      for (int64_t k = g * 128; k < end; ++k) amax = std::fmax(amax, std::fabs(x[m * lda + k]));
      const float s = std::fmax(amax, 1e-10f) / kFp8Max;
      for (int64_t k = g * 128; k < end; ++k)
        codes[m * K + k] = float_to_e4m3_sat(x[m * lda + k] / s);
      scales[size_t(act_scale_index(m, g, M, K))] = s;
    }
}

// Activations with a wide spread of magnitudes (2^-12 .. 2^8 times uniform), an all-zero
// group, a NaN, and a group whose amax sits far above the rest (subnormal codes).
std::vector<uint16_t> adversarial_act(int64_t M, int64_t K, int64_t lda, DType act, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> e(-12, act == DType::bf16 ? 8 : 4);
  std::vector<uint16_t> x(size_t(M * lda), act_bits(1000.0f, act));  // junk past K
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) x[m * lda + k] = act_bits(std::ldexp(u(rng), e(rng)), act);
  if (M > 0)
    for (int64_t k = 0; k < std::min<int64_t>(K, 128); ++k) x[k] = act_bits(0.0f, act);
  if (M > 1) x[lda + 5] = act == DType::bf16 ? uint16_t(0x7fc0) : uint16_t(0x7e00);
  if (M > 2) {
    for (int64_t k = 0; k < std::min<int64_t>(K, 128); ++k)
      x[2 * lda + k] = act_bits(1e-3f * u(rng), act);
    x[2 * lda + 7] = act_bits(300.0f, act);
  }
  return x;
}

void check_quantize(DType act, int64_t M, int64_t K, int64_t lda, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << dtype_name(act) << " M=" << M << " K=" << K << " lda=" << lda);
  const auto x = adversarial_act(M, K, lda, act, seed);
  std::vector<float> xf(x.size());
  for (size_t i = 0; i < x.size(); ++i) xf[i] = act_float(x[i], act);
  std::vector<uint8_t> want_codes;
  std::vector<float> want_scales;
  host_quantize(xf, M, K, lda, want_codes, want_scales);

  DevBuf<uint16_t> dx(x);
  DevBuf<uint8_t> dcodes(size_t(M * K));
  DevBuf<float> dscales(act_scale_elems(M, K));
  dcodes.fill_bytes(0xFF);
  dscales.fill_bytes(0xFF);
  quantize_act_fp8(dx.ptr, lda, M, K, act, dcodes.ptr, dscales.ptr, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto codes = dcodes.download();
  const auto scales = dscales.download();
  int bad = 0;
  for (int64_t i = 0; i < M * K; ++i)
    if (codes[i] != want_codes[i] && ++bad <= 5)
      ADD_FAILURE() << "code (" << i / K << ", " << i % K << ") = " << int(codes[i]) << ", want "
                    << int(want_codes[i]) << " for x = " << xf[(i / K) * lda + i % K];
  const int64_t groups = (K + 127) / 128;
  // Every element of the scale buffer is written (it was poisoned with NaN bits).
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t m = 0; m < M; ++m) {
      const size_t at = size_t(act_scale_index(m, g, M, K));
      if (float_bits(scales[at]) != float_bits(want_scales[at]) && ++bad <= 10)
        ADD_FAILURE() << "scale (" << m << ", group " << g << ") = " << scales[at] << ", want "
                      << want_scales[at];
    }
  // And the dequantized values are exactly what the CPU path feeds its sgemm.
  std::vector<float> deq(static_cast<size_t>(K));
  for (int64_t m = 0; m < M; ++m) {
    quantize_activation_fp8(xf.data() + m * lda, K, deq.data());
    for (int64_t k = 0; k < K; ++k) {
      const float got =
          e4m3_to_float(codes[m * K + k]) * scales[size_t(act_scale_index(m, k / 128, M, K))];
      const bool same =
          std::isnan(got) ? std::isnan(deq[k]) : float_bits(got) == float_bits(deq[k]);
      if (!same && ++bad <= 15)
        ADD_FAILURE() << "dequantized (" << m << ", " << k << ") = " << got << ", CPU " << deq[k];
    }
  }
  EXPECT_EQ(bad, 0);
}

// The activation-scale layout (host only): a bijection onto [0, act_scale_elems) whose first
// M - M % 4 tokens are token-major at pitch M - M % 4, the VEC128 layout cuBLASLt reads for its
// n = M - M % 4 bulk rows (pitch exactly n: VEC128 scales have no leading dimension).
TEST(CudaGemm, ScaleLayout) {
  for (int64_t M : {1, 7, 8, 9, 33, 64, 70})
    for (int64_t K : {100, 128, 1024, 1100}) {
      SCOPED_TRACE(testing::Message() << "M=" << M << " K=" << K);
      const int64_t groups = (K + 127) / 128, bulk = M - M % 4;
      ASSERT_EQ(act_scale_elems(M, K), size_t(M * groups));
      std::vector<int> hits(act_scale_elems(M, K), 0);
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t m = 0; m < M; ++m) {
          const int64_t at = act_scale_index(m, g, M, K);
          ASSERT_GE(at, 0);
          ASSERT_LT(at, int64_t(hits.size()));
          ++hits[size_t(at)];
          if (m < bulk) ASSERT_EQ(at, g * bulk + m);
        }
      for (int h : hits) ASSERT_EQ(h, 1);
    }
  EXPECT_THROW(act_scale_index(3, 0, 3, 128), Error);
  EXPECT_THROW(act_scale_index(0, 1, 3, 128), Error);
}

TEST(CudaGemm, QuantizeActFp8MatchesCpuBitForBit) {
  KMLA_REQUIRE_GPU();
  check_quantize(DType::bf16, 3, 200, 256, 31);     // short last group, non-dense rows
  check_quantize(DType::bf16, 33, 1024, 1024, 32);  // 32 bulk rows + a 1-row tail
  check_quantize(DType::bf16, 16, 256, 256, 35);    // all bulk
  check_quantize(DType::f16, 5, 1536, 1544, 33);
  check_quantize(DType::bf16, 1, 7168, 7168, 34);  // decode hidden row
}

// ---- linear_fp8 ----------------------------------------------------------------------------

// A full fp8 block weight [N, K]: random codes (never NaN) and block multipliers 2^-9 .. 2^-6.
Fp8BlockWeight random_fp8_weight(int64_t N, int64_t K, uint32_t seed) {
  std::mt19937 rng(seed);
  Fp8BlockWeight w;
  w.codes = HostTensor(DType::e4m3, {N, K});
  w.scale_inv = HostTensor(DType::f32, {(N + 127) / 128, (K + 127) / 128});
  std::uniform_int_distribution<int> byte(0, 255);
  for (int64_t i = 0; i < N * K; ++i) {
    uint8_t c = uint8_t(byte(rng));
    if ((c & 0x7f) == 0x7f) c ^= 1;
    w.codes.data<uint8_t>()[i] = c;
  }
  std::uniform_real_distribution<float> s(0x1p-9f, 0x1p-6f);
  for (int64_t i = 0; i < w.scale_inv.numel(); ++i) w.scale_inv.data<float>()[i] = s(rng);
  return w;
}

struct DeviceFp8Weight {
  DevBuf<uint8_t> codes;
  DevBuf<float> scales;
  Fp8Weight view;
  explicit DeviceFp8Weight(const Fp8BlockWeight& w)
      : codes(std::vector<uint8_t>(w.codes.data<uint8_t>(),
                                   w.codes.data<uint8_t>() + w.codes.numel())),
        scales(std::vector<float>(w.scale_inv.data<float>(),
                                  w.scale_inv.data<float>() + w.scale_inv.numel())) {
    view.codes = codes.ptr;
    view.scales = scales.ptr;
    view.n = w.codes.dim(0);
    view.k = w.codes.dim(1);
    view.scale_cols = w.scale_inv.dim(1);
    view.row_offset = w.row_offset;
    view.col_offset = w.col_offset;
  }
};

bool is_sm90() {
  int device = 0, major = 0, minor = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  return major == 9 && minor == 0;
}

// Quantizes random act rows on the GPU, runs linear_fp8 on the default path and on the forced
// fallback, and checks both against sum_k x8 xs w8 ws in fp64. `expect_cublaslt` is whether
// the weight/ldc should take cuBLASLt on an sm_90 device; cuBLASLt then takes the first
// M - M % 4 rows (its VEC128 operand needs n % 4 == 0) and the fallback kernel the rest, so
// M < 8 is fallback only.
void check_linear_fp8(Blas& blas, DType act, int64_t M, const Fp8BlockWeight& w, int64_t ldc,
                      bool expect_cublaslt, uint32_t seed) {
  const int64_t N = w.codes.dim(0), K = w.codes.dim(1);
  SCOPED_TRACE(testing::Message() << dtype_name(act) << " M=" << M << " N=" << N << " K=" << K
                                  << " offsets " << w.row_offset << ", " << w.col_offset);
  DeviceFp8Weight dw(w);
  const bool cublaslt = blas.linear_fp8_uses_cublaslt(M, dw.view, ldc, act);
  // The path check: on sm_90 cuBLASLt's block-scaled GEMM must take these shapes (run with
  // KMLA_GEMM_VERBOSE=1 to see the heuristic's and matmul's cuBLASLt statuses if it does not).
  EXPECT_EQ(cublaslt, expect_cublaslt && is_sm90() && M >= 4);

  std::mt19937 rng(seed);
  const int64_t lda = K + 8;
  const auto x = random_act(size_t(std::max<int64_t>(M, 1) * lda), act, rng, 2.0f);
  DevBuf<uint16_t> dx(x);
  DevBuf<uint8_t> a8(size_t(std::max<int64_t>(M * K, 1)));
  DevBuf<float> a_scales(std::max<size_t>(act_scale_elems(M, K), 1));
  quantize_act_fp8(dx.ptr, lda, M, K, act, a8.ptr, a_scales.ptr, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto codes = a8.download();
  const auto scales = a_scales.download();

  std::vector<double> ref(size_t(M * N)), abs_sum(size_t(M * N));
  const auto* wc = w.codes.data<uint8_t>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0.0, sa = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = double(e4m3_to_float(codes[m * K + k])) *
                         scales[size_t(act_scale_index(m, k / 128, M, K))] *
                         e4m3_to_float(wc[n * K + k]) * w.scale(n, k);
        s += p;
        sa += std::fabs(p);
      }
      ref[m * N + n] = s;
      abs_sum[m * N + n] = sa;
    }

  for (bool fallback : {false, true}) {
    blas.set_fp8_fallback(fallback);
    DevBuf<uint16_t> dc(size_t(std::max<int64_t>(M, 1) * ldc));
    dc.fill_bytes(0xFF);
    blas.linear_fp8(M, a8.ptr, a_scales.ptr, dw.view, dc.ptr, ldc, act, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto c = dc.download();
    if (M == 0) {
      for (uint16_t bits : c) ASSERT_EQ(bits, kPoison16) << "M == 0 must write nothing";
    } else {
      const bool mma = cublaslt && !fallback;
      expect_close(c, M, N, ldc, ref, abs_sum, act,
                   mma ? "linear_fp8 (cuBLASLt)" : "linear_fp8 (fallback)",
                   mma ? kFp8MmaSumError : kFp32SumError);
    }
  }
  blas.set_fp8_fallback(false);
  // A cublasLtMatmul that failed at enqueue disables the plan (the kernel computed every row,
  // so the results above still pass): the path must still be cuBLASLt after the calls.
  EXPECT_EQ(blas.linear_fp8_uses_cublaslt(M, dw.view, ldc, act), cublaslt)
      << "cublasLtMatmul failed for this shape (KMLA_GEMM_VERBOSE=1 shows the status)";
}

TEST(CudaGemm, LinearFp8BlockAligned) {
  KMLA_REQUIRE_GPU();
  Blas blas;
  // kv_a-like: N = 576 (4.5 blocks), K = 1024 (8 groups): cuBLASLt on sm_90.
  const auto w = random_fp8_weight(576, 1024, 41);
  // M = 1 and 7: fallback only; 8: one cuBLASLt quantum; 33 and 100: bulk + a 1- / 4-row tail.
  for (int64_t M : {1, 7, 8, 33, 64, 100})
    check_linear_fp8(blas, DType::bf16, M, w, 584, true, 42 + uint32_t(M));
  check_linear_fp8(blas, DType::f16, 33, w, 576, true, 43);
  check_linear_fp8(blas, DType::bf16, 0, w, 576, true, 44);  // M == 0: a no-op
}

TEST(CudaGemm, LinearFp8SlicesAndOddShapes) {
  KMLA_REQUIRE_GPU();
  Blas blas;
  const auto full = random_fp8_weight(576, 1024, 51);
  // A tensor-parallel row slice starting inside a block (row_offset 64).
  const auto rows = full.slice_rows(64, 256);
  ASSERT_EQ(rows.row_offset, 64);
  for (int64_t M : {1, 33})
    check_linear_fp8(blas, DType::bf16, M, rows, 256, false, 52 + uint32_t(M));
  // A column slice (col_offset 64): activation groups straddle two weight blocks.
  const auto cols = full.slice_cols(64, 512);
  ASSERT_EQ(cols.col_offset, 64);
  check_linear_fp8(blas, DType::bf16, 5, cols, 576, false, 55);
  // K not a multiple of 128 (a short last group) and N not a multiple of 16.
  check_linear_fp8(blas, DType::bf16, 7, random_fp8_weight(100, 320, 56), 104, false, 57);
  // K % 512 != 0: cuBLASLt would need the weight scales padded to 4 K-blocks.
  check_linear_fp8(blas, DType::f16, 17, random_fp8_weight(128, 640, 58), 128, false, 59);
}

// Tuning of the block-scaled W8A8 GEMM (sm_90): a q_b-like shape, its cuBLASLt rows tuned with
// the call's scale pointers in place, the results within the fp8 MMA rule.
TEST(CudaGemm, TuningKeepsFp8Results) {
  KMLA_REQUIRE_GPU();
  if (tuning_off()) GTEST_SKIP() << "KMLA_GEMM_TUNE=0";
  Blas blas;
  blas.set_tuning(true);
  const auto w = random_fp8_weight(2304, 1536, 81);
  check_linear_fp8(blas, DType::bf16, 64, w, 2304, true, 82);
  EXPECT_EQ(blas.tuned_shapes(), is_sm90() ? 1 : 0);
  check_linear_fp8(blas, DType::bf16, 64, w, 2304, true, 83);  // the tuned plan, new inputs
  blas.set_tuning(false);
}

// linear and linear_fp8 inside a CUDA graph: no allocation or synchronization in the calls.
TEST(CudaGemm, CapturedInCudaGraph) {
  KMLA_REQUIRE_GPU();
  Blas blas;
  const DType act = DType::bf16;
  const int64_t M = 12, N = 576, K = 1024;  // 8 rows through cuBLASLt (sm_90), 4 fallback
  std::mt19937 rng(61);
  const auto x = random_act(size_t(M * K), act, rng);
  const auto wl = random_act(size_t(N * K), act, rng);
  const auto w8 = random_fp8_weight(N, K, 62);
  DeviceFp8Weight dw(w8);
  DevBuf<uint16_t> dx(x), dwl(wl), c_eager(size_t(M * N)), c_graph(size_t(M * N)),
      c8_eager(size_t(M * N)), c8_graph(size_t(M * N));
  DevBuf<uint8_t> a8(size_t(M * K));
  DevBuf<float> a_scales(act_scale_elems(M, K));
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  auto run = [&](uint16_t* c, uint16_t* c8) {
    blas.linear(M, N, K, dx.ptr, K, dwl.ptr, c, N, act, stream);
    quantize_act_fp8(dx.ptr, K, M, K, act, a8.ptr, a_scales.ptr, stream);
    blas.linear_fp8(M, a8.ptr, a_scales.ptr, dw.view, c8, N, act, stream);
  };
  run(c_eager.ptr, c8_eager.ptr);  // plans are made (host work) on first use
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  c_graph.fill_bytes(0xFF);
  c8_graph.fill_bytes(0xFF);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  run(c_graph.ptr, c8_graph.ptr);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  // Same algorithm, same inputs: the replay is bit-identical to the eager run.
  EXPECT_EQ(c_graph.download(), c_eager.download());
  EXPECT_EQ(c8_graph.download(), c8_eager.download());
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace kmla::cuda
