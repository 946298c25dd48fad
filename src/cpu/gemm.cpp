// OpenBLAS sgemm wrappers and the fp32 <-> bf16/f16/e4m3 conversions of the CPU backend.
#include <cblas.h>

#include <climits>
#include <cstring>

#include "cpu/kernels.hpp"
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

}  // namespace

void gemm_nt(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc, float alpha, float beta) {
  if (M == 0 || N == 0) return;
  if (K == 0) return scale_c(M, N, C, ldc, beta);
  check_dims(M, N, K, lda, ldb, ldc);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(M), int(N), int(K), alpha, A, int(lda),
              B, int(ldb), beta, C, int(ldc));
}

void gemm_nn(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc, float alpha, float beta) {
  if (M == 0 || N == 0) return;
  if (K == 0) return scale_c(M, N, C, ldc, beta);
  check_dims(M, N, K, lda, ldb, ldc);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(M), int(N), int(K), alpha, A,
              int(lda), B, int(ldb), beta, C, int(ldc));
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
    case DType::bf16: return round_bf16(x);
    case DType::f16: return round_fp16(x);
    default: return x;
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

}  // namespace kmla::cpu
