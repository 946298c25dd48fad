// libFuzzer target for kmla's safetensors reader (SafetensorsFile::open).
//
// Each input is a whole file. It is written to an in-memory file (memfd) and opened
// through /proc/self/fd, so the real open + fstat + mmap path runs, with no file on disk.
// A kmla::Error is the expected answer to a bad file; anything else is a finding: a
// crash or sanitizer report, another exception type (std::terminate), or a file that was
// accepted although its tensors break the reader's promises (checked below).
//
// Seeds: tests/fuzz/corpus/ (valid files with 0-3 tensors of every dtype, and one file per
// rejection rule). Build and run: see tests/fuzz/CMakeLists.txt.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "kmla/error.hpp"
#include "kmla/safetensors.hpp"

namespace {

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "fuzz_safetensors: accepted an inconsistent file: %s\n", what.c_str());
  std::abort();
}

// One in-memory file reused for every input (a temporary file where memfd is missing).
struct InputFile {
  int fd = -1;
  std::string path;
  InputFile() {
#ifdef MFD_CLOEXEC
    fd = memfd_create("kmla_fuzz_safetensors", MFD_CLOEXEC);
#endif
    if (fd >= 0) {
      path = "/proc/self/fd/" + std::to_string(fd);
    } else {
      const char* tmp = std::getenv("TMPDIR");
      path = std::string(tmp ? tmp : "/tmp") + "/kmla_fuzz_" + std::to_string(getpid()) + ".safetensors";
    }
  }
  void write(const uint8_t* data, size_t size) {
    if (fd < 0) {
      FILE* f = std::fopen(path.c_str(), "wb");
      if (!f || std::fwrite(data, 1, size, f) != size) std::abort();
      std::fclose(f);
      return;
    }
    if (ftruncate(fd, 0) != 0) std::abort();
    size_t done = 0;
    while (done < size) {
      const ssize_t n = pwrite(fd, data + done, size - done, off_t(done));
      if (n <= 0) std::abort();
      done += size_t(n);
    }
  }
};

// What an accepted file must satisfy: every tensor's byte count is dtype size x the
// product of its (non-negative) dimensions, computed without overflow; tensors lie in a
// payload no larger than the file's and do not overlap; every byte handed out is readable.
void check_accepted(const kmla::SafetensorsFile& f, const uint8_t* data, size_t size) {
  uint64_t header = 0;
  for (int i = 7; i >= 0; --i) header = (header << 8) | data[i];
  if (header > size - 8) finding("header length beyond the file");
  const uint64_t payload = size - 8 - header;

  std::vector<std::pair<const std::byte*, const std::byte*>> ranges;
  unsigned checksum = 0;
  for (const std::string& name : f.names()) {
    const kmla::StTensor& t = f.tensor(name);
    if (t.name != name) finding("tensor '" + name + "' is named '" + t.name + "'");
    const size_t elem = kmla::st_dtype_size(t.dtype);
    if (elem == 0) finding("tensor '" + name + "' has a dtype of size 0");
    unsigned __int128 n = 1;
    for (int64_t d : t.shape) {
      if (d < 0) finding("tensor '" + name + "' has a negative dimension " + std::to_string(d));
      n *= uint64_t(d);
      if (n > (unsigned __int128)INT64_MAX) n = (unsigned __int128)INT64_MAX + 1;  // stays "too large"
    }
    if (n > (unsigned __int128)INT64_MAX) finding("tensor '" + name + "' has more than 2^63 elements");
    if (t.numel() != int64_t(n)) finding("tensor '" + name + "' numel() disagrees with its shape");
    if (n * elem != t.bytes)
      finding("tensor '" + name + "' holds " + std::to_string(t.bytes) + " bytes but its dtype and shape need " +
              (n * elem > UINT64_MAX ? std::string("more than 2^64") : std::to_string(uint64_t(n * elem))));
    if (t.bytes > payload) finding("tensor '" + name + "' is larger than the payload");
    if (t.bytes > 0 && t.data == nullptr) finding("tensor '" + name + "' has bytes but no data");
    ranges.push_back({t.data, t.data + t.bytes});
    for (size_t i = 0; i < t.bytes; ++i) checksum += std::to_integer<unsigned>(t.data[i]);
  }
  std::sort(ranges.begin(), ranges.end());
  uint64_t total = 0;
  for (size_t i = 0; i < ranges.size(); ++i) {
    total += uint64_t(ranges[i].second - ranges[i].first);
    if (i > 0 && ranges[i].first < ranges[i - 1].second) finding("tensors overlap");
  }
  if (total > payload) finding("tensors hold more bytes than the payload");
  if (!ranges.empty()) {
    const auto lo = ranges.front().first;
    auto hi = lo;
    for (const auto& r : ranges) hi = std::max(hi, r.second);
    if (uint64_t(hi - lo) > payload) finding("tensors span more than the payload");
  }
  for (const auto& [k, v] : f.metadata()) checksum += unsigned(k.size() + v.size());
  // Keep the reads.
  volatile unsigned sink = checksum;
  (void)sink;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static InputFile file;
  file.write(data, size);
  try {
    const kmla::SafetensorsFile f = kmla::SafetensorsFile::open(file.path);
    check_accepted(f, data, size);
  } catch (const kmla::Error&) {
    // A clear rejection: what a corrupt file should get.
  }
  return 0;
}
