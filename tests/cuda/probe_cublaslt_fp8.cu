// Probe of cuBLASLt's block-scaled FP8 GEMM on the GPU it runs on (meant for sm_90): which
// configurations of the W8A8 product C[t, n] = sum_g xs(t, g) ws(n/128, g) sum_{k in g} x8 w8
// (N = 576, K = 1024, 128-groups along K) the library accepts, and whether the accepted ones
// compute that formula. One line per configuration: the heuristic's status and algorithm count,
// the matmul's status, and the largest |error| / max |reference| against fp64 on the host; a
// refused configuration also shows cuBLASLt's last logged error or hint. Not a test: it always
// exits 0. Build target kmla_probe_cublaslt_fp8; run it with no arguments.
//
// Terms: W = the fp8 weight [576, 1024] with one fp32 scale per 128x128 block; X = the fp8
// activations [tok, 1024] with one fp32 scale per token and 128-group. "W=A" is kmla's layout
// (cuBLASLt A = W, op T; B = X, op N; D column-major 576 x tok = row-major [tok, 576]); "X=A"
// swaps the operands (D comes out transposed). Scale modes: BLK = BLK128x128_32F, VEC =
// VEC128_32F, OUT = OUTER_VEC_32F (one scale per row / column, a different formula: control),
// SCL = SCALAR_32F (tensor-wide: control). "tok" is the n (or m) cuBLASLt is given; tok > M
// means the problem was padded with extra token rows (scales at pitch tok). prefs: "kmla" =
// workspace + 16-byte alignment minimums + reduction mask NONE|COMPUTE_TYPE (what kmla's Blas
// asks), "plain" = workspace only (what NVIDIA's sample and PyTorch ask).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr int kN = 576, kK = 1024, kG = kK / 128, kG4 = (kG + 3) / 4 * 4, kMaxTok = 256;
constexpr size_t kWorkspace = size_t(32) << 20;
constexpr size_t kScaleCap = 1 << 16;  // floats per scale buffer (every layout here fits)

std::string g_last_log;  // cuBLASLt's last error / hint message
void logger(int, const char* fn, const char* msg) {
  g_last_log = std::string(fn ? fn : "") + ": " + (msg ? msg : "");
}

