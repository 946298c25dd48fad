#include "kmla/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>

#include "kmla/error.hpp"

namespace kmla {

namespace {

struct DTypeName {
  StDType t;
  const char* name;
  size_t size;
};
constexpr DTypeName kDTypes[] = {
    {StDType::BF16, "BF16", 2}, {StDType::F16, "F16", 2},         {StDType::F32, "F32", 4},
    {StDType::F64, "F64", 8},   {StDType::F8_E4M3, "F8_E4M3", 1}, {StDType::I64, "I64", 8},
    {StDType::I32, "I32", 4},   {StDType::I16, "I16", 2},         {StDType::I8, "I8", 1},
    {StDType::U8, "U8", 1},     {StDType::BOOL, "BOOL", 1},
};

// A header larger than this is not a tensor index but a corrupt or hostile file.
constexpr uint64_t kMaxHeaderBytes = uint64_t(100) << 20;

}  // namespace

size_t st_dtype_size(StDType t) {
  for (const auto& d : kDTypes)
    if (d.t == t) return d.size;
  return 0;
}

const char* st_dtype_name(StDType t) {
  for (const auto& d : kDTypes)
    if (d.t == t) return d.name;
  return "?";
}

int64_t StTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  f.path_ = path;
  const int fd = ::open(path.c_str(), O_RDONLY);
  KMLA_CHECK(fd >= 0, path, ": cannot open: ", std::strerror(errno));
  struct stat st {};
  const int rc = ::fstat(fd, &st);
  const uint64_t size = rc == 0 ? uint64_t(st.st_size) : 0;
  if (rc != 0 || size < 8) {
    ::close(fd);
    KMLA_CHECK(false, path, ": file of ", size, " bytes is too short for a safetensors header");
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  KMLA_CHECK(map != MAP_FAILED, path, ": mmap failed: ", std::strerror(errno));
  f.mapping_ = std::shared_ptr<void>(map, [size](void* p) { ::munmap(p, size); });
  const auto* bytes = static_cast<const std::byte*>(map);

  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | uint64_t(std::to_integer<uint8_t>(bytes[i]));
  KMLA_CHECK(n <= kMaxHeaderBytes, path, ": header length ", n, " exceeds the ", kMaxHeaderBytes, "-byte limit");
  KMLA_CHECK(n <= size - 8, path, ": header length ", n, " is larger than the file (", size, " bytes)");
  const char* text = reinterpret_cast<const char*>(bytes + 8);
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text, text + n);
  } catch (const nlohmann::json::exception& e) {
    KMLA_CHECK(false, path, ": header is not valid JSON: ", e.what());
  }
  KMLA_CHECK(header.is_object(), path, ": header is not a JSON object");
  const uint64_t payload = size - 8 - n;
  const std::byte* base = bytes + 8 + n;

  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& v = it.value();
    if (name == "__metadata__") {
      KMLA_CHECK(v.is_object(), path, ": __metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        KMLA_CHECK(m.value().is_string(), path, ": __metadata__ entry '", m.key(), "' is not a string");
        f.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    KMLA_CHECK(v.is_object() && v.contains("dtype") && v.contains("shape") && v.contains("data_offsets"),
               path, ": tensor '", name, "' lacks dtype, shape or data_offsets");
    StTensor t;
    t.name = name;
    KMLA_CHECK(v["dtype"].is_string(), path, ": tensor '", name, "' has a non-string dtype");
    const std::string dt = v["dtype"].get<std::string>();
    const DTypeName* d = std::find_if(std::begin(kDTypes), std::end(kDTypes),
                                      [&](const DTypeName& x) { return dt == x.name; });
    KMLA_CHECK(d != std::end(kDTypes), path, ": tensor '", name, "' has unsupported dtype '", dt, "'");
    t.dtype = d->t;
    KMLA_CHECK(v["shape"].is_array(), path, ": tensor '", name, "' has a non-array shape");
    uint64_t numel = 1;
    for (const auto& s : v["shape"]) {
      KMLA_CHECK(s.is_number_unsigned(), path, ": tensor '", name, "' has a bad dimension ", s.dump());
      const uint64_t dim = s.get<uint64_t>();
      // Bound every dimension and the byte count (numel * dtype size) by 2^62, so neither can
      // wrap or turn negative as int64.
      KMLA_CHECK(dim <= (uint64_t(1) << 62) && (dim == 0 || numel <= ((uint64_t(1) << 62) / d->size) / dim), path,
                 ": tensor '", name, "' is too large (dimension ", dim, ")");
      numel *= dim;
      t.shape.push_back(int64_t(dim));
    }
    const auto& off = v["data_offsets"];
    KMLA_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(),
               path, ": tensor '", name, "' has malformed data_offsets ", off.dump());
    const uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
    KMLA_CHECK(b <= e && e <= payload, path, ": tensor '", name, "' data_offsets [", b, ", ", e,
               ") fall outside the ", payload, "-byte payload");
    KMLA_CHECK(e - b == numel * d->size, path, ": tensor '", name, "' holds ", e - b, " bytes but ", dt, " ",
               v["shape"].dump(), " needs ", numel * d->size);
    t.data = base + b;
    t.bytes = e - b;
    ranges.push_back({b, e});
    f.tensors_[name] = std::move(t);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    KMLA_CHECK(ranges[i].first >= ranges[i - 1].second, path, ": tensors overlap at payload byte ",
               ranges[i].first);
  return f;
}

const StTensor& SafetensorsFile::tensor(const std::string& name) const {
  auto it = tensors_.find(name);
  KMLA_CHECK(it != tensors_.end(), path_, ": no tensor named '", name, "'");
  return it->second;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> n;
  for (const auto& [k, v] : tensors_) n.push_back(k);
  return n;
}

}  // namespace kmla
