// _kmla: the pybind11 extension behind `import kmla`. Thin bindings over the public C++ API
// (config, cache, batch planning, weights, the layer on the CPU and on CUDA, the public stages
// and the fp64 oracle); python/kmla/__init__.py adds the Pythonic glue and the torch ops.
//
// Arrays. Every array argument is either a NumPy array (buffer protocol) or a DLPack producer
// (a PyCapsule named "dltensor", or anything with __dlpack__, e.g. a torch tensor on the CPU
// or on CUDA). Matching dtypes are used in place, without a copy. NumPy has no bf16, so a
// NumPy float32 array where the API wants bf16/f16 activations is converted on the way in
// (one rounding) and, for results, back to float32 on the way out. Anything else (another
// dtype, a device the call does not run on, non-contiguous strides, more than 4 dims) raises
// kmla.Error naming the argument.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "kmla/batch.hpp"
#include "kmla/cache.hpp"
#include "kmla/checkpoint.hpp"
#include "kmla/config.hpp"
#include "kmla/error.hpp"
#include "kmla/hf_config.hpp"
#include "kmla/layer.hpp"
#include "kmla/numeric.hpp"
#include "kmla/reference.hpp"
#include "kmla/rope.hpp"
#include "kmla/stages.hpp"
#include "kmla/tensor.hpp"
#include "kmla/weights.hpp"
#include "verify/cases.hpp"
#ifdef KMLA_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kmla/cuda.hpp"
#endif

namespace py = pybind11;
using namespace kmla;

namespace {

// ---- DLPack (the public ABI of dlpack.h v0.x, "dltensor" capsules) -------------------------
struct DlDevice {
  int32_t device_type;  // 1 CPU, 2 CUDA, 3 CUDA pinned host
  int32_t device_id;
};
struct DlDataType {
  uint8_t code;  // 0 int, 1 uint, 2 float, 4 bfloat
  uint8_t bits;
  uint16_t lanes;
};
struct DlTensor {
  void* data;
  DlDevice device;
  int32_t ndim;
  DlDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null = compact row-major
  uint64_t byte_offset;
};
struct DlManagedTensor {
  DlTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DlManagedTensor* self);
};

constexpr int kDlCpu = 1, kDlCuda = 2, kDlCudaHost = 3;

std::optional<DType> dl_dtype(DlDataType t) {
  if (t.lanes != 1) return std::nullopt;
  if (t.code == 2 && t.bits == 32) return DType::f32;
  if (t.code == 2 && t.bits == 64) return DType::f64;
  if (t.code == 2 && t.bits == 16) return DType::f16;
  if (t.code == 4 && t.bits == 16) return DType::bf16;
  if (t.code == 0 && t.bits == 32) return DType::i32;
  if (t.code == 0 && t.bits == 64) return DType::i64;
  if (t.code == 1 && t.bits == 8) return DType::u8;
  if (t.code == 10 && t.bits == 8) return DType::e4m3;  // kDLFloat8_e4m3fn (DLPack 1.1)
  return std::nullopt;
}

std::string dl_dtype_str(DlDataType t) {
  std::ostringstream os;
  os << "(code " << int(t.code) << ", bits " << int(t.bits) << ", lanes " << t.lanes << ")";
  return os.str();
}

// One array argument seen as a TensorView. `hold` keeps what the view points into alive (the
// DLPack tensor, or the converted copy) until the Arr is destroyed, with the GIL held.
struct Arr {
  TensorView view;
  std::shared_ptr<void> hold;
  py::object f32_target;  // NumPy float32 result array that a converted copy goes back into
  bool present = false;

  // Converted 16-bit results back into the caller's float32 array.
  void copy_back() const {
    if (f32_target.is_none() || !f32_target) return;
    auto a = py::reinterpret_borrow<py::array_t<float>>(f32_target);
    float* dst = a.mutable_data();
    const auto* src = static_cast<const uint16_t*>(view.data);
    const bool bf = view.dtype == DType::bf16;
    for (int64_t i = 0; i < view.numel(); ++i)
      dst[i] = bf ? bf16_to_float(src[i]) : fp16_to_float(src[i]);
  }
};

void set_shape(TensorView& v, const char* what, int ndim, const int64_t* shape) {
  KMLA_CHECK(ndim <= kMaxDims, what, ": ", ndim, " dimensions, kmla takes at most ", kMaxDims);
  v.ndim = ndim;
  for (int i = 0; i < ndim; ++i) v.shape[i] = shape[i];
}