float e4m3_to_float(uint8_t c) {
  const int e = (c >> 3) & 15, m = c & 7;
  const float v = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
  return (c & 0x80) ? -v : v;
}
float bf16_to_float(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
float f16_to_float(uint16_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  const float v = e == 0    ? std::ldexp(float(m), -24)
                  : e == 31 ? NAN
                            : std::ldexp(1.0f + m / 1024.0f, e - 15);
  return (h & 0x8000) ? -v : v;
}

const char* mode_name(int mode) {
  switch (mode) {
    case CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F:
      return "BLK";
    case CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F:
      return "VEC";
    case CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F:
      return "OUT";
    default:
      return "SCL";
  }
}

struct Config {
  bool weight_is_a;
  int w_mode, x_mode;  // scale modes of the weight and of the activation operand
  int M, tok;          // tokens checked / tokens given to cuBLASLt (tok >= M: padded problem)
  bool fast_accum;
  cudaDataType_t d_type;
  bool kmla_prefs;
};

struct Data {
  std::vector<uint8_t> x, w;  // [kMaxTok, kK], [kN, kK] e4m3 codes
  std::vector<float> xs, ws;  // xs[t * kG + g], ws[nb * kG + g]
  std::vector<double> dots;   // dots[(t * kN + n) * kG + g] = sum_{k in g} x * w
};

// The scale a mode applies to element (outer index o, group g), derived from the random
// per-token / per-block scales so that VEC on the weight reproduces the block formula exactly.
float w_scale(const Data& d, int mode, int n, int g) {
  if (mode == CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F) return d.ws[0];
  if (mode == CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F) return d.ws[(n / 128) * kG];
  return d.ws[(n / 128) * kG + g];  // BLK, or VEC with the block scale repeated per row
}
float x_scale(const Data& d, int mode, int t, int g) {
  if (mode == CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F) return d.xs[0];
  if (mode == CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F) return d.xs[t * kG];
  if (mode == CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F) return d.xs[(t / 128) * 128 * kG + g];
  return d.xs[t * kG + g];
}

// The scale tensor of an operand with `outer` rows (cuBLASLt's m for A, n for B) in the layout
// the cuBLAS docs give for `mode`: SCL one float; OUT [outer]; VEC outer-major [kG][outer];
// BLK K-major [ceil(outer/128)][kG4].
template <class F>
std::vector<float> scale_tensor(int mode, int outer, F scale) {
  std::vector<float> v;
  if (mode == CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F) {
    v.push_back(scale(0, 0));
  } else if (mode == CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F) {
    for (int o = 0; o < outer; ++o) v.push_back(scale(o, 0));
  } else if (mode == CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F) {
    v.resize(size_t(kG) * outer);
    for (int g = 0; g < kG; ++g)
      for (int o = 0; o < outer; ++o) v[size_t(g) * outer + o] = scale(o, g);
  } else {
    const int blocks = (outer + 127) / 128;
    v.assign(size_t(blocks) * kG4, 0.0f);
    for (int b = 0; b < blocks; ++b)
      for (int g = 0; g < kG; ++g) v[size_t(b) * kG4 + g] = scale(b * 128, g);
  }
  return v;
}

#define CK(expr)                                                                                   \
  do {                                                                                             \
    const cudaError_t e_ = (expr);                                                                 \
    if (e_ != cudaSuccess) {                                                                       \
      std::printf("CUDA error %s at %s:%d; stopping\n", cudaGetErrorName(e_), __FILE__, __LINE__); \
      return false;                                                                                \
    }                                                                                              \
  } while (0)

struct Device {
  uint8_t *x = nullptr, *w = nullptr;
  float *xs = nullptr, *ws = nullptr;
  void *d = nullptr, *workspace = nullptr;
};

// Runs one configuration and prints its line; false after a CUDA error (the context may be
// unusable, so the caller stops).
bool run(cublasLtHandle_t lt, const Device& dev, const Data& data, const Config& c) {
  const int wm = c.w_mode, xm = c.x_mode;
  const auto wsv = scale_tensor(wm, kN, [&](int n, int g) { return w_scale(data, wm, n, g); });
  const auto xsv = scale_tensor(xm, c.tok, [&](int t, int g) { return x_scale(data, xm, t, g); });
  CK(cudaMemcpy(dev.ws, wsv.data(), wsv.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dev.xs, xsv.data(), xsv.size() * 4, cudaMemcpyHostToDevice));
  const size_t d_elem = c.d_type == CUDA_R_32F ? 4 : 2;
  CK(cudaMemset(dev.d, 0xFF, size_t(kMaxTok) * kN * 4));

  const int m = c.weight_is_a ? kN : c.tok, n = c.weight_is_a ? c.tok : kN;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  const int32_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof op_t);
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof op_n);
  const int32_t a_mode = c.weight_is_a ? wm : xm, b_mode = c.weight_is_a ? xm : wm;
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof a_mode);
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof b_mode);
  const void* a_scale = c.weight_is_a ? (const void*)dev.ws : (const void*)dev.xs;
  const void* b_scale = c.weight_is_a ? (const void*)dev.xs : (const void*)dev.ws;
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale,
                                 sizeof a_scale);
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale,
                                 sizeof b_scale);
  const int8_t fast = c.fast_accum ? 1 : 0;
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast);
  // Both fp8 operands are stored K-contiguous: column-major K x rows, leading dimension K.
  cublasLtMatrixLayoutCreate(&a, CUDA_R_8F_E4M3, kK, m, kK);
  cublasLtMatrixLayoutCreate(&b, CUDA_R_8F_E4M3, kK, n, kK);
  cublasLtMatrixLayoutCreate(&d, c.d_type, m, n, m);
  cublasLtMatmulPreferenceCreate(&pref);
  const uint64_t ws_bytes = kWorkspace;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                       sizeof ws_bytes);
  if (c.kmla_prefs) {
    const uint32_t mask = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    const uint32_t align = 16;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask,
                                         sizeof mask);
    for (auto attr :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof align);
  }
  g_last_log.clear();
  cublasLtMatmulHeuristicResult_t res[8] = {};
  int found = 0;
  const cublasStatus_t hs =
      cublasLtMatmulAlgoGetHeuristic(lt, desc, a, b, d, d, pref, 8, res, &found);
  cublasStatus_t ms = CUBLAS_STATUS_NOT_SUPPORTED;
  const char* ms_name = "-";
  double rel = -1.0;
  if (hs == CUBLAS_STATUS_SUCCESS && found > 0) {
    const float alpha = 1.0f, beta = 0.0f;
    const void* A = c.weight_is_a ? (const void*)dev.w : (const void*)dev.x;
    const void* B = c.weight_is_a ? (const void*)dev.x : (const void*)dev.w;
    ms = cublasLtMatmul(lt, desc, &alpha, A, a, B, b, &beta, dev.d, d, dev.d, d, &res[0].algo,
                        dev.workspace, kWorkspace, nullptr);
    ms_name = cublasLtGetStatusName(ms);
    CK(cudaDeviceSynchronize());
    CK(cudaGetLastError());
    if (ms == CUBLAS_STATUS_SUCCESS) {
      std::vector<uint8_t> out(size_t(kMaxTok) * kN * 4);
      CK(cudaMemcpy(out.data(), dev.d, size_t(m) * n * d_elem, cudaMemcpyDeviceToHost));
      double max_err = 0.0, max_ref = 0.0;
      for (int t = 0; t < c.tok; ++t)
        for (int j = 0; j < kN; ++j) {
          double ref = 0.0;
          for (int g = 0; g < kG; ++g)
            ref += double(x_scale(data, xm, t, g)) * w_scale(data, wm, j, g) *
                   data.dots[(size_t(t) * kN + j) * kG + g];
          const size_t at = c.weight_is_a ? size_t(t) * kN + j : size_t(j) * c.tok + t;
          float got;
          if (c.d_type == CUDA_R_32F) std::memcpy(&got, &out[at * 4], 4);
          uint16_t h;
          std::memcpy(&h, &out[at * 2], 2);
          if (c.d_type == CUDA_R_16BF) got = bf16_to_float(h);
          if (c.d_type == CUDA_R_16F) got = f16_to_float(h);
          const double err = std::isfinite(got) ? std::fabs(got - ref) : INFINITY;
          max_err = std::max(max_err, err);
          max_ref = std::max(max_ref, std::fabs(ref));
        }
      rel = max_err / std::max(max_ref, 1e-30);
    }
  }
  // bf16 / f16 output rounding alone is 2^-9 / 2^-12 of |ref|; a wrong scale or layout is O(1).
  const char* verdict = rel < 0 ? "" : rel < 1e-2 ? "ok" : "WRONG";
  char rel_text[32] = "      -";
  if (rel >= 0) std::snprintf(rel_text, sizeof rel_text, "%7.1e", rel);
  const char* d_name = c.d_type == CUDA_R_32F ? "f32" : c.d_type == CUDA_R_16F ? "f16" : "bf16";
  std::printf("%s W=%s X=%s M=%3d tok=%3d fa=%d D=%-4s %-5s | heur %-27s %d | mm %-27s | %s %s",
              c.weight_is_a ? "W=A" : "X=A", mode_name(wm), mode_name(xm), c.M, c.tok,
              int(c.fast_accum), d_name, c.kmla_prefs ? "kmla" : "plain", cublasLtGetStatusName(hs),
              found, ms_name, rel_text, verdict);
  if ((hs != CUBLAS_STATUS_SUCCESS || found == 0 || ms != CUBLAS_STATUS_SUCCESS) &&
      !g_last_log.empty())
    std::printf(" | %.140s", g_last_log.c_str());
  std::printf("\n");
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(d);
  cublasLtMatrixLayoutDestroy(b);
  cublasLtMatrixLayoutDestroy(a);
  cublasLtMatmulDescDestroy(desc);
  return true;
}

