// The safetensors reader validates every header before handing out a pointer.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "kmla/error.hpp"
#include "kmla/safetensors.hpp"

namespace kmla {
namespace {

std::string write_file(const std::string& header, size_t payload_bytes, const std::string& name,
                       int64_t claimed_len = -1) {
  const std::string path = ::testing::TempDir() + "/kmla_" + name + ".safetensors";
  std::ofstream f(path, std::ios::binary);
  const uint64_t n = claimed_len < 0 ? header.size() : uint64_t(claimed_len);
  for (int i = 0; i < 8; ++i) f.put(char((n >> (8 * i)) & 0xff));
  f << header;
  for (size_t i = 0; i < payload_bytes; ++i) f.put(char(i & 0xff));
  return path;
}

std::string error_of(const std::string& path) {
  try {
    SafetensorsFile::open(path);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(Safetensors, ReadsTensorsAndMetadata) {
  const std::string path = write_file(
      R"({"__metadata__": {"k": "v"}, "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
          "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]}})",
      22, "good");
  const SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(f.metadata().at("k"), "v");
  EXPECT_EQ(f.names(), (std::vector<std::string>{"a", "b"}));
  const StTensor& b = f.tensor("b");
  EXPECT_EQ(b.dtype, StDType::BF16);
  EXPECT_EQ(b.numel(), 3);
  EXPECT_EQ(std::to_integer<int>(b.data[0]), 16);  // payload byte 16
  EXPECT_EQ(error_of(path), "no error");
  EXPECT_THROW(f.tensor("missing"), Error);
}

TEST(Safetensors, RejectsMalformedFiles) {
  EXPECT_NE(error_of(write_file("{", 0, "badjson")).find("not valid JSON"), std::string::npos);
  EXPECT_NE(error_of(write_file("{}", 0, "toolong", 1 << 20)).find("larger than the file"), std::string::npos);
  EXPECT_NE(error_of(write_file(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 8, "oob"))
                .find("outside"),
            std::string::npos);
  EXPECT_NE(error_of(write_file(R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}})", 16, "size"))
                .find("needs 12"),
            std::string::npos);
  EXPECT_NE(error_of(write_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                                12, "overlap"))
                .find("overlap"),
            std::string::npos);
  EXPECT_NE(error_of(write_file(R"({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 1]}})", 1, "dtype"))
                .find("Q4"),
            std::string::npos);
  // Sizes that would wrap (numel * dtype size) or turn negative as int64 (found by fuzzing).
  EXPECT_NE(error_of(write_file(R"({"a": {"dtype": "F64", "shape": [2305843009213693952], "data_offsets": [0, 0]}})",
                                0, "wrap"))
                .find("too large"),
            std::string::npos);
  EXPECT_NE(error_of(write_file(R"({"a": {"dtype": "U8", "shape": [0, 18446744073709551615], "data_offsets": [0, 0]}})",
                                0, "neg"))
                .find("too large"),
            std::string::npos);
  const std::string path = ::testing::TempDir() + "/kmla_short.safetensors";
  std::ofstream(path, std::ios::binary) << "abc";
  EXPECT_NE(error_of(path).find("too short"), std::string::npos);
  EXPECT_NE(error_of("/nonexistent/x.safetensors").find("cannot open"), std::string::npos);
}

}  // namespace
}  // namespace kmla
