#include "kmla/tensor.hpp"

#include <algorithm>
#include <cstring>
#include <new>
#include <sstream>

namespace kmla {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f64:
    case DType::i64: return 8;
    case DType::f32:
    case DType::i32: return 4;
    case DType::bf16:
    case DType::f16: return 2;
    case DType::e4m3:
    case DType::u8: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::e4m3: return "e4m3";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
  }
  return "?";
}

const char* device_name(Device d) { return d == Device::cpu ? "cpu" : "cuda"; }

TensorView::TensorView(void* d, DType t, std::initializer_list<int64_t> dims, Device dev)
    : data(d), dtype(t), device(dev) {
  KMLA_CHECK(dims.size() <= size_t(kMaxDims), "tensor rank ", dims.size(), " exceeds ", kMaxDims);
  for (int64_t n : dims) {
    KMLA_CHECK(n >= 0, "negative tensor dimension ", n);
    shape[ndim++] = n;
  }
}

int64_t TensorView::dim(int i) const {
  KMLA_CHECK(i >= 0 && i < ndim, "dimension index ", i, " out of range for a rank-", ndim, " tensor");
  return shape[i];
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return ndim == 0 ? 0 : n;
}

std::string TensorView::shape_str() const {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < ndim; ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

void check_tensor(const TensorView& t, const char* what, DType dtype,
                  std::initializer_list<int64_t> dims, Device device) {
  KMLA_CHECK(t.data != nullptr || t.numel() == 0, what, " is null");
  KMLA_CHECK(t.dtype == dtype, what, " has dtype ", dtype_name(t.dtype), ", expected ",
             dtype_name(dtype));
  KMLA_CHECK(t.device == device, what, " is on ", device_name(t.device), ", expected ",
             device_name(device));
  bool ok = t.ndim == int(dims.size());
  int i = 0;
  for (int64_t n : dims) {
    if (ok && n >= 0 && t.shape[i] != n) ok = false;
    ++i;
  }
  if (!ok) {
    std::ostringstream want;
    want << "[";
    i = 0;
    for (int64_t n : dims) want << (i++ ? ", " : "") << (n < 0 ? std::string("*") : std::to_string(n));
    want << "]";
    KMLA_CHECK(false, what, " has shape ", t.shape_str(), ", expected ", want.str());
  }
}

HostTensor::HostTensor(DType dtype, std::initializer_list<int64_t> dims)
    : HostTensor(dtype, std::vector<int64_t>(dims)) {}

HostTensor::HostTensor(DType dtype, const std::vector<int64_t>& dims) {
  KMLA_CHECK(dims.size() <= size_t(kMaxDims), "tensor rank ", dims.size(), " exceeds ", kMaxDims);
  view_.dtype = dtype;
  int64_t n = 1;
  for (int64_t d : dims) {
    KMLA_CHECK(d >= 0, "negative tensor dimension ", d);
    view_.shape[view_.ndim++] = d;
    n *= d;
  }
  const size_t bytes = std::max<size_t>(size_t(n) * dtype_size(dtype), 1);
  const size_t padded = (bytes + 63) / 64 * 64;
  auto* raw = static_cast<std::byte*>(::operator new[](padded, std::align_val_t(64)));
  std::memset(raw, 0, padded);
  storage_ = std::shared_ptr<std::byte[]>(
      raw, [](std::byte* p) { ::operator delete[](p, std::align_val_t(64)); });
  view_.data = raw;
}

}  // namespace kmla
