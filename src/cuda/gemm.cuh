// Projection GEMMs of the CUDA backend through cuBLASLt: 16-bit (bf16/f16) with fp32
// accumulation, fp8 block-scaled weights as W8A8 (dynamic per-token, per-128 activation
// scales, 128x128 weight block scales), and the strided-batched products of the absorbed
// W_UK_T / W_UV. Every call takes a stream, allocates nothing and never synchronizes, so
// it can be captured in a CUDA graph.
#pragma once

#include <cublasLt.h>


#include "cuda/common.cuh"

namespace kmla::cuda {

// An fp8 block-quantized weight [N, K] (e4m3 codes, row-major) in device memory with its
// fp32 block scales [ceil((row_offset + N)/128), scale_cols] (multipliers; block (i, j) covers
// full-weight rows 128i.., columns 128j..; local row r is full row r + row_offset).
struct Fp8Weight {
  const uint8_t* codes = nullptr;
  const float* scales = nullptr;
  int64_t n = 0, k = 0;
  int64_t scale_cols = 0;
  int row_offset = 0, col_offset = 0;
};

// Per-token, per-128-input activation quantization (kmla::quantize_activation_fp8): for
// row m and group g of 128 inputs, scale = max(amax, 1e-10) / 448 and code = e4m3(x / scale)
// (saturating, RNE). x: [M, K] act at row stride lda; codes: dense [M, K]; scales in the
// layout Blas::linear_fp8 consumes (act_scale_elems(M, K) floats, element act_scale_index(m, g,
// M, K) for token m and group g). K % 128 == 0 is not required: the last group is shorter.
size_t act_scale_elems(int64_t M, int64_t K);
// The scale layout: the first M - M % 8 tokens ("bulk", the rows cuBLASLt takes) are token-major
// with pitch = bulk (cuBLASLt's VEC128 layout); the last M % 8 tokens follow, token-major with
// pitch M % 8. A bijection of [0, M) x [0, ceil(K/128)) onto [0, act_scale_elems(M, K)).
int64_t act_scale_index(int64_t m, int64_t g, int64_t M, int64_t K);
void quantize_act_fp8(const void* x, int64_t lda, int64_t M, int64_t K, DType act, uint8_t* codes,
                      float* scales, cudaStream_t stream);

class Blas {
 public:
  Blas();  // creates the cuBLASLt handle and a workspace on the current device
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;

  // C[M, N] = A[M, K] . W[N, K]^T: A at row stride lda, W dense [N, K] (a Hugging Face
  // [out, in] weight), C at row stride ldc; all in act (bf16/f16), fp32 accumulation, one
  // rounding of C. M == 0 is a no-op.
  void linear(int64_t M, int64_t N, int64_t K, const void* A, int64_t lda, const void* W, void* C,
              int64_t ldc, DType act, cudaStream_t stream) const;

  // The W8A8 form: A8 / a_scales from quantize_act_fp8, C in act:
  // C[m, n] = sum over 128-groups g of (sum_k a8 * w8) * a_scale[m, g] * w_scale[n, g].
  void linear_fp8(int64_t M, const uint8_t* A8, const float* a_scales, const Fp8Weight& W, void* C,
                  int64_t ldc, DType act, cudaStream_t stream) const;

  // For b in [0, batch): C_b[M, N] = A_b[M, K] . B_b[K, N] with A_b = A + b * strideA (row
  // stride lda), B_b = B + b * strideB (row stride ldb), C_b = C + b * strideC (row stride
  // ldc); strides in elements, all act, fp32 accumulation, one rounding.
  void batched_nn(int batch, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda,
                  int64_t strideA, const void* B, int64_t ldb, int64_t strideB, void* C,
                  int64_t ldc, int64_t strideC, DType act, cudaStream_t stream) const;

  // Whether linear_fp8 of this shape runs cuBLASLt's block-scaled GEMM (true) for its first
  // M - M % 8 rows (the rest always take the fallback kernel) or only the fallback kernel,
  // assuming 16-byte aligned pointers (an unaligned pointer also takes the fallback). Runs the
  // cuBLASLt heuristic on first use of the shape (host work, no device work); false after a
  // cublasLtMatmul of this shape failed (linear_fp8 then falls back for good).
  bool linear_fp8_uses_cublaslt(int64_t M, const Fp8Weight& W, int64_t ldc, DType act) const;
  // Forces linear_fp8 onto the fallback kernel (tests, A/B comparisons). The environment
  // variable KMLA_GEMM_FALLBACK=1, read by the constructor, sets the same switch.
  // KMLA_GEMM_VERBOSE=1 makes Blas log to stderr, once per shape, why a W8A8 shape is refused
  // and the cuBLASLt status of every heuristic query and of the first matmul of each shape.
  void set_fp8_fallback(bool force);

  // GEMM tuning, for callers who ask for it (Layer::tune). While tuning is on (more
  // set_tuning(true) than set_tuning(false) calls so far), the first call of each shape
  // (linear, batched_nn, and linear_fp8's cuBLASLt rows) on a stream that is not capturing
  // times cuBLASLt's candidates for it on that stream with the call's own operands: the
  // heuristic's choice, its other results and split-K forms (fp32 reduction) of the first
  // few, each from a cold L2 (a read of twice the L2 first), median of 3 after a warm-up. The
  // fastest, if 3 % faster than the heuristic's, serves every later call of the shape, tuning
  // on or off. Such a call synchronizes `stream`; the first one allocates a flush buffer (2x
  // the L2), freed when tuning goes off. Results stay within the same accumulation rule, but
  // the summation order, and so the last bit, may depend on the timings. Shapes met first
  // inside a capture keep the heuristic's choice until their next eager call while tuning is
  // on. KMLA_GEMM_TUNE=0 (read by the constructor) makes set_tuning a no-op for A/B timings;
  // KMLA_GEMM_VERBOSE=1 logs every tuning result.
  void set_tuning(bool on);
  // How many shapes tuning has timed so far (tests, logs).
  int tuned_shapes() const;

  struct Impl;

 private:
  Impl* impl_;
};

}  // namespace kmla::cuda
