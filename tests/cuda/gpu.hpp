// GPU test helpers: skip cleanly when no CUDA device is present (CI), and small device
// buffers for test data.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kmla::test {

inline bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define KMLA_REQUIRE_GPU() \
  do {                                                        \
    if (!::kmla::test::have_gpu()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

// An owning device buffer for tests (synchronous copies: tests may sync).
template <class T>
struct DevBuf {
  T* ptr = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t count) : n(count) {
    EXPECT_EQ(cudaMalloc(&ptr, std::max<size_t>(count, 1) * sizeof(T)), cudaSuccess);
  }
  explicit DevBuf(const std::vector<T>& host) : DevBuf(host.size()) { upload(host); }
  ~DevBuf() { cudaFree(ptr); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  void upload(const std::vector<T>& host) {
    EXPECT_EQ(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<T> download() const {
    std::vector<T> host(n);
    EXPECT_EQ(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }
  // Fills every byte with `byte` (0xFF poisons 16-bit and fp32 buffers with NaN).
  void fill_bytes(int byte) { EXPECT_EQ(cudaMemset(ptr, byte, n * sizeof(T)), cudaSuccess); }
};

// Sequence start offsets of a varlen batch: {0, l0, l0 + l1, ...} (cu_q / cu_k).
inline std::vector<int32_t> seq_offsets(const std::vector<int>& lens) {
  std::vector<int32_t> cu(1, 0);
  for (int l : lens) cu.push_back(cu.back() + l);
  return cu;
}

}  // namespace kmla::test