std::string shape_of(int ndim, const int64_t* shape) {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < ndim; ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

DType np_dtype(const py::array& a, const char* what) {
  const py::dtype d = a.dtype();
  const char k = d.kind();
  const auto n = d.itemsize();
  if (k == 'f' && n == 4) return DType::f32;
  if (k == 'f' && n == 8) return DType::f64;
  if (k == 'f' && n == 2) return DType::f16;
  if (k == 'i' && n == 4) return DType::i32;
  if (k == 'i' && n == 8) return DType::i64;
  if (k == 'u' && n == 1) return DType::u8;
  KMLA_CHECK(false, what, ": NumPy dtype ", std::string(py::str(py::handle(d))),
             " is not accepted");
}

std::string want_str(DType want) {
  std::string s = dtype_name(want);
  if (want == DType::bf16 || want == DType::f16) s += " (a torch tensor) or float32 (NumPy)";
  return s;
}

// Fills a fresh 16-bit copy of float32 values.
std::shared_ptr<void> to_16bit(const float* src, int64_t n, DType t) {
  std::shared_ptr<uint16_t[]> buf(new uint16_t[size_t(std::max<int64_t>(n, 1))]);
  for (int64_t i = 0; i < n; ++i)
    buf[i] = t == DType::bf16 ? float_to_bf16(src[i]) : float_to_fp16(src[i]);
  return buf;
}

struct ArgSpec {
  DType dtype;                  // what the C++ call takes
  Device device = Device::cpu;  // where the call runs
  bool writable = false;        // an output
  bool convert_f32 = true;      // NumPy float32 may stand in for a 16-bit dtype
  bool any_dtype = false;       // raw memory (caches): any dtype, viewed as bytes
  bool any_device = false;      // the call runs where the tensor is
};

Arr from_numpy(const py::array& a, const char* what, const ArgSpec& spec) {
  Arr r;
  r.present = true;
  KMLA_CHECK(spec.device == Device::cpu, what, ": a NumPy array is host memory, this call runs on ",
             device_name(spec.device), " (pass a torch tensor on the GPU)");
  KMLA_CHECK(
      a.flags() & py::array::c_style, what, ": array is not C-contiguous (strides",
      [&] {
        std::ostringstream os;
        for (int i = 0; i < a.ndim(); ++i) os << " " << a.strides(i);
        return os.str();
      }(),
      "); pass numpy.ascontiguousarray(x)");
  KMLA_CHECK(!spec.writable || a.writeable(), what, ": output array is read-only");
  std::vector<int64_t> shape(a.shape(), a.shape() + a.ndim());
  const DType got = np_dtype(a, what);
  set_shape(r.view, what, int(a.ndim()), shape.data());
  r.view.device = Device::cpu;
  if (spec.any_dtype || got == spec.dtype) {
    r.view.dtype = got;
    r.view.data = const_cast<void*>(a.data());
    r.hold = std::make_shared<py::object>(a);  // freed with the GIL held (Arr dies under it)
    return r;
  }
  const bool sixteen = spec.dtype == DType::bf16 || spec.dtype == DType::f16;
  KMLA_CHECK(sixteen && spec.convert_f32 && got == DType::f32, what, ": dtype ", dtype_name(got),
             ", expected ", want_str(spec.dtype));
  r.view.dtype = spec.dtype;
  r.hold = to_16bit(static_cast<const float*>(a.data()), int64_t(a.size()), spec.dtype);
  r.view.data = r.hold.get();
  if (spec.writable) r.f32_target = a;
  return r;
}

Arr from_capsule(py::capsule cap, const char* what, const ArgSpec& spec) {
  KMLA_CHECK(std::string(cap.name() ? cap.name() : "") == "dltensor", what,
             ": a DLPack capsule must be named 'dltensor' (an unused capsule), got '",
             cap.name() ? cap.name() : "", "'");
  auto* m = static_cast<DlManagedTensor*>(PyCapsule_GetPointer(cap.ptr(), "dltensor"));
  KMLA_CHECK(m != nullptr, what, ": empty DLPack capsule");
  // We consume it: the producer's capsule destructor must no longer call the deleter.
  PyCapsule_SetName(cap.ptr(), "used_dltensor");
  Arr r;
  r.present = true;
  r.hold = std::shared_ptr<void>(m, [](void* p) {
    auto* mt = static_cast<DlManagedTensor*>(p);
    if (mt->deleter) mt->deleter(mt);
  });
  const DlTensor& t = m->dl_tensor;
  const std::string shape = shape_of(t.ndim, t.shape);
  const Device dev = t.device.device_type == kDlCuda ? Device::cuda : Device::cpu;
  KMLA_CHECK(t.device.device_type == kDlCpu || t.device.device_type == kDlCuda ||
                 t.device.device_type == kDlCudaHost,
             what, ": DLPack device type ", t.device.device_type,
             " is not supported (CPU or CUDA)");
  KMLA_CHECK(spec.any_device || dev == spec.device, what, ": tensor is on ", device_name(dev),
             ", this call runs on ", device_name(spec.device));
  const std::optional<DType> dt = dl_dtype(t.dtype);
  KMLA_CHECK(dt.has_value(), what, ": DLPack dtype ", dl_dtype_str(t.dtype), " is not supported");
  KMLA_CHECK(spec.any_dtype || *dt == spec.dtype, what, ": dtype ", dtype_name(*dt), ", expected ",
             want_str(spec.dtype));
  if (t.strides) {
    int64_t expect = 1;
    for (int i = t.ndim - 1; i >= 0; --i) {
      KMLA_CHECK(t.shape[i] == 1 || t.strides[i] == expect, what, ": tensor of shape ", shape,
                 " is not contiguous (stride ", t.strides[i], " in dim ", i, ", expected ", expect,
                 "); pass x.contiguous()");
      expect *= t.shape[i];
    }
  }
  set_shape(r.view, what, t.ndim, t.shape);
  r.view.dtype = *dt;
  r.view.device = dev;
  r.view.data = static_cast<std::byte*>(t.data) + t.byte_offset;
  return r;
}

// Where an array lives, without consuming it: NumPy and lists on the host, DLPack capsules and
// producers by their device.
Device peek_device(py::handle obj) {
  if (py::isinstance<py::array>(obj)) return Device::cpu;
  if (py::isinstance<py::capsule>(obj)) {
    auto cap = py::reinterpret_borrow<py::capsule>(obj);
    if (cap.name() && std::string(cap.name()) == "dltensor") {
      auto* m = static_cast<DlManagedTensor*>(PyCapsule_GetPointer(obj.ptr(), "dltensor"));
      if (m && m->dl_tensor.device.device_type == kDlCuda) return Device::cuda;
    }
    return Device::cpu;
  }
  if (py::hasattr(obj, "__dlpack_device__"))
    return obj.attr("__dlpack_device__")().cast<py::tuple>()[0].cast<int>() == kDlCuda
               ? Device::cuda
               : Device::cpu;
  return Device::cpu;
}

// `stream`: the CUDA stream the call will use, handed to __dlpack__ so the producer orders
// its pending work before it (no-op when it is the producer's current stream).
Arr arg(py::handle obj, const char* what, const ArgSpec& spec, intptr_t stream = 0) {
  KMLA_CHECK(!obj.is_none(), what, ": got None, expected an array");
  if (py::isinstance<py::array>(obj))
    return from_numpy(py::reinterpret_borrow<py::array>(obj), what, spec);
  if (py::isinstance<py::capsule>(obj))
    return from_capsule(py::reinterpret_borrow<py::capsule>(obj), what, spec);
  if (py::hasattr(obj, "__dlpack__")) {
    py::object cap;
    py::tuple dev = obj.attr("__dlpack_device__")();
    if (dev[0].cast<int>() == kDlCuda)
      cap = obj.attr("__dlpack__")(py::arg("stream") = stream == 0 ? intptr_t(1) : stream);
    else
      cap = obj.attr("__dlpack__")();
    return from_capsule(py::reinterpret_borrow<py::capsule>(cap), what, spec);
  }
  // Lists and scalars: through NumPy (a copy, never an output).
  KMLA_CHECK(!spec.writable, what, ": an output must be a NumPy array or a DLPack tensor, got ",
             std::string(py::str(obj.get_type())));
  py::array a = py::array::ensure(obj, py::array::c_style);
  KMLA_CHECK(a, what, ": cannot read ", std::string(py::str(obj.get_type())), " as an array");
  return from_numpy(a, what, spec);
}

[[maybe_unused]] Arr opt_arg(py::handle obj, const char* what, const ArgSpec& spec,
                             intptr_t stream = 0) {
  if (obj.is_none()) return Arr{};
  return arg(obj, what, spec, stream);
}

DType parse_dtype(const std::string& s) {
  if (s == "bf16" || s == "bfloat16") return DType::bf16;
  if (s == "f16" || s == "fp16" || s == "float16") return DType::f16;
  KMLA_CHECK(false, "activation dtype '", s, "' is not bf16 or f16");
}

Device parse_device(const std::string& s) {
  if (s == "cpu") return Device::cpu;
  if (s == "cuda" || s.rfind("cuda:", 0) == 0) return Device::cuda;
  KMLA_CHECK(false, "device '", s, "' is not cpu or cuda");
}

TileScaleRule parse_rule(const std::string& s) {
  if (s == "power_of_two") return TileScaleRule::power_of_two;
  if (s == "amax_448") return TileScaleRule::amax_448;
  KMLA_CHECK(false, "tile scale rule '", s, "' is not power_of_two or amax_448");
}

py::array_t<float> new_f32(std::initializer_list<int64_t> dims) {
  return py::array_t<float>(std::vector<py::ssize_t>(dims.begin(), dims.end()));
}

// A 16-bit result computed into a fresh HostTensor and returned as NumPy float32.
py::array_t<float> to_f32(const HostTensor& t) {
  std::vector<py::ssize_t> dims;
  for (int i = 0; i < t.view().ndim; ++i) dims.push_back(t.dim(i));
  py::array_t<float> a(dims);
  float* d = a.mutable_data();
  const auto* s = t.data<uint16_t>();
  const bool bf = t.dtype() == DType::bf16;
  for (int64_t i = 0; i < t.numel(); ++i) d[i] = bf ? bf16_to_float(s[i]) : fp16_to_float(s[i]);
  return a;
}

template <class T>
py::array_t<T> vec_array(const std::vector<T>& v) {
  py::array_t<T> a(py::ssize_t(v.size()));
  if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(T));
  return a;
}

