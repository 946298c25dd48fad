// A validating reader for the safetensors format (memory-mapped): an 8-byte little-endian
// header length N, N bytes of JSON, then the tensor payload.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace kmla {

enum class StDType : uint8_t { BF16, F16, F32, F64, F8_E4M3, I64, I32, I16, I8, U8, BOOL };
size_t st_dtype_size(StDType t);
const char* st_dtype_name(StDType t);

struct StTensor {
  std::string name;
  StDType dtype = StDType::F32;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;  // inside the mapping; valid while the file is open
  size_t bytes = 0;
  int64_t numel() const;
};

class SafetensorsFile {
 public:
  // Maps and validates the whole header: well-formed JSON, known dtypes, offsets inside the
  // payload, sizes equal to dtype x shape, no overlapping tensors, a sane header length.
  // Throws kmla::Error naming the file (and tensor).
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const { return path_; }
  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  // Throws kmla::Error naming the file and tensor when absent.
  const StTensor& tensor(const std::string& name) const;
  std::vector<std::string> names() const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::string path_;
  std::shared_ptr<void> mapping_;
  std::map<std::string, StTensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace kmla
