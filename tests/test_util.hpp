// Helpers shared by the test files.
#pragma once

#include <gtest/gtest.h>

#include <initializer_list>
#include <string>

#include "kmla/error.hpp"

namespace kmla::testing_util {

// Runs f, which must throw a kmla::Error whose message contains every needle.
template <class F>
void expect_error_naming(F&& f, std::initializer_list<std::string> needles) {
  try {
    f();
    ADD_FAILURE() << "expected a kmla::Error";
  } catch (const Error& e) {
    for (const auto& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << "message '" << e.what() << "' does not name '" << n << "'";
  }
}

}  // namespace kmla::testing_util