std::vector<int32_t> int_list(py::handle seq) {
  std::vector<int32_t> v;
  for (py::handle x : seq) v.push_back(x.cast<int32_t>());
  return v;
}

// ---- the cache ------------------------------------------------------------------------------
// A LatentCache plus what its memory belongs to: kmla (host), a kmla DeviceCache, or a
// caller's array (kept alive here).
struct PyCache {
  LatentCache cache;
#ifdef KMLA_HAVE_CUDA
  std::shared_ptr<cuda::DeviceCache> device_owned;
#endif
  std::shared_ptr<void> borrowed;  // the caller's array (Arr::hold)

  int64_t total_bytes() const { return cache.geometry().block_stride * cache.num_blocks(); }
};

std::shared_ptr<PyCache> cache_allocate(const std::string& format, int block_size,
                                        int64_t num_blocks, float k_scale, const std::string& rule,
                                        const std::string& device) {
  auto c = std::make_shared<PyCache>();
  const CacheFormat f = parse_cache_format(format);
  if (parse_device(device) == Device::cpu) {
    c->cache = LatentCache::allocate(f, block_size, num_blocks, k_scale, parse_rule(rule));
    return c;
  }
#ifdef KMLA_HAVE_CUDA
  c->device_owned = std::make_shared<cuda::DeviceCache>(
      cuda::DeviceCache::allocate(f, block_size, num_blocks, k_scale, parse_rule(rule)));
  c->cache = c->device_owned->cache;
  return c;
#else
  KMLA_CHECK(false, "this kmla build has no CUDA backend: cannot allocate a cache on ", device);
#endif
}

// A cache over the caller's memory: any C-contiguous array whose dim 0 counts blocks; the
// block stride is its bytes / dim 0.
std::shared_ptr<PyCache> cache_borrow(py::handle tensor, const std::string& format, int block_size,
                                      float k_scale, const std::string& rule, intptr_t stream) {
  ArgSpec spec{DType::u8, Device::cpu, true, false, true, true};
  Arr a = arg(tensor, "cache", spec, stream);
  const Device dev = a.view.device;
  KMLA_CHECK(a.view.ndim >= 1 && a.view.dim(0) > 0, "cache: array of shape ", a.view.shape_str(),
             " has no blocks (dim 0 counts blocks)");
  const int64_t blocks = a.view.dim(0);
  auto c = std::make_shared<PyCache>();
  c->cache = LatentCache::borrow(a.view.data, dev, parse_cache_format(format), block_size, blocks,
                                 int64_t(a.view.bytes()) / blocks, k_scale, parse_rule(rule));
  c->borrowed = a.hold;
  return c;
}

#ifdef KMLA_HAVE_CUDA
void cuda_check(cudaError_t e, const char* what) {
  KMLA_CHECK(e == cudaSuccess, what, ": ", cudaGetErrorString(e));
}
#endif

// Copies `bytes` between two caches' memories (either side on the host or the device);
// synchronous.
void copy_cache_bytes(const PyCache& dst, const PyCache& src) {
  KMLA_CHECK(dst.total_bytes() == src.total_bytes(), "copy_from: caches hold ", dst.total_bytes(),
             " and ", src.total_bytes(), " bytes");
  if (dst.cache.device() == Device::cpu && src.cache.device() == Device::cpu) {
    std::memmove(dst.cache.base(), src.cache.base(), size_t(src.total_bytes()));
    return;
  }
#ifdef KMLA_HAVE_CUDA
  cuda_check(
      cudaMemcpy(dst.cache.base(), src.cache.base(), size_t(src.total_bytes()), cudaMemcpyDefault),
      "cache copy");
#else
  KMLA_CHECK(false, "this kmla build has no CUDA backend");
#endif
}

// The whole cache's bytes as NumPy uint8 [num_blocks, block_stride]: a view of host memory,
// a copy of device memory.
py::array cache_bytes(const std::shared_ptr<PyCache>& c) {
  const int64_t blocks = c->cache.num_blocks(), stride = c->cache.geometry().block_stride;
  if (c->cache.device() == Device::cpu) {
    py::capsule owner(new std::shared_ptr<PyCache>(c),
                      [](void* p) { delete static_cast<std::shared_ptr<PyCache>*>(p); });
    return py::array_t<uint8_t>({blocks, stride}, {stride, int64_t(1)},
                                reinterpret_cast<uint8_t*>(c->cache.base()), owner);
  }
  py::array_t<uint8_t> a({blocks, stride});
  PyCache host;
  host.cache = LatentCache::borrow(a.mutable_data(), Device::cpu, c->cache.format(),
                                   c->cache.block_size(), blocks, stride);
  copy_cache_bytes(host, *c);
  return a;
}

std::shared_ptr<PyCache> cache_to_host(const std::shared_ptr<PyCache>& c) {
  auto h = std::make_shared<PyCache>();
  if (c->cache.device() == Device::cpu) {
    h->cache = c->cache.clone();
    return h;
  }
  const CacheGeometry& g = c->cache.geometry();
  // Same geometry as the device cache (block stride included), kmla-owned host memory.
  auto bytes = std::shared_ptr<std::byte[]>(new std::byte[size_t(c->total_bytes())]);
  h->borrowed = bytes;
  h->cache = LatentCache::borrow(bytes.get(), Device::cpu, g.format, g.block_size, g.num_blocks,
                                 g.block_stride, c->cache.k_scale(), c->cache.codec().tile_rule);
  copy_cache_bytes(*h, *c);
  return h;
}

// ---- the layer ------------------------------------------------------------------------------
struct PyLayer {
  MlaConfig cfg;
  std::shared_ptr<const MlaWeights> weights;
  std::shared_ptr<const RopeTable> rope;
  DType activation = DType::bf16;
  bool fp8_prefill = false;
  Device device = Device::cpu;
  std::unique_ptr<MlaLayer> cpu;
#ifdef KMLA_HAVE_CUDA
  std::unique_ptr<cuda::Layer> gpu;
#endif
};

std::shared_ptr<PyLayer> make_layer(const MlaConfig& cfg, const MlaWeights& w,
                                    const std::string& activation, bool fp8_prefill,
                                    bool partial_output, const std::string& device, int num_threads,
                                    bool portable, int64_t rope_rows, bool tune_gemms) {
  auto l = std::make_shared<PyLayer>();
  l->cfg = cfg;
  l->weights = std::make_shared<const MlaWeights>(w);
  l->activation = parse_dtype(activation);
  l->fp8_prefill = fp8_prefill;
  l->device = parse_device(device);
  if (cfg.use_rope) l->rope = RopeTable::build(cfg, rope_rows);
  if (l->device == Device::cpu) {
    LayerOptions o;
    o.activation = l->activation;
    o.fp8_prefill = fp8_prefill;
    o.partial_output = partial_output;
    o.num_threads = num_threads;
    l->cpu = std::make_unique<MlaLayer>(cfg, w, o, l->rope);
    return l;
  }
#ifdef KMLA_HAVE_CUDA
  KMLA_CHECK(cuda::available(), "device 'cuda': no usable GPU");
  cuda::LayerOptions o;
  o.activation = l->activation;
  o.fp8_prefill = fp8_prefill;
  o.partial_output = partial_output;
  o.portable = portable;
  o.tune_gemms = tune_gemms;
  l->gpu = std::make_unique<cuda::Layer>(cfg, w, o, l->rope);
  return l;
#else
  KMLA_CHECK(false, "this kmla build has no CUDA backend: cannot run a layer on ", device);
#endif
}

