// The CUDA backend's small public pieces: device presence and properties, owning device
// buffers, asynchronous host <-> device copies and kmla-owned device caches.
#include "cuda/common.cuh"
#include "kmla/cuda.hpp"

namespace kmla::cuda {

namespace {
cudaStream_t raw(Stream s) { return reinterpret_cast<cudaStream_t>(s); }
}  // namespace

bool available() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  cudaGetLastError();  // clear a failed query's error, so the next launch check does not see it
  return ok;
}

DeviceInfo device_info() {
  int dev = 0;
  KMLA_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp p{};
  KMLA_CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  DeviceInfo info;
  info.name = p.name;
  info.sm_count = p.multiProcessorCount;
  info.major = p.major;
  info.minor = p.minor;
  info.memory_bytes = p.totalGlobalMem;
  info.l2_bytes = size_t(p.l2CacheSize);
  return info;
}

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes) KMLA_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
}
DeviceBuffer::~DeviceBuffer() {
  if (ptr_) cudaFree(ptr_);
}
DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) {
  o.ptr_ = nullptr;
  o.bytes_ = 0;
}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_) cudaFree(ptr_);
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}
TensorView DeviceBuffer::view(DType dtype, std::initializer_list<int64_t> dims) const {
  TensorView v(ptr_, dtype, dims, Device::cuda);
  KMLA_CHECK(v.bytes() <= bytes_, "a device view of ", v.bytes(), " bytes does not fit a buffer of ",
             bytes_, " bytes");
  return v;
}

namespace {
void check_copy(const TensorView& src, const TensorView& dst, Device src_dev, Device dst_dev) {
  KMLA_CHECK(src.device == src_dev && dst.device == dst_dev, "copy from ", device_name(src.device),
             " to ", device_name(dst.device), " memory, expected ", device_name(src_dev), " to ",
             device_name(dst_dev));
  KMLA_CHECK(src.dtype == dst.dtype && src.numel() == dst.numel(), "copy of ", src.shape_str(), " ",
             dtype_name(src.dtype), " into ", dst.shape_str(), " ", dtype_name(dst.dtype));
}
}  // namespace

void copy_to_device(const TensorView& host, const TensorView& device, Stream stream) {
  check_copy(host, device, Device::cpu, Device::cuda);
  if (host.bytes())
    KMLA_CUDA_CHECK(cudaMemcpyAsync(device.data, host.data, host.bytes(), cudaMemcpyHostToDevice, raw(stream)));
}

void copy_to_host(const TensorView& device, const TensorView& host, Stream stream) {
  check_copy(device, host, Device::cuda, Device::cpu);
  if (host.bytes())
    KMLA_CUDA_CHECK(cudaMemcpyAsync(host.data, device.data, host.bytes(), cudaMemcpyDeviceToHost, raw(stream)));
}

DeviceCache DeviceCache::allocate(CacheFormat format, int block_size, int64_t num_blocks,
                                  float k_scale, TileScaleRule rule) {
  CacheGeometry geo{format, block_size, num_blocks, int64_t(block_size) * int64_t(cache_entry_bytes(format))};
  geo.validate();
  DeviceCache c;
  c.memory = DeviceBuffer(size_t(geo.block_stride * num_blocks));
  if (c.memory.bytes()) KMLA_CUDA_CHECK(cudaMemset(c.memory.data(), 0, c.memory.bytes()));
  c.cache = LatentCache::borrow(c.memory.data(), Device::cuda, format, block_size, num_blocks,
                                geo.block_stride, k_scale, rule);
  return c;
}

}  // namespace kmla::cuda
