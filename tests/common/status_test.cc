#include "rd2h/common/status.h"

#include <gtest/gtest.h>

namespace rd2h {
namespace {

TEST(Status, OkIsZeroAndPrintsOk) {
  Status s;
  EXPECT_TRUE(s.is_ok());
  EXPECT_EQ(s.raw_code(), 0);
  EXPECT_EQ(s.to_string(), "ok");
}

TEST(Status, ErrorCarriesCodeAndMessage) {
  Status s = out_of_range("read 3: remote range [0x10, +8) is outside");
  EXPECT_FALSE(s.is_ok());
  EXPECT_NE(s.raw_code(), 0);
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
  EXPECT_EQ(s.to_string(), "out of range: read 3: remote range [0x10, +8) is outside");
}

TEST(Status, WithContextPrefixesMessageAndKeepsCode) {
  Status s = timeout_error("no answer").with_context("connecting to peer");
  EXPECT_EQ(s.code(), StatusCode::kTimeout);
  EXPECT_EQ(s.message(), "connecting to peer: no answer");
  EXPECT_TRUE(Status::ok().with_context("x").is_ok());
}

TEST(Expected, HoldsValueOrError) {
  Expected<int> v = 42;
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(*v, 42);
  EXPECT_TRUE(v.status().is_ok());
  Expected<int> e = not_found("no such thing");
  ASSERT_FALSE(e.has_value());
  EXPECT_EQ(e.status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace rd2h
