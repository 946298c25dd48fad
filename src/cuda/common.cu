#include <cstdlib>
#include <cstring>

#include "cuda/common.cuh"
#include "cuda/sm90.cuh"

namespace kmla::cuda {

CacheRef cache_ref(const LatentCache& cache) {
  KMLA_CHECK(cache.device() == Device::cuda, "the CUDA backend needs a cache in device memory, got a ",
             device_name(cache.device()), " cache");
  CacheRef r;
  r.base = cache.base();
  r.block_stride = cache.geometry().block_stride;
  r.block_size = cache.block_size();
  r.num_blocks = cache.num_blocks();
  r.format = cache.format();
  r.k_scale = cache.k_scale();
  r.tile_rule = cache.codec().tile_rule;
  return r;
}

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000,
                                                           cudaEnableDefault, &status);
    if (e != cudaSuccess) (void)cudaGetLastError();  // not sticky; clear it
    const bool found = e == cudaSuccess && status == cudaDriverEntryPointSuccess && f != nullptr;
    return found ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f) : nullptr;
  }();
  return fn;
}

// A 0|1 switch from the environment; unset or empty: `fallback`. Any other value is an error.
bool env_switch(const char* name, bool fallback) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return fallback;
  KMLA_CHECK(std::strcmp(env, "0") == 0 || std::strcmp(env, "1") == 0, name,
             " must be 0 or 1, got '", env, "'");
  return env[0] == '1';
}

// An integer in [lo, hi] from the environment; unset or empty: `fallback`.
int env_int_in(const char* name, int fallback, int lo, int hi) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return fallback;
  char* end = nullptr;
  const long v = std::strtol(env, &end, 10);
  KMLA_CHECK(*end == '\0' && v >= lo && v <= hi, name, " must be an integer in [", lo, ", ", hi,
             "], got '", env, "'");
  return int(v);
}

bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky; clear it
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

bool sm90a_kernel_runs_on(int device, const void* kernel,
                          std::atomic<int> (&answers)[kMaxSm90Devices]) {
  if (device < 0 || device >= kMaxSm90Devices) return false;
  int known = answers[device].load(std::memory_order_relaxed);
  if (known == 0) {
    int major = 0;
    KMLA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    bool runs = major == 9;
    if (runs) {
      cudaFuncAttributes attr{};
      KMLA_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
      runs = attr.binaryVersion >= 90 && attr.ptxVersion >= 90;
    }
    known = runs ? 2 : 1;
    answers[device].store(known, std::memory_order_relaxed);
  }
  return known == 2;
}

}  // namespace kmla::cuda
