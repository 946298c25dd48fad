// Element types, a non-owning tensor view used at every API edge, and an owning host
// tensor. Views are row-major and contiguous: kmla checks this instead of guessing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "kmla/error.hpp"

namespace kmla {

enum class DType : uint8_t { f32, f64, bf16, f16, e4m3, i32, i64, u8 };
enum class Device : uint8_t { cpu, cuda };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
const char* device_name(Device d);

inline constexpr int kMaxDims = 4;

// A row-major, contiguous view of someone else's memory.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int ndim = 0;
  int64_t shape[kMaxDims] = {0, 0, 0, 0};

  TensorView() = default;
  TensorView(void* data, DType dtype, std::initializer_list<int64_t> dims,
             Device device = Device::cpu);

  int64_t dim(int i) const;
  int64_t numel() const;
  size_t bytes() const { return size_t(numel()) * dtype_size(dtype); }
  std::string shape_str() const;

  template <class T>
  T* as() const { return static_cast<T*>(data); }
};

// Throws kmla::Error naming `what` unless `t` has this dtype, device and shape.
// A dimension given as -1 matches any size.
void check_tensor(const TensorView& t, const char* what, DType dtype,
                  std::initializer_list<int64_t> dims, Device device = Device::cpu);

// An owning, zero-initialised host buffer with a dtype and shape (64-byte aligned).
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::initializer_list<int64_t> dims);
  HostTensor(DType dtype, const std::vector<int64_t>& dims);

  TensorView view() const { return view_; }
  DType dtype() const { return view_.dtype; }
  int64_t dim(int i) const { return view_.dim(i); }
  int64_t numel() const { return view_.numel(); }
  size_t bytes() const { return view_.bytes(); }
  bool empty() const { return view_.data == nullptr; }

  template <class T>
  T* data() const { return static_cast<T*>(view_.data); }

 private:
  std::shared_ptr<std::byte[]> storage_;
  TensorView view_;
};

}  // namespace kmla