#ifdef KMLA_HAVE_CUDA
cuda::Stream as_stream(intptr_t s) { return reinterpret_cast<cuda::Stream>(s); }
#endif

// forward(positions, hidden, md, cache, out=None, stream=0) -> out (NumPy float32 when hidden was
// NumPy float32 and no out was given; otherwise `out`).
py::object layer_forward(PyLayer& l, py::handle positions, py::handle hidden,
                         const BatchMetadata* md, PyCache& cache, py::handle out, intptr_t stream) {
  KMLA_CHECK(cache.cache.device() == l.device, "cache is in ", device_name(cache.cache.device()),
             " memory, the layer runs on ", device_name(l.device));
  Arr pos = arg(positions, "positions", {DType::i64, l.device}, stream);
  Arr hid = arg(hidden, "hidden_states", {l.activation, l.device}, stream);
  py::object result;
  HostTensor own;
  Arr o;
  if (out.is_none()) {
    KMLA_CHECK(
        l.device == Device::cpu && hid.hold && py::isinstance<py::array>(hidden),
        "out: required unless hidden_states is a NumPy array (allocate it like hidden_states)");
    own = HostTensor(l.activation, {hid.view.dim(0), hid.view.ndim > 1 ? hid.view.dim(1) : 0});
    o.view = own.view();
  } else {
    o = arg(out, "out", {l.activation, l.device, true}, stream);
    result = py::reinterpret_borrow<py::object>(out);
  }
  {
    py::gil_scoped_release nogil;
    if (l.device == Device::cpu) {
      l.cpu->forward(pos.view, hid.view, md, cache.cache, o.view);
    } else {
#ifdef KMLA_HAVE_CUDA
      l.gpu->forward(pos.view, hid.view, md, cache.cache, o.view, as_stream(stream));
#endif
    }
  }
  o.copy_back();
  if (out.is_none()) return to_f32(own);
  return result;
}

#ifdef KMLA_HAVE_CUDA
// A planned batch for Layer::run (kept alive by Python as long as a captured graph uses it).
struct PyPlan {
  cuda::Plan plan;
  BatchMetadata md;
};
#endif

// The oracle on the layer's config, weights and RoPE table. Writes the new rows into `cache`
// (a host cache; pass a copy). Returns (out, attn_out) as float64 NumPy arrays.
py::tuple oracle_forward(const PyLayer& l, py::handle positions, py::handle hidden,
                         const BatchMetadata* md, PyCache& cache, const std::string& rounding) {
  KMLA_CHECK(cache.cache.device() == Device::cpu,
             "the oracle reads a host cache: pass cache.to_host()");
  Arr pos = arg(positions, "positions", {DType::i64});
  Arr hid = arg(hidden, "hidden_states", {l.activation});
  reference::Options ro;
  KMLA_CHECK(rounding == "exact" || rounding == "seed", "rounding '", rounding,
             "' is not exact or seed");
  ro.rounding = rounding == "exact" ? reference::Rounding::exact : reference::Rounding::seed;
  ro.activation = l.activation;
  ro.fp8_prefill = l.fp8_prefill;
  reference::Result r;
  {
    py::gil_scoped_release nogil;
    r = reference::forward(l.cfg, *l.weights, l.rope.get(), pos.view, hid.view, md, cache.cache,
                           ro);
  }
  const int64_t rows = hid.view.dim(0);
  py::array_t<double> out({rows, int64_t(l.cfg.hidden_size)});
  py::array_t<double> attn({rows, int64_t(l.cfg.local_heads()) * kVDim});
  std::memcpy(out.mutable_data(), r.out.data(), r.out.size() * sizeof(double));
  std::memcpy(attn.mutable_data(), r.attn_out.data(), r.attn_out.size() * sizeof(double));
  return py::make_tuple(out, attn);
}

// ---- weights --------------------------------------------------------------------------------
HostTensor* weight_field(MlaWeights& w, const std::string& name) {
  if (name == "q_a_proj") return &w.q_a_proj;
  if (name == "q_a_layernorm") return &w.q_a_layernorm;
  if (name == "q_b_proj") return &w.q_b_proj;
  if (name == "q_proj") return &w.q_proj;
  if (name == "kv_a_proj_with_mqa") return &w.kv_a_proj_with_mqa;
  if (name == "kv_a_layernorm") return &w.kv_a_layernorm;
  if (name == "kv_b_proj") return &w.kv_b_proj;
  if (name == "g_proj") return &w.g_proj;
  if (name == "o_proj") return &w.o_proj;
  KMLA_CHECK(
      false, "'", name, "' is not an MLA weight name (",
      [] {
        std::string s;
        for (const auto& n :
             {"q_a_proj", "q_a_layernorm", "q_b_proj", "q_proj", "kv_a_proj_with_mqa",
              "kv_a_layernorm", "kv_b_proj", "g_proj", "o_proj"})
          s += std::string(s.empty() ? "" : ", ") + n;
        return s;
      }(),
      ")");
}

const char* kWeightNames[] = {
    "q_a_proj",       "q_a_layernorm", "q_b_proj", "q_proj", "kv_a_proj_with_mqa",
    "kv_a_layernorm", "kv_b_proj",     "g_proj",   "o_proj"};

// From a dict name -> array (NumPy float32, rounded once; or 16-bit tensors of `dtype`, copied).
MlaWeights weights_from_arrays(const MlaConfig& cfg, const py::dict& arrays,
                               const std::string& dtype, float k_scale, float q_scale) {
  const DType act = parse_dtype(dtype);
  MlaWeights w;
  for (auto item : arrays) {
    const std::string name = item.first.cast<std::string>();
    HostTensor* dst = weight_field(w, name);
    Arr a = arg(item.second, name.c_str(), {act});
    std::vector<int64_t> dims(a.view.shape, a.view.shape + a.view.ndim);
    *dst = HostTensor(act, dims);
    std::memcpy(dst->data<void>(), a.view.data, dst->bytes());
  }
  w.k_scale = k_scale;
  w.q_scale = q_scale;
  w.validate(cfg);
  return w;
}

py::dict weights_arrays(const MlaWeights& w) {
  py::dict d;
  MlaWeights& m = const_cast<MlaWeights&>(w);
  for (const char* n : kWeightNames) {
    const HostTensor* t = weight_field(m, n);
    if (!t->empty()) d[n] = to_f32(*t);
  }
  return d;
}

// ---- stages ---------------------------------------------------------------------------------
// The activation dtype an array carries: its own for 16-bit tensors, `fallback` for NumPy float32.
DType act_of(py::handle x, const std::string& fallback) {
  if (!py::isinstance<py::array>(x) && py::hasattr(x, "dtype")) {
    const std::string s = py::str(x.attr("dtype"));
    if (s == "torch.float16") return DType::f16;
    if (s == "torch.bfloat16") return DType::bf16;
  }
  return parse_dtype(fallback);
}

