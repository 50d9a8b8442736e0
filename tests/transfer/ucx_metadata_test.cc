#include "transfer/ucx_metadata.h"

#include <gtest/gtest.h>

#include <cstring>

namespace rd2h::transfer {
namespace {

UcxMetadata sample() {
  UcxMetadata m;
  m.session_id = "ucx:host:42:abc";
  m.hostname = "host";
  m.transport = "shm";
  m.identity.boot_id = "boot";
  m.identity.pid_namespace = 4026531836;
  m.identity.pid = 42;
  m.identity.start_time = 12345;
  m.worker_address = std::vector<std::byte>(37, std::byte{0x5a});
  m.regions.push_back({0x1000, 0x2000, std::vector<std::byte>(20, std::byte{1})});
  m.regions.push_back({0x8000, 0x100, std::vector<std::byte>(24, std::byte{2}), 7, 991, 0x40});
  return m;
}

// Offset of the region count: magic, version, four strings, pid ns, pid, start time, address.
size_t region_count_offset(const UcxMetadata& m) {
  return 8 + 4 + (4 + m.session_id.size()) + (4 + m.hostname.size()) + (4 + m.transport.size()) +
         (4 + m.identity.boot_id.size()) + 8 + 4 + 8 + (4 + m.worker_address.size());
}

void put_u32(std::vector<std::byte>& b, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) b[at + i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}
void put_u64(std::vector<std::byte>& b, size_t at, uint64_t v) {
  for (int i = 0; i < 8; ++i) b[at + i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}

TEST(UcxMetadata, RoundTrips) {
  auto m = sample();
  auto decoded = decode_ucx_metadata(encode_ucx_metadata(m));
  ASSERT_TRUE(decoded) << decoded.status().to_string();
  EXPECT_EQ(decoded->session_id, m.session_id);
  EXPECT_EQ(decoded->identity.pid, 42);
  EXPECT_EQ(decoded->identity.start_time, 12345u);
  EXPECT_EQ(decoded->worker_address, m.worker_address);
  ASSERT_EQ(decoded->regions.size(), 2u);
  EXPECT_EQ(decoded->regions[1].base, 0x8000u);
  EXPECT_EQ(decoded->regions[1].packed_rkey, m.regions[1].packed_rkey);
  EXPECT_EQ(decoded->regions[0].fd, -1);
  EXPECT_EQ(decoded->regions[1].fd, 7);
  EXPECT_EQ(decoded->regions[1].inode, 991u);
  EXPECT_EQ(decoded->regions[1].file_offset, 0x40u);
}

TEST(UcxMetadata, EveryTruncationIsAnErrorNotACrash) {
  auto bytes = encode_ucx_metadata(sample());
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto d = decode_ucx_metadata(std::span(bytes.data(), n));
    ASSERT_FALSE(d) << "prefix of " << n << " bytes decoded";
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidMetadata);
  }
}

TEST(UcxMetadata, GarbageIsRejectedByMagic) {
  std::vector<std::byte> garbage(64, std::byte{0x41});
  auto d = decode_ucx_metadata(garbage);
  ASSERT_FALSE(d);
  EXPECT_NE(d.status().message().find("bad magic"), std::string::npos);
}

TEST(UcxMetadata, UnknownVersionIsNamed) {
  auto bytes = encode_ucx_metadata(sample());
  put_u32(bytes, 8, 99);
  auto d = decode_ucx_metadata(bytes);
  ASSERT_FALSE(d);
  EXPECT_NE(d.status().message().find("version 99"), std::string::npos) << d.status().message();
}

TEST(UcxMetadata, MalformedFieldsAreRejected) {
  struct Case {
    const char* name;
    void (*mutate)(std::vector<std::byte>&, const UcxMetadata&);
    const char* expect;
  };
  const Case cases[] = {
      {"huge region count",
       [](auto& b, const auto& m) { put_u32(b, region_count_offset(m), 0xffffffff); },
       "region count"},
      {"oversized string length", [](auto& b, const auto&) { put_u32(b, 12, 0x7fffffff); },
       "exceeds the limit"},
      {"trailing bytes", [](auto& b, const auto&) { b.push_back(std::byte{0}); }, "trailing bytes"},
      {"zero-length region",
       [](auto& b, const auto& m) { put_u64(b, region_count_offset(m) + 4 + 8, 0); }, "is empty"},
      {"overlapping regions",
       [](auto& b, const auto& m) {
         // second region's base moves inside the first
         size_t second = region_count_offset(m) + 4 + 8 + 8 + 4 + 20 + 4 + 8 + 8 + 8;
         put_u64(b, second, 0x1800);
       },
       "overlaps"},
      {"wrapping region",
       [](auto& b, const auto& m) {
         size_t first = region_count_offset(m) + 4;
         put_u64(b, first, ~0ull - 10);
       },
       "wraps"},
  };
  for (const auto& c : cases) {
    auto m = sample();
    auto bytes = encode_ucx_metadata(m);
    c.mutate(bytes, m);
    auto d = decode_ucx_metadata(bytes);
    ASSERT_FALSE(d) << c.name;
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidMetadata) << c.name;
    EXPECT_NE(d.status().message().find(c.expect), std::string::npos)
        << c.name << ": " << d.status().message();
  }
}

TEST(UcxMetadata, EmptyWorkerAddressIsRejected) {
  auto m = sample();
  m.worker_address.clear();
  auto d = decode_ucx_metadata(encode_ucx_metadata(m));
  ASSERT_FALSE(d);
  EXPECT_NE(d.status().message().find("empty worker address"), std::string::npos);
}

}  // namespace
}  // namespace rd2h::transfer
