// kmla::Error and the KMLA_CHECK macro: every failed check throws with a message
// that names the file, line, the condition and the offending values.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace kmla {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {

inline void append(std::ostringstream&) {}

template <class T, class... Rest>
void append(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  append(os, rest...);
}

template <class... Args>
[[noreturn]] void fail(const char* file, int line, const char* cond, const Args&... args) {
  std::ostringstream os;
  append(os, args...);
  os << " [" << cond << " failed at " << file << ":" << line << "]";
  throw Error(os.str());
}

}  // namespace detail
}  // namespace kmla

// KMLA_CHECK(cond, "message parts", value, ...): throws kmla::Error when cond is false.
#define KMLA_CHECK(cond, ...)                                            \
  do {                                                                   \
    if (!(cond)) ::kmla::detail::fail(__FILE__, __LINE__, #cond, __VA_ARGS__); \
  } while (0)