// An output of a stage: the caller's array, or a fresh NumPy float32 / 16-bit buffer.
struct OutArg {
  Arr arr;
  HostTensor own;
  py::object result;
};
OutArg out_arg(py::handle given, const char* what, DType dtype, Device dev,
               std::vector<int64_t> dims, intptr_t stream, bool f32_when_own) {
  OutArg o;
  if (!given.is_none()) {
    o.arr = arg(given, what, {dtype, dev, true}, stream);
    o.result = py::reinterpret_borrow<py::object>(given);
    return o;
  }
  KMLA_CHECK(dev == Device::cpu, what, ": must be given for device tensors");
  o.own = HostTensor(dtype, dims);
  o.arr.view = o.own.view();
  (void)f32_when_own;
  return o;
}
py::object out_result(OutArg& o) {
  o.arr.copy_back();
  if (!o.result.is_none() && o.result) return o.result;
  if (o.own.dtype() == DType::bf16 || o.own.dtype() == DType::f16) return to_f32(o.own);
  std::vector<py::ssize_t> dims;
  for (int i = 0; i < o.own.view().ndim; ++i) dims.push_back(o.own.dim(i));
  py::array_t<float> a(dims);
  std::memcpy(a.mutable_data(), o.own.data<void>(), o.own.bytes());
  return a;
}

}  // namespace

