#include "kv_pool.h"

#include <gtest/gtest.h>

namespace rd2h::tools {
namespace {

KvPoolLayout deepseek() {
  return {61, 32, {131072, 16384, 16384}};
}

TEST(KvPoolLayout, OffsetsTileThePoolWithoutGaps) {
  KvPoolLayout l{3, 4, {100, 10, 1}};
  ASSERT_TRUE(l.validate(1 << 20).is_ok());
  uint64_t expected = 0;
  for (uint32_t layer = 0; layer < 3; ++layer) {
    for (uint32_t t = 0; t < 3; ++t) {
      for (uint32_t b = 0; b < 4; ++b) {
        EXPECT_EQ(l.offset(layer, t, b), expected) << layer << "/" << t << "/" << b;
        expected += l.tensor_bytes[t];
      }
    }
  }
  EXPECT_EQ(expected, l.total_bytes());
}

TEST(KvPoolLayout, InvalidLayoutsNameWhatIsWrong) {
  struct Case {
    KvPoolLayout layout;
    const char* expect;
  };
  const Case cases[] = {
      {{0, 4, {8}}, "layers must be at least 1"},
      {{1, 0, {8}}, "blocks must be at least 1"},
      {{1, 4, {}}, "at least one tensor"},
      {{1, 4, {8, 0}}, "tensor 1 has 0 bytes"},
      {{4096, 1u << 24, {1u << 20}}, "exceeds the limit"},
      {{1, 1, {~0ull, 2}}, "exceed the limit"},
  };
  for (const auto& c : cases) {
    Status st = c.layout.validate(64ull << 30);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << c.expect;
    EXPECT_NE(st.message().find(c.expect), std::string::npos) << st.message();
  }
}

TEST(Handshake, RoundTrips) {
  SourceHandshake h{deepseek(), 9, 0x7f0000001000, {std::byte{1}, std::byte{2}}};
  auto d = decode_handshake(encode_handshake(h));
  ASSERT_TRUE(d) << d.status().to_string();
  EXPECT_EQ(d->layout.tensor_bytes, h.layout.tensor_bytes);
  EXPECT_EQ(d->layout.layers, 61u);
  EXPECT_EQ(d->base, h.base);
  EXPECT_EQ(d->engine_metadata, h.engine_metadata);
}

TEST(Handshake, TruncatedOrForeignBytesAreErrors) {
  auto bytes = encode_handshake({deepseek(), 9, 0x1000, std::vector<std::byte>(50)});
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_FALSE(decode_handshake(std::span(bytes.data(), n))) << "prefix " << n;
  }
  bytes.push_back(std::byte{0});
  EXPECT_FALSE(decode_handshake(bytes));
  std::vector<std::byte> http(64, std::byte{'G'});
  auto d = decode_handshake(http);
  ASSERT_FALSE(d);
  EXPECT_NE(d.status().message().find("bad magic"), std::string::npos);
}

}  // namespace
}  // namespace rd2h::tools
