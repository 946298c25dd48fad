// OpenBLAS sgemm wrappers and the fp32 <-> bf16/f16/e4m3 conversions of the CPU backend.
#include <cblas.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <mutex>

#include "cpu/kernels.hpp"
#include "cpu/parallel.hpp"
#include "kmla/error.hpp"
#include "kmla/numeric.hpp"

namespace kmla::cpu {

namespace {

void check_dims(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc) {
  // OpenBLAS here takes 32-bit sizes.
  KMLA_CHECK(M <= INT_MAX && N <= INT_MAX && K <= INT_MAX && lda <= INT_MAX && ldb <= INT_MAX &&
                 ldc <= INT_MAX,
             "GEMM dimensions exceed 2^31-1: M=", M, " N=", N, " K=", K);
}

// beta * C for the degenerate K == 0 case (sgemm would not be called).
void scale_c(int64_t M, int64_t N, float* C, int64_t ldc, float beta) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
}

// One sgemm in the calling thread. transb: B is [N, K] (C = A B^T) rather than [K, N].
void sgemm(bool transb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
           const float* B, int64_t ldb, float* C, int64_t ldc, float alpha, float beta) {
  if (M == 0 || N == 0) return;
  if (K == 0) return scale_c(M, N, C, ldc, beta);
  check_dims(M, N, K, lda, ldb, ldc);
  static std::once_flag single_threaded;
  std::call_once(single_threaded, [] { openblas_set_num_threads(1); });
  cblas_sgemm(CblasRowMajor, CblasNoTrans, transb ? CblasTrans : CblasNoTrans, int(M), int(N),
              int(K), alpha, A, int(lda), B, int(ldb), beta, C, int(ldc));
}

// Splits C into slabs, one task each: by output columns when there are enough of them (each
// worker then streams its own part of B, which is what a weight-bound small-M GEMM wants),
// else by rows. Below ~1 M multiply-adds a single call is cheaper than the fork.
void sgemm_split(bool transb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                 const float* B, int64_t ldb, float* C, int64_t ldc, float alpha, float beta,
                 int threads) {
  constexpr int64_t kMinSlab = 64;  // columns or rows: keeps each slab a real GEMM
  const double work = double(M) * double(N) * double(K);
  if (threads <= 1 || work < double(1 << 20))
    return sgemm(transb, M, N, K, A, lda, B, ldb, C, ldc, alpha, beta);
  const bool by_cols = N >= kMinSlab * threads || N >= M;
  const int64_t extent = by_cols ? N : M;
  int64_t slab = (extent + threads - 1) / threads;
  slab = std::max(kMinSlab, (slab + 15) / 16 * 16);
  const int64_t slabs = (extent + slab - 1) / slab;
  parallel_for(slabs, threads, [&](int64_t s, int) {
    const int64_t a = s * slab, n = std::min(slab, extent - a);
    if (by_cols)  // columns [a, a+n): rows a.. of B^T's source, or columns a.. of B
      sgemm(transb, M, n, K, A, lda, transb ? B + a * ldb : B + a, ldb, C + a, ldc, alpha, beta);
    else
      sgemm(transb, n, N, K, A + a * lda, lda, B, ldb, C + a * ldc, ldc, alpha, beta);
  });
}

}  // namespace

void gemm_nt(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc, float alpha, float beta, int threads) {
  sgemm_split(true, M, N, K, A, lda, B, ldb, C, ldc, alpha, beta, threads);
}

void gemm_nn(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc, float alpha, float beta, int threads) {
  sgemm_split(false, M, N, K, A, lda, B, ldb, C, ldc, alpha, beta, threads);
}

void load_f32(const void* src, DType dtype, int64_t n, float* dst, float e4m3_scale) {
  switch (dtype) {
    case DType::f32:
      std::memcpy(dst, src, size_t(n) * sizeof(float));
      return;
    case DType::bf16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
      return;
    }
    case DType::f16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_float(s[i]);
      return;
    }
    case DType::e4m3: {
      const auto* s = static_cast<const uint8_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = e4m3_to_float(s[i]) * e4m3_scale;
      return;
    }
    default:
      KMLA_CHECK(false, "cannot read dtype ", dtype_name(dtype), " as fp32");
  }
}

void store_f32(const float* src, int64_t n, DType dtype, void* dst) {
  switch (dtype) {
    case DType::f32:
      std::memcpy(dst, src, size_t(n) * sizeof(float));
      return;
    case DType::bf16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(src[i]);
      return;
    }
    case DType::f16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_fp16(src[i]);
      return;
    }
    default:
      KMLA_CHECK(false, "cannot write fp32 values as dtype ", dtype_name(dtype));
  }
}

float round_value(float x, DType dtype) {
  switch (dtype) {
    case DType::bf16:
      return round_bf16(x);
    case DType::f16:
      return round_fp16(x);
    default:
      return x;
  }
}

void round_to(float* x, int64_t n, DType dtype) {
  if (dtype == DType::bf16)
    for (int64_t i = 0; i < n; ++i) x[i] = round_bf16(x[i]);
  else if (dtype == DType::f16)
    for (int64_t i = 0; i < n; ++i) x[i] = round_fp16(x[i]);
}

void e4m3_roundtrip(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = e4m3_to_float(e4m3_scaled_clamped(x[i], 1.0f));
}

std::vector<float> weight_f32(const HostTensor& w) {
  std::vector<float> out(size_t(w.numel()));
  load_f32(w.data<void>(), w.dtype(), w.numel(), out.data());
  return out;
}

std::vector<float> fp8_weight_f32(const Fp8BlockWeight& w) {
  const int64_t rows = w.codes.dim(0), cols = w.codes.dim(1);
  std::vector<float> out(size_t(rows * cols));
  const auto* c = w.codes.data<uint8_t>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < cols; ++k) out[size_t(r * cols + k)] = e4m3_to_float(c[r * cols + k]) * w.scale(r, k);
  return out;
}

void quantize_rows_fp8(const float* x, int64_t rows, int64_t stride, int64_t n, float* out, int threads) {
  constexpr int64_t kRowsPerTask = 16;
  parallel_ranges(rows, kRowsPerTask, threads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantize_activation_fp8(x + r * stride, n, out + r * n);
  });
}

}  // namespace kmla::cpu