PYBIND11_MODULE(_kmla, m) {
  m.doc() = "kmla: the Multi-head Latent Attention layer (C++ engine bindings)";
  py::register_exception<Error>(m, "Error", PyExc_RuntimeError);

#ifdef KMLA_HAVE_CUDA
  m.attr("built_with_cuda") = true;
  m.def("cuda_available", [] { return cuda::available(); });
#else
  m.attr("built_with_cuda") = false;
  m.def("cuda_available", [] { return false; });
#endif
  m.def("cache_entry_bytes",
        [](const std::string& f) { return cache_entry_bytes(parse_cache_format(f)); });
  m.def("cache_formats", [] {
    return std::vector<std::string>{"bf16", "fp16", "fp8", "fp8_ds_mla"};
  });

  // ---- config ----
  py::class_<RopeParams>(m, "RopeParams")
      .def(py::init<>())
      .def_property(
          "type", [](const RopeParams& p) { return std::string(rope_type_name(p.type)); },
          [](RopeParams& p, const std::string& t) {
            p.type = t == "default" ? RopeType::default_
                                    : map_rope_type(t, t != "deepseek_llama_scaling");
          })
      .def_readwrite("theta", &RopeParams::theta)
      .def_readwrite("factor", &RopeParams::factor)
      .def_readwrite("original_max_position_embeddings",
                     &RopeParams::original_max_position_embeddings)
      .def_readwrite("beta_fast", &RopeParams::beta_fast)
      .def_readwrite("beta_slow", &RopeParams::beta_slow)
      .def_readwrite("mscale", &RopeParams::mscale)
      .def_readwrite("mscale_all_dim", &RopeParams::mscale_all_dim)
      .def_readwrite("attn_factor", &RopeParams::attn_factor)
      .def_readwrite("extrapolation_factor", &RopeParams::extrapolation_factor);

  py::class_<MlaConfig>(m, "MlaConfig")
      .def(py::init<>())
      .def_static(
          "preset", [](const std::string& n) { return MlaConfig::preset(n); }, py::arg("name"))
      .def_static("preset_names", &MlaConfig::preset_names)
      .def_static(
          "from_hf", [](const std::string& path) { return load_hf_config(path).mla; },
          py::arg("path"),
          "The MLA config of a Hugging Face config.json (or a model directory holding one).")
      .def_static("small", &verify::small_model, py::arg("preset"), py::arg("heads") = 3,
                  py::arg("small") = true,
                  "A preset shrunk for quick tests: `heads` heads and, with small, hidden 256 and "
                  "q-LoRA 96.")
      .def_readwrite("name", &MlaConfig::name)
      .def_readwrite("hidden_size", &MlaConfig::hidden_size)
      .def_readwrite("num_heads", &MlaConfig::num_heads)
      .def_readwrite("q_lora_rank", &MlaConfig::q_lora_rank)
      .def_readwrite("kv_lora_rank", &MlaConfig::kv_lora_rank)
      .def_readwrite("qk_nope_head_dim", &MlaConfig::qk_nope_head_dim)
      .def_readwrite("qk_rope_head_dim", &MlaConfig::qk_rope_head_dim)
      .def_readwrite("v_head_dim", &MlaConfig::v_head_dim)
      .def_readwrite("rms_norm_eps", &MlaConfig::rms_norm_eps)
      .def_readwrite("use_rope", &MlaConfig::use_rope)
      .def_readwrite("rope", &MlaConfig::rope)
      .def_readwrite("use_output_gate", &MlaConfig::use_output_gate)
      .def_readwrite("non_causal_multi_token_decode", &MlaConfig::non_causal_multi_token_decode)
      .def_readwrite("max_position_embeddings", &MlaConfig::max_position_embeddings)
      .def_readwrite("tp_rank", &MlaConfig::tp_rank)
      .def_readwrite("tp_size", &MlaConfig::tp_size)
      .def("validate", &MlaConfig::validate)
      .def_property_readonly("local_heads", &MlaConfig::local_heads)
      .def_property_readonly("softmax_scale", &MlaConfig::softmax_scale)
      .def_property_readonly("rope_table_rows", &MlaConfig::rope_table_rows)
      .def("tp_slice", &MlaConfig::tp_slice, py::arg("rank"), py::arg("world_size"))
      .def("__repr__", [](const MlaConfig& c) {
        std::ostringstream os;
        os << "MlaConfig(name='" << c.name << "', hidden_size=" << c.hidden_size
           << ", num_heads=" << c.num_heads
           << ", q_lora_rank=" << (c.q_lora_rank ? std::to_string(*c.q_lora_rank) : "None")
           << ", use_rope=" << (c.use_rope ? "True" : "False")
           << ", use_output_gate=" << (c.use_output_gate ? "True" : "False") << ", tp=" << c.tp_rank
           << "/" << c.tp_size << ")";
        return os.str();
      });

  py::class_<HfModelConfig>(m, "HfModelConfig")
      .def_readonly("mla", &HfModelConfig::mla)
      .def_readonly("model_type", &HfModelConfig::model_type)
      .def_readonly("num_hidden_layers", &HfModelConfig::num_hidden_layers)
      .def_readonly("mla_layers", &HfModelConfig::mla_layers)
      .def_readonly("quant_method", &HfModelConfig::quant_method)
      .def_readonly("weight_block_size", &HfModelConfig::weight_block_size);
  m.def("load_hf_config", &load_hf_config, py::arg("path"));

  // ---- RoPE ----
  py::class_<RopeTable, std::shared_ptr<RopeTable>>(m, "RopeTable")
      .def_static(
          "build",
          [](const MlaConfig& c, int64_t rows) {
            return std::const_pointer_cast<RopeTable>(RopeTable::build(c, rows));
          },
          py::arg("config"), py::arg("rows") = 0)
      .def_property_readonly("rows", &RopeTable::rows)
      .def(
          "table",
          [](const RopeTable& t) {
            py::array_t<float> a({t.rows(), int64_t(kRopeDim)});
            std::memcpy(a.mutable_data(), t.row(0), size_t(t.rows()) * kRopeDim * sizeof(float));
            return a;
          },
          "[rows, 64] float32: per position 32 cos then 32 sin");

  // ---- cache ----
  py::class_<PyCache, std::shared_ptr<PyCache>>(m, "Cache")
      .def_static("allocate", &cache_allocate, py::arg("format"), py::arg("block_size"),
                  py::arg("num_blocks"), py::arg("k_scale") = 1.0f,
                  py::arg("tile_rule") = "power_of_two", py::arg("device") = "cpu")
      .def_static("borrow", &cache_borrow, py::arg("tensor"), py::arg("format"),
                  py::arg("block_size"), py::arg("k_scale") = 1.0f,
                  py::arg("tile_rule") = "power_of_two", py::arg("stream") = 0)
      .def_property_readonly(
          "format",
          [](const PyCache& c) { return std::string(cache_format_name(c.cache.format())); })
      .def_property_readonly("block_size", [](const PyCache& c) { return c.cache.block_size(); })
      .def_property_readonly("num_blocks", [](const PyCache& c) { return c.cache.num_blocks(); })
      .def_property_readonly("num_slots",
                             [](const PyCache& c) { return c.cache.geometry().num_slots(); })
      .def_property_readonly("block_stride",
                             [](const PyCache& c) { return c.cache.geometry().block_stride; })
      .def_property_readonly("entry_bytes",
                             [](const PyCache& c) { return c.cache.geometry().entry_bytes(); })
      .def_property_readonly(
          "device", [](const PyCache& c) { return std::string(device_name(c.cache.device())); })
      .def_property_readonly("owns_memory", [](const PyCache& c) { return c.cache.owns_memory(); })
      .def_property_readonly(
          "data_ptr", [](const PyCache& c) { return reinterpret_cast<intptr_t>(c.cache.base()); })
      .def_property(
          "k_scale", [](const PyCache& c) { return c.cache.k_scale(); },
          [](PyCache& c, float s) { c.cache.set_k_scale(s); })
      .def_property_readonly(
          "tile_rule",
          [](const PyCache& c) {
            return std::string(c.cache.codec().tile_rule == TileScaleRule::power_of_two
                                   ? "power_of_two"
                                   : "amax_448");
          })
      .def("bytes", &cache_bytes,
           "All bytes, uint8 [num_blocks, block_stride]: a view (host) or a copy (device).")
      .def("to_host", &cache_to_host, "A host copy with the same geometry.")
      .def(
          "copy_from", [](PyCache& d, const PyCache& s) { copy_cache_bytes(d, s); },
          py::arg("other"))
      .def(
          "fill",
          [](PyCache& c, int byte) {
            KMLA_CHECK(c.cache.device() == Device::cpu, "fill: host caches only");
            std::memset(c.cache.base(), byte, size_t(c.total_bytes()));
          },
          py::arg("byte"))
      .def(
          "read_row",
          [](const PyCache& c, int64_t slot) {
            KMLA_CHECK(c.cache.device() == Device::cpu,
                       "read_row: host caches only (use to_host())");
            KMLA_CHECK(slot >= 0 && slot < c.cache.geometry().num_slots(), "read_row: slot ", slot,
                       " outside [0, ", c.cache.geometry().num_slots(), ")");
            auto a = new_f32({int64_t(kLatentDim)});
            c.cache.read_row(slot, a.mutable_data());
            return a;
          },
          py::arg("slot"), "Decoded row (float32 [576]) of a slot.")
      .def(
          "write_row",
          [](PyCache& c, int64_t slot, py::handle row) {
            KMLA_CHECK(c.cache.device() == Device::cpu, "write_row: host caches only");
            KMLA_CHECK(slot >= 0 && slot < c.cache.geometry().num_slots(), "write_row: slot ", slot,
                       " outside [0, ", c.cache.geometry().num_slots(), ")");
            Arr a = arg(row, "row", {DType::f32});
            check_tensor(a.view, "row", DType::f32, {kLatentDim});
            c.cache.write_row(slot, a.view.as<float>());
          },
          py::arg("slot"), py::arg("row"), "Encodes a float32 [576] row into a slot.");

  // ---- batch metadata ----
  py::class_<BatchMetadata>(m, "BatchMetadata")
      .def_readonly("num_requests", &BatchMetadata::num_requests)
      .def_readonly("num_decodes", &BatchMetadata::num_decodes)
      .def_readonly("num_context_prefills", &BatchMetadata::num_context_prefills)
      .def_readonly("num_fresh_prefills", &BatchMetadata::num_fresh_prefills)
      .def_readonly("num_tokens", &BatchMetadata::num_tokens)
      .def_readonly("num_rows", &BatchMetadata::num_rows)
      .def_readonly("num_decode_tokens", &BatchMetadata::num_decode_tokens)
      .def_readonly("prefill_tokens_with_context", &BatchMetadata::prefill_tokens_with_context)
      .def_readonly("decode_threshold", &BatchMetadata::decode_threshold)
      .def_readonly("causal_decode", &BatchMetadata::causal_decode)
      .def_readonly("max_query_len", &BatchMetadata::max_query_len)
      .def_readonly("block_size", &BatchMetadata::block_size)
      .def_readonly("num_cache_blocks", &BatchMetadata::num_cache_blocks)
      .def_readonly("max_blocks_per_request", &BatchMetadata::max_blocks_per_request)
      .def_property_readonly("num_context_chunks",
                             [](const BatchMetadata& md) { return md.context_chunks.size(); })
      .def_property_readonly("request_order",
                             [](const BatchMetadata& md) { return vec_array(md.request_order); })
      .def_property_readonly("row_order",
                             [](const BatchMetadata& md) { return vec_array(md.row_order); })
      .def_property_readonly("query_lens",
                             [](const BatchMetadata& md) { return vec_array(md.query_lens); })
      .def_property_readonly("context_lens",
                             [](const BatchMetadata& md) { return vec_array(md.context_lens); })
      .def_property_readonly("seq_lens",
                             [](const BatchMetadata& md) { return vec_array(md.seq_lens); })
      .def_property_readonly("query_start",
                             [](const BatchMetadata& md) { return vec_array(md.query_start); })
      .def_property_readonly("slot_mapping",
                             [](const BatchMetadata& md) { return vec_array(md.slot_mapping); })
      .def_property_readonly("positions",
                             [](const BatchMetadata& md) { return vec_array(md.positions); })
      .def_property_readonly(
          "block_tables",
          [](const BatchMetadata& md) {
            py::array_t<int32_t> a({int64_t(md.num_requests), int64_t(md.max_blocks_per_request)});
            if (!md.block_tables.empty())
              std::memcpy(a.mutable_data(), md.block_tables.data(),
                          md.block_tables.size() * sizeof(int32_t));
            return a;
          })
      .def(
          "kind",
          [](const BatchMetadata& md, int r) {
            KMLA_CHECK(r >= 0 && r < md.num_requests, "kind: request ", r, " outside [0, ",
                       md.num_requests, ")");
            const RequestKind k = md.kind(r);
            return std::string(k == RequestKind::decode            ? "decode"
                               : k == RequestKind::context_prefill ? "context_prefill"
                                                                   : "fresh_prefill");
          },
          py::arg("layout_index"))
      .def(
          "validate",
          [](const BatchMetadata& md, const PyCache& c) { validate_batch(md, c.cache.geometry()); },
          py::arg("cache"));

  m.def(
      "plan_batch",
      [](py::handle query_lens, py::handle context_lens, py::handle block_tables,
         const PyCache& cache, int decode_threshold, bool non_causal_decode, bool keep_order,
         int64_t num_rows, int64_t workspace_tokens, py::handle slot_mapping) {
        const std::vector<int32_t> q = int_list(query_lens), c = int_list(context_lens);
        std::vector<std::vector<int32_t>> tables;
        for (py::handle row : block_tables) tables.push_back(int_list(row));
        KMLA_CHECK(q.size() == c.size() && q.size() == tables.size(), "plan_batch: ", q.size(),
                   " query_lens, ", c.size(), " context_lens and ", tables.size(), " block tables");
        std::vector<RequestSpec> reqs;
        for (size_t i = 0; i < q.size(); ++i)
          reqs.push_back(RequestSpec{q[i], c[i], std::move(tables[i])});
        BatchOptions o;
        o.decode_threshold = decode_threshold;
        o.non_causal_decode = non_causal_decode;
        o.keep_order = keep_order;
        o.num_rows = num_rows;
        o.workspace_tokens = workspace_tokens;
        if (!slot_mapping.is_none())
          for (py::handle x : slot_mapping) o.slot_mapping.push_back(x.cast<int64_t>());
        return plan_batch(reqs, cache.cache.geometry(), o);
      },
      py::arg("query_lens"), py::arg("context_lens"), py::arg("block_tables"), py::arg("cache"),
      py::arg("decode_threshold") = 1, py::arg("non_causal_decode") = false,
      py::arg("keep_order") = false, py::arg("num_rows") = 0, py::arg("workspace_tokens") = 65536,
      py::arg("slot_mapping") = py::none());

  // ---- weights ----
  py::class_<MlaWeights, std::shared_ptr<MlaWeights>>(m, "MlaWeights")
      .def_static(
          "random",
          [](const MlaConfig& c, uint64_t seed, const std::string& dtype) {
            return MlaWeights::random(c, seed, parse_dtype(dtype));
          },
          py::arg("config"), py::arg("seed") = 1, py::arg("dtype") = "bf16")
      .def_static(
          "from_checkpoint",
          [](const std::string& dir, int layer, const MlaConfig& c, const std::string& dtype) {
            py::gil_scoped_release nogil;
            return load_layer_weights(Checkpoint::open(dir), layer, c, parse_dtype(dtype));
          },
          py::arg("path"), py::arg("layer"), py::arg("config"), py::arg("dtype") = "bf16")
      .def_static("from_arrays", &weights_from_arrays, py::arg("config"), py::arg("arrays"),
                  py::arg("dtype") = "bf16", py::arg("k_scale") = 1.0f, py::arg("q_scale") = 1.0f)
      .def("arrays", &weights_arrays, "The tensors as float32 NumPy arrays (copies), by name.")
      .def("to_fp8_blocks", &MlaWeights::to_fp8_blocks, py::arg("names"))
      .def_property_readonly("fp8_names",
                             [](const MlaWeights& w) {
                               std::vector<std::string> n;
                               for (const auto& [k, v] : w.fp8) n.push_back(k);
                               return n;
                             })
      .def_property_readonly("dtype",
                             [](const MlaWeights& w) { return std::string(dtype_name(w.dtype())); })
      .def_readwrite("k_scale", &MlaWeights::k_scale)
      .def_readwrite("q_scale", &MlaWeights::q_scale)
      .def("validate", &MlaWeights::validate, py::arg("config"));

  // ---- the layer ----
  py::class_<PyLayer, std::shared_ptr<PyLayer>> layer(m, "Layer");
  layer
      .def(py::init(&make_layer), py::arg("config"), py::arg("weights"),
           py::arg("activation") = "bf16", py::arg("fp8_prefill") = false,
           py::arg("partial_output") = false, py::arg("device") = "cpu", py::arg("num_threads") = 0,
           py::arg("portable") = false, py::arg("rope_rows") = 0, py::arg("tune_gemms") = false)
      .def_property_readonly("config", [](const PyLayer& l) { return l.cfg; })
      .def_property_readonly(
          "weights", [](const PyLayer& l) { return std::make_shared<MlaWeights>(*l.weights); },
          "A copy (sharing the tensors' memory): changing it does not change the layer.")
      .def_property_readonly(
          "rope", [](const PyLayer& l) { return std::const_pointer_cast<RopeTable>(l.rope); })
      .def_property_readonly("activation",
                             [](const PyLayer& l) { return std::string(dtype_name(l.activation)); })
      .def_property_readonly("device",
                             [](const PyLayer& l) { return std::string(device_name(l.device)); })
      .def_property_readonly("fp8_prefill", [](const PyLayer& l) { return l.fp8_prefill; })
      .def("forward", &layer_forward, py::arg("positions"), py::arg("hidden_states"),
           py::arg("metadata"), py::arg("cache"), py::arg("out") = py::none(),
           py::arg("stream") = 0)
      .def("oracle", &oracle_forward, py::arg("positions"), py::arg("hidden_states"),
           py::arg("metadata"), py::arg("cache"), py::arg("rounding") = "exact");
#ifdef KMLA_HAVE_CUDA
  py::class_<PyPlan, std::shared_ptr<PyPlan>>(m, "Plan")
      .def_property_readonly("workspace_bytes",
                             [](const PyPlan& p) { return p.plan.workspace_bytes(); })
      .def_property_readonly("num_rows", [](const PyPlan& p) { return p.plan.num_rows(); })
      .def_property_readonly("graph_safe", [](const PyPlan& p) { return p.plan.graph_safe(); });
  layer
      .def(
          "plan",
          [](const PyLayer& l, const BatchMetadata& md, const PyCache& c, py::object shape) {
            KMLA_CHECK(l.gpu, "plan(): CUDA layers only");
            auto p = std::make_shared<PyPlan>();
            p->md = md;
            if (shape.is_none()) {
              p->plan = l.gpu->plan(p->md, c.cache);
            } else {
              auto d = shape.cast<py::dict>();
              cuda::DecodeShape s;
              s.max_requests = d["max_requests"].cast<int>();
              s.max_query_len = d.contains("max_query_len") ? d["max_query_len"].cast<int>() : 1;
              s.max_blocks = d["max_blocks"].cast<int>();
              s.max_seq_len = d.contains("max_seq_len") ? d["max_seq_len"].cast<int64_t>() : 0;
              p->plan = l.gpu->plan(p->md, c.cache, &s);
            }
            return p;
          },
          py::arg("metadata"), py::arg("cache"), py::arg("decode_shape") = py::none())
      .def(
          "upload",
          [](const PyLayer& l, const PyPlan& p, py::handle workspace, intptr_t stream) {
            KMLA_CHECK(l.gpu, "upload(): CUDA layers only");
            Arr ws = arg(workspace, "workspace", {DType::u8, Device::cuda, true}, stream);
            KMLA_CHECK(ws.view.bytes() >= p.plan.workspace_bytes(), "workspace: ", ws.view.bytes(),
                       " bytes, the plan needs ", p.plan.workspace_bytes());
            l.gpu->upload(p.plan, ws.view.data, as_stream(stream));
          },
          py::arg("plan"), py::arg("workspace"), py::arg("stream") = 0)
      .def(
          "run",
          [](const PyLayer& l, const PyPlan& p, py::handle positions, py::handle hidden, PyCache& c,
             py::handle out, py::handle workspace, intptr_t stream) {
            KMLA_CHECK(l.gpu, "run(): CUDA layers only");
            Arr pos = arg(positions, "positions", {DType::i64, Device::cuda}, stream);
            Arr hid = arg(hidden, "hidden_states", {l.activation, Device::cuda}, stream);
            Arr o = arg(out, "out", {l.activation, Device::cuda, true}, stream);
            Arr ws = arg(workspace, "workspace", {DType::u8, Device::cuda, true}, stream);
            KMLA_CHECK(ws.view.bytes() >= p.plan.workspace_bytes(), "workspace: ", ws.view.bytes(),
                       " bytes, the plan needs ", p.plan.workspace_bytes());
            py::gil_scoped_release nogil;
            l.gpu->run(p.plan, pos.view, hid.view, c.cache, o.view, ws.view.data,
                       as_stream(stream));
          },
          py::arg("plan"), py::arg("positions"), py::arg("hidden_states"), py::arg("cache"),
          py::arg("out"), py::arg("workspace"), py::arg("stream") = 0)
      .def(
          "check_errors",
          [](const PyLayer& l, intptr_t stream) {
            KMLA_CHECK(l.gpu, "check_errors(): CUDA layers only");
            l.gpu->check_errors(as_stream(stream));
          },
          py::arg("stream") = 0);
#endif

  // ---- stages ----
  m.def(
      "cache_insert",
      [](py::handle kv, py::handle kpe, py::handle positions, py::handle slots, PyCache& c,
         std::shared_ptr<RopeTable> rope, py::handle rope_device, py::handle workspace,
         const std::string& activation, intptr_t stream) {
        const Device dev = c.cache.device();
        const DType act = act_of(kv, activation);
        Arr a = arg(kv, "kv_c_normed", {act, dev}, stream);
        Arr b = arg(kpe, "k_pe", {act, dev}, stream);
        Arr p = arg(positions, "positions", {DType::i64, dev}, stream);
        Arr s = arg(slots, "slot_mapping", {DType::i64, dev}, stream);
        if (dev == Device::cpu) {
          py::gil_scoped_release nogil;
          cache_insert(a.view, b.view, p.view, rope.get(), s.view, c.cache);
          return;
        }
#ifdef KMLA_HAVE_CUDA
        Arr table = opt_arg(rope_device, "rope_table", {DType::f32, Device::cuda}, stream);
        Arr ws = opt_arg(workspace, "workspace", {DType::u8, Device::cuda, true}, stream);
        KMLA_CHECK(!table.present || table.view.ndim == 2, "rope_table: want [rows, 64]");
        py::gil_scoped_release nogil;
        cuda::cache_insert(a.view, b.view, p.view, table.present ? table.view.as<float>() : nullptr,
                           table.present ? table.view.dim(0) : 0, s.view, c.cache,
                           ws.present ? ws.view.data : nullptr, nullptr, as_stream(stream));
#endif
      },
      py::arg("kv_c_normed"), py::arg("k_pe"), py::arg("positions"), py::arg("slot_mapping"),
      py::arg("cache"), py::arg("rope") = nullptr, py::arg("rope_table") = py::none(),
      py::arg("workspace") = py::none(), py::arg("activation") = "bf16", py::arg("stream") = 0);
#ifdef KMLA_HAVE_CUDA
  m.def("cache_insert_workspace_bytes", &cuda::cache_insert_workspace_bytes, py::arg("tokens"));
#endif

  m.def(
      "merge_attn_states",
      [](py::handle po, py::handle pl, py::handle so, py::handle sl, int64_t rows_with_prefix,
         py::handle out, py::handle out_lse, const std::string& activation, intptr_t stream) {
        const Device dev = peek_device(po);
        const DType act = act_of(po, activation);
        Arr a = arg(po, "prefix_out", {act, dev}, stream);
        Arr b = arg(pl, "prefix_lse", {DType::f32, dev}, stream);
        Arr c = arg(so, "suffix_out", {act, dev}, stream);
        Arr d = arg(sl, "suffix_lse", {DType::f32, dev}, stream);
        std::vector<int64_t> dims(a.view.shape, a.view.shape + a.view.ndim);
        std::vector<int64_t> ldims(b.view.shape, b.view.shape + b.view.ndim);
        OutArg o = out_arg(out, "out", act, dev, dims, stream, true);
        OutArg ol = out_arg(out_lse, "out_lse", DType::f32, dev, ldims, stream, true);
        {
          py::gil_scoped_release nogil;
          if (dev == Device::cpu) {
            merge_attn_states(a.view, b.view, c.view, d.view, rows_with_prefix, o.arr.view,
                              ol.arr.view);
          } else {
#ifdef KMLA_HAVE_CUDA
            cuda::merge_attn_states(a.view, b.view, c.view, d.view, rows_with_prefix, o.arr.view,
                                    ol.arr.view, as_stream(stream));
#endif
          }
        }
        return py::make_tuple(out_result(o), out_result(ol));
      },
      py::arg("prefix_out"), py::arg("prefix_lse"), py::arg("suffix_out"), py::arg("suffix_lse"),
      py::arg("rows_with_prefix"), py::arg("out") = py::none(), py::arg("out_lse") = py::none(),
      py::arg("activation") = "bf16", py::arg("stream") = 0);

  m.def(
      "decode_attention",
      [](py::handle q, float q_scale, const PyCache& c, const BatchMetadata& md,
         double softmax_scale, py::handle out, py::handle lse, const std::string& activation) {
        const DType act = act_of(q, activation);
        Arr qa = arg(q, "q", {act});
        KMLA_CHECK(qa.view.ndim == 3, "q: want [tokens, heads, 576], got ", qa.view.shape_str());
        OutArg o = out_arg(out, "out", act, Device::cpu,
                           {qa.view.dim(0), qa.view.dim(1), int64_t(kKvLoraRank)}, 0, true);
        OutArg l =
            out_arg(lse, "lse", DType::f32, Device::cpu, {qa.view.dim(0), qa.view.dim(1)}, 0, true);
        {
          py::gil_scoped_release nogil;
          decode_attention(qa.view, q_scale, c.cache, md, softmax_scale, o.arr.view, l.arr.view);
        }
        return py::make_tuple(out_result(o), out_result(l));
      },
      py::arg("q"), py::arg("q_scale"), py::arg("cache"), py::arg("metadata"),
      py::arg("softmax_scale"), py::arg("out") = py::none(), py::arg("lse") = py::none(),
      py::arg("activation") = "bf16");

  m.def(
      "prefill_attention",
      [](py::handle q, py::handle k, py::handle v, std::vector<int64_t> cu_q,
         std::vector<int64_t> cu_k, bool causal, double softmax_scale, py::handle out,
         py::handle lse, const std::string& activation) {
        const DType act = act_of(q, activation);
        Arr qa = arg(q, "q", {act});
        Arr ka = arg(k, "k", {act});
        Arr va = arg(v, "v", {act});
        KMLA_CHECK(qa.view.ndim == 3, "q: want [tokens, heads, 192], got ", qa.view.shape_str());
        OutArg o = out_arg(out, "out", act, Device::cpu,
                           {qa.view.dim(0), qa.view.dim(1), int64_t(kVDim)}, 0, true);
        OutArg l =
            out_arg(lse, "lse", DType::f32, Device::cpu, {qa.view.dim(0), qa.view.dim(1)}, 0, true);
        {
          py::gil_scoped_release nogil;
          prefill_attention(qa.view, ka.view, va.view, cu_q, cu_k, causal, softmax_scale,
                            o.arr.view, l.arr.view);
        }
        return py::make_tuple(out_result(o), out_result(l));
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cu_q"), py::arg("cu_k"), py::arg("causal"),
      py::arg("softmax_scale"), py::arg("out") = py::none(), py::arg("lse") = py::none(),
      py::arg("activation") = "bf16");
}
