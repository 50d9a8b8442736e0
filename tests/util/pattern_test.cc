#include "util/pattern.h"

#include <gtest/gtest.h>

#include <vector>

namespace rd2h {
namespace {

TEST(Pattern, FilledRangeMatchesItsKey) {
  for (size_t len : {0u, 1u, 7u, 8u, 9u, 4096u, 4099u}) {
    std::vector<unsigned char> buf(len);
    fill_pattern(buf.data(), len, 77);
    EXPECT_FALSE(find_pattern_mismatch(buf.data(), len, 77).has_value()) << "len " << len;
  }
}

TEST(Pattern, DifferentKeysDiffer) {
  std::vector<unsigned char> a(64), b(64);
  fill_pattern(a.data(), a.size(), 1);
  fill_pattern(b.data(), b.size(), 2);
  EXPECT_NE(a, b);
  EXPECT_EQ(find_pattern_mismatch(a.data(), a.size(), 2), std::optional<size_t>(0));
}

TEST(Pattern, ReportsFirstCorruptedByte) {
  for (size_t at : {0u, 5u, 8u, 100u, 102u}) {
    std::vector<unsigned char> buf(103);
    fill_pattern(buf.data(), buf.size(), 9);
    buf[at] ^= 0x01;
    EXPECT_EQ(find_pattern_mismatch(buf.data(), buf.size(), 9), std::optional<size_t>(at));
  }
}

}  // namespace
}  // namespace rd2h