bool probe() {
  int device = 0, major = 0, minor = 0;
  CK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, device));
  major = prop.major;
  minor = prop.minor;
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  std::printf(
      "probe_cublaslt_fp8: %s sm_%d%d, CUDA runtime %d driver %d, cuBLASLt %zu "
      "(headers %d); N=%d K=%d\n",
      prop.name, major, minor, runtime, driver, cublasLtGetVersion(), CUBLAS_VERSION, kN, kK);
  std::printf(
      "columns: operand roles, scale modes, tokens checked / given, fast-accum, D type, "
      "prefs | heuristic status, algos | matmul status | max|err|/max|ref| verdict\n");

  Data data;
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> byte(0, 255);
  auto code = [&] {
    uint8_t c = uint8_t(byte(rng));
    return (c & 0x7f) == 0x7f ? uint8_t(c ^ 1) : c;  // never NaN
  };
  data.x.resize(size_t(kMaxTok) * kK);
  data.w.resize(size_t(kN) * kK);
  for (auto& c : data.x) c = code();
  for (auto& c : data.w) c = code();
  std::uniform_real_distribution<float> xs(0x1p-10f, 0x1p-4f), ws(0x1p-9f, 0x1p-6f);
  data.xs.resize(size_t(kMaxTok) * kG);
  data.ws.resize(size_t((kN + 127) / 128) * kG);
  for (auto& s : data.xs) s = xs(rng);
  for (auto& s : data.ws) s = ws(rng);
  data.dots.assign(size_t(kMaxTok) * kN * kG, 0.0);
  std::vector<float> xf(data.x.size()), wf(data.w.size());
  for (size_t i = 0; i < xf.size(); ++i) xf[i] = e4m3_to_float(data.x[i]);
  for (size_t i = 0; i < wf.size(); ++i) wf[i] = e4m3_to_float(data.w[i]);
  for (int t = 0; t < kMaxTok; ++t)
    for (int n = 0; n < kN; ++n)
      for (int g = 0; g < kG; ++g) {
        double s = 0.0;
        for (int k = g * 128; k < g * 128 + 128; ++k)
          s += double(xf[size_t(t) * kK + k]) * wf[size_t(n) * kK + k];
        data.dots[(size_t(t) * kN + n) * kG + g] = s;
      }

  Device dev;
  CK(cudaMalloc(&dev.x, data.x.size()));
  CK(cudaMalloc(&dev.w, data.w.size()));
  CK(cudaMalloc(&dev.xs, kScaleCap * 4));
  CK(cudaMalloc(&dev.ws, kScaleCap * 4));
  CK(cudaMalloc(&dev.d, size_t(kMaxTok) * kN * 4));
  CK(cudaMalloc(&dev.workspace, kWorkspace));
  CK(cudaMemset(dev.xs, 0, kScaleCap * 4));
  CK(cudaMemset(dev.ws, 0, kScaleCap * 4));
  CK(cudaMemcpy(dev.x, data.x.data(), data.x.size(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dev.w, data.w.data(), data.w.size(), cudaMemcpyHostToDevice));

  cublasLtHandle_t lt = nullptr;
  if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) {
    std::printf("cublasLtCreate failed\n");
    return false;
  }
  cublasLtLoggerSetCallback(logger);
  cublasLtLoggerSetMask(1 | 4);  // errors and hints

  const int BLK = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  const int VEC = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  const int OUT = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
  const int SCL = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  const cudaDataType_t bf = CUDA_R_16BF;
  std::vector<std::pair<const char*, std::vector<Config>>> sections;
  auto base = [&](bool kmla_prefs) {
    std::vector<Config> v;
    for (int M : {1, 4, 8, 33, 36, 64, 256})
      v.push_back({true, BLK, VEC, M, M, false, bf, kmla_prefs});
    return v;
  };
  sections.push_back(
      {"kmla's configuration (W=A BLK, X=B VEC, bf16) with kmla's preferences", base(true)});
  sections.push_back({"the same with workspace-only preferences", base(false)});
  // The remaining sections use workspace-only preferences, so that only the named
  // property differs from the section above.
  sections.push_back({"token count padded: scales at pitch tok, extra token rows computed",
                      {{true, BLK, VEC, 1, 4, false, bf, false},
                       {true, BLK, VEC, 1, 8, false, bf, false},
                       {true, BLK, VEC, 1, 16, false, bf, false},
                       {true, BLK, VEC, 33, 36, false, bf, false},
                       {true, BLK, VEC, 33, 40, false, bf, false},
                       {true, BLK, VEC, 33, 48, false, bf, false}}});
  sections.push_back({"fast accumulation on (PyTorch refuses it with block scaling)",
                      {{true, BLK, VEC, 8, 8, true, bf, false},
                       {true, BLK, VEC, 64, 64, true, bf, false},
                       {true, BLK, VEC, 256, 256, true, bf, false}}});
  sections.push_back({"D type fp32 / f16",
                      {{true, BLK, VEC, 8, 8, false, CUDA_R_32F, false},
                       {true, BLK, VEC, 33, 33, false, CUDA_R_32F, false},
                       {true, BLK, VEC, 64, 64, false, CUDA_R_32F, false},
                       {true, BLK, VEC, 256, 256, false, CUDA_R_32F, false},
                       {true, BLK, VEC, 64, 64, false, CUDA_R_16F, false}}});
  sections.push_back(
      {"VEC on both (weight block scales repeated per row, same formula); BLK on "
       "both (documented unsupported)",
       {{true, VEC, VEC, 1, 1, false, bf, false},
        {true, VEC, VEC, 8, 8, false, bf, false},
        {true, VEC, VEC, 33, 33, false, bf, false},
        {true, VEC, VEC, 64, 64, false, bf, false},
        {true, VEC, VEC, 256, 256, false, bf, false},
        {true, BLK, BLK, 64, 64, false, bf, false}}});
  sections.push_back(
      {"operands swapped: X=A (VEC), W=B (BLK, NVIDIA's sample pairing), D "
       "transposed",
       {{false, BLK, VEC, 1, 1, false, bf, false},
        {false, BLK, VEC, 8, 8, false, bf, false},
        {false, BLK, VEC, 33, 33, false, bf, false},
        {false, BLK, VEC, 64, 64, false, bf, false},
        {false, BLK, VEC, 256, 256, false, bf, false},
        {false, VEC, VEC, 64, 64, false, bf, false}}});
  sections.push_back({"controls with other formulas: tensor-wide (SCL) and outer-vector (OUT)",
                      {{true, SCL, SCL, 1, 1, false, bf, false},
                       {true, SCL, SCL, 64, 64, false, bf, false},
                       {true, OUT, OUT, 1, 1, false, bf, false},
                       {true, OUT, OUT, 64, 64, false, bf, false}}});
  for (const auto& [title, configs] : sections) {
    std::printf("-- %s\n", title);
    for (const Config& c : configs)
      if (!run(lt, dev, data, c)) return false;
  }
  cublasLtLoggerSetCallback(nullptr);
  cublasLtDestroy(lt);
  cudaFree(dev.workspace);
  cudaFree(dev.d);
  cudaFree(dev.ws);
  cudaFree(dev.xs);
  cudaFree(dev.w);
  cudaFree(dev.x);
  std::printf(
      "done. kmla's Blas needs the first section's lines with tok %% 8 == 0 to read "
      "'SUCCESS ... ok'.\n");
  return true;
}

}  // namespace

int main() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("probe_cublaslt_fp8: no CUDA device\n");
    return 0;
  }
  probe();
  return 0;
}
