#include <gtest/gtest.h>
TEST(Oracle, Builds) {}
