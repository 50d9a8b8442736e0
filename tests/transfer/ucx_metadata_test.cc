#include "transfer/ucx_metadata.h"

#include <gtest/gtest.h>

#include <functional>
#include <limits>
#include <nlohmann/json.hpp>

namespace rd2h::transfer {
namespace {

using nlohmann::json;
using Bytes = std::vector<std::byte>;

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
  m.regions.push_back(
      {0x8000, 0x100, std::vector<std::byte>(24, std::byte{2}), 7, 991, 0x40, 0x1040});
  return m;
}

json binary(size_t n, uint8_t fill) {
  return json::binary(std::vector<uint8_t>(n, fill));
}

// sample() as the documented map, written by another msgpack encoder (nlohmann's), so a case
// can change one field and the wire format is pinned apart from encode_ucx_metadata.
json sample_doc() {
  json region0 = {{"base", 0x1000}, {"length", 0x2000}, {"rkey", binary(20, 1)}, {"fd", -1},
                  {"inode", 0},     {"file_offset", 0}, {"live_offset", 0}};
  json region1 = {{"base", 0x8000}, {"length", 0x100},     {"rkey", binary(24, 2)}, {"fd", 7},
                  {"inode", 991},   {"file_offset", 0x40}, {"live_offset", 0x1040}};
  return {
      {"v", 3},
      {"session_id", "ucx:host:42:abc"},
      {"hostname", "host"},
      {"transport", "shm"},
      {"identity",
       {{"boot_id", "boot"}, {"pid_namespace", 4026531836}, {"pid", 42}, {"start_time", 12345}}},
      {"worker_address", binary(37, 0x5a)},
      {"regions", {region0, region1}}};
}

Bytes pack(const json& doc) {
  const std::vector<uint8_t> v = json::to_msgpack(doc);
  const auto* p = reinterpret_cast<const std::byte*>(v.data());
  return {p, p + v.size()};
}

// `doc` packed with one more field whose value is `raw` msgpack bytes, as no encoder would
// write them (a count the bytes do not hold, a field given twice).
Bytes pack_with_raw_field(const json& doc, const std::string& key, const Bytes& raw) {
  Bytes b = pack(doc);
  EXPECT_LT(doc.size(), 15u);  // a fixmap, whose header counts its fields
  b[0] = static_cast<std::byte>(std::to_integer<uint8_t>(b[0]) + 1);
  const Bytes k = pack(json(key));
  b.insert(b.end(), k.begin(), k.end());
  b.insert(b.end(), raw.begin(), raw.end());
  return b;
}

Bytes bytes_of(std::initializer_list<uint8_t> v) {
  Bytes b;
  for (uint8_t x : v) b.push_back(std::byte{x});
  return b;
}

void expect_same(const UcxMetadata& got, const UcxMetadata& want) {
  EXPECT_EQ(got.session_id, want.session_id);
  EXPECT_EQ(got.hostname, want.hostname);
  EXPECT_EQ(got.transport, want.transport);
  EXPECT_EQ(got.identity.boot_id, want.identity.boot_id);
  EXPECT_EQ(got.identity.pid_namespace, want.identity.pid_namespace);
  EXPECT_EQ(got.identity.pid, want.identity.pid);
  EXPECT_EQ(got.identity.start_time, want.identity.start_time);
  EXPECT_EQ(got.worker_address, want.worker_address);
  ASSERT_EQ(got.regions.size(), want.regions.size());
  for (size_t i = 0; i < want.regions.size(); ++i) {
    SCOPED_TRACE("region " + std::to_string(i));
    EXPECT_EQ(got.regions[i].base, want.regions[i].base);
    EXPECT_EQ(got.regions[i].length, want.regions[i].length);
    EXPECT_EQ(got.regions[i].packed_rkey, want.regions[i].packed_rkey);
    EXPECT_EQ(got.regions[i].fd, want.regions[i].fd);
    EXPECT_EQ(got.regions[i].inode, want.regions[i].inode);
    EXPECT_EQ(got.regions[i].file_offset, want.regions[i].file_offset);
    EXPECT_EQ(got.regions[i].live_offset, want.regions[i].live_offset);
  }
}

// The decoder's verdict on `bytes`: refused as invalid metadata, with `expect` in the reason.
void expect_refused(const Bytes& bytes, const std::string& expect, const std::string& name) {
  auto d = decode_ucx_metadata(bytes);
  ASSERT_FALSE(d) << name << ": decoded";
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidMetadata) << name;
  EXPECT_NE(d.status().message().find(expect), std::string::npos)
      << name << ": " << d.status().message();
}

TEST(UcxMetadata, RoundTripPreservesEveryField) {
  const UcxMetadata m = sample();
  auto decoded = decode_ucx_metadata(encode_ucx_metadata(m));
  ASSERT_TRUE(decoded) << decoded.status().to_string();
  expect_same(*decoded, m);
}

TEST(UcxMetadata, RoundTripPreservesExtremeValues) {
  UcxMetadata m = sample();
  m.identity.pid = std::numeric_limits<int32_t>::max();
  m.identity.pid_namespace = ~0ull;
  m.identity.start_time = ~0ull;
  m.worker_address.assign(kMaxWorkerAddress, std::byte{0xee});
  m.regions[1].base = ~0ull - 0x100;
  m.regions[1].packed_rkey.assign(kMaxPackedRkey, std::byte{0x11});
  m.regions[1].fd = std::numeric_limits<int32_t>::max();
  m.regions[1].file_offset = ~0ull - 0x100;
  m.regions[1].live_offset = ~0ull;
  auto decoded = decode_ucx_metadata(encode_ucx_metadata(m));
  ASSERT_TRUE(decoded) << decoded.status().to_string();
  expect_same(*decoded, m);
}

// The decoder bounds an array by the regions its bytes could hold: the smallest regions an
// engine can export still fit that bound.
TEST(UcxMetadata, ManyOfTheSmallestRegionsDecode) {
  UcxMetadata m = sample();
  m.regions.clear();
  for (uint64_t i = 0; i < 4096; ++i) m.regions.push_back({i, 1, {std::byte{1}}});
  auto decoded = decode_ucx_metadata(encode_ucx_metadata(m));
  ASSERT_TRUE(decoded) << decoded.status().to_string();
  expect_same(*decoded, m);
}

TEST(UcxMetadata, EncodesTheDocumentedMap) {
  const auto raw = encode_ucx_metadata(sample());
  const auto* p = reinterpret_cast<const uint8_t*>(raw.data());
  EXPECT_EQ(json::from_msgpack(std::vector<uint8_t>(p, p + raw.size())), sample_doc());
  auto decoded = decode_ucx_metadata(pack(sample_doc()));
  ASSERT_TRUE(decoded) << decoded.status().to_string();
  expect_same(*decoded, sample());
}

TEST(UcxMetadata, EveryTruncationIsRefused) {
  const auto bytes = encode_ucx_metadata(sample());
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto d = decode_ucx_metadata(std::span(bytes.data(), n));
    ASSERT_FALSE(d) << "prefix of " << n << " bytes decoded";
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidMetadata);
  }
  expect_refused(Bytes(bytes.begin(), bytes.end() - 1), "truncated", "one byte short");
}

TEST(UcxMetadata, MalformedFieldsAreRefusedByName) {
  struct Case {
    const char* name;
    std::function<void(json&)> mutate;
    std::string expect;
  };
  const Case cases[] = {
      {"a later version", [](json& d) { d["v"] = 4; }, "version 4 is not supported"},
      {"no version", [](json& d) { d.erase("v"); }, "no version field \"v\""},
      {"version of the wrong type", [](json& d) { d["v"] = "3"; },
       "v: expected an unsigned integer, got str"},
      {"oversized worker address",
       [](json& d) { d["worker_address"] = binary(kMaxWorkerAddress + 1, 0); },
       "worker_address: 1048577 bytes exceed the limit of 1048576"},
      {"empty worker address", [](json& d) { d["worker_address"] = binary(0, 0); },
       "worker_address: empty"},
      {"worker address as a str", [](json& d) { d["worker_address"] = "addr"; },
       "worker_address: expected bin, got str"},
      {"oversized session id",
       [](json& d) { d["session_id"] = std::string(kMaxMetadataString + 1, 's'); },
       "session_id: 4097 bytes exceed the limit of 4096"},
      {"empty session id", [](json& d) { d["session_id"] = ""; }, "session_id: empty"},
      {"hostname of the wrong type", [](json& d) { d["hostname"] = 5; },
       "hostname: expected a str, got int"},
      {"no transport", [](json& d) { d.erase("transport"); }, "transport: missing"},
      {"an unknown field", [](json& d) { d["extra"] = 1; }, "unknown field \"extra\""},
      {"identity as a str", [](json& d) { d["identity"] = "me"; },
       "identity: expected a map, got str"},
      {"negative pid", [](json& d) { d["identity"]["pid"] = -1; }, "identity.pid: -1 is below 0"},
      {"pid beyond int32", [](json& d) { d["identity"]["pid"] = 1ull << 31; },
       "identity.pid: 2147483648 exceeds the limit of 2147483647"},
      {"negative pid namespace", [](json& d) { d["identity"]["pid_namespace"] = -1; },
       "identity.pid_namespace: -1 is negative"},
      {"oversized boot id",
       [](json& d) { d["identity"]["boot_id"] = std::string(kMaxMetadataString + 1, 'b'); },
       "identity.boot_id: 4097 bytes exceed"},
      {"regions as a map",
       [](json& d) {
         d["regions"] = {{"a", 1}};
       },
       "regions: expected an array, got map"},
      {"region without its live offset", [](json& d) { d["regions"][0].erase("live_offset"); },
       "regions[0].live_offset: missing"},
      {"oversized rkey", [](json& d) { d["regions"][0]["rkey"] = binary(kMaxPackedRkey + 1, 1); },
       "regions[0].rkey: 65537 bytes exceed the limit of 65536"},
      {"empty rkey", [](json& d) { d["regions"][1]["rkey"] = binary(0, 0); },
       "regions[1].rkey: empty"},
      {"fd below -1", [](json& d) { d["regions"][1]["fd"] = -2; }, "regions[1].fd: -2 is below -1"},
      {"fractional inode", [](json& d) { d["regions"][0]["inode"] = 1.5; },
       "regions[0].inode: expected an unsigned integer, got float"},
      {"zero-length region", [](json& d) { d["regions"][0]["length"] = 0; },
       "regions[0] [0x1000, +0) is empty"},
      {"wrapping region", [](json& d) { d["regions"][0]["base"] = ~0ull - 10; }, "wraps"},
      {"overlapping regions", [](json& d) { d["regions"][1]["base"] = 0x1800; },
       "regions[1] [0x1800, +256) is unsorted or overlaps the previous region"},
      {"region past the end of its file",
       [](json& d) { d["regions"][1]["file_offset"] = ~0ull - 10; },
       "lies past the end of its file"},
  };
  for (const auto& c : cases) {
    json doc = sample_doc();
    c.mutate(doc);
    expect_refused(pack(doc), c.expect, c.name);
  }
}

TEST(UcxMetadata, MalformedMsgpackIsRefused) {
  const json no_regions = [] {
    json d = sample_doc();
    d.erase("regions");
    return d;
  }();
  struct Case {
    const char* name;
    Bytes bytes;
    std::string expect;
  };
  const Case cases[] = {
      {"empty", {}, "empty"},
      {"garbage", Bytes(64, std::byte{0x41}), "a msgpack int, not a map"},
      {"trailing bytes",
       [] {
         Bytes b = pack(sample_doc());
         b.push_back(std::byte{0});
         return b;
       }(),
       "1 trailing bytes"},
      {"a field given twice", pack_with_raw_field(sample_doc(), "hostname", pack(json("h2"))),
       "hostname: given twice"},
      {"a field named by an int", bytes_of({0x82, 0xa1, 'v', 3, 1, 2}),
       "a field is named by a msgpack int, not a str"},
      {"region count far beyond the bytes",
       pack_with_raw_field(no_regions, "regions", bytes_of({0xdd, 0xff, 0xff, 0xff, 0xff})),
       "an array declares more than"},
      {"nesting beyond any version",
       pack_with_raw_field(no_regions, "regions",
                           bytes_of({0x91, 0x91, 0x91, 0x91, 0x91, 0x91, 0x90})),
       "nested deeper than 6"},
      {"an ext value", pack_with_raw_field(no_regions, "regions", bytes_of({0xd4, 1, 0})),
       "not valid msgpack"},
      {"the format of version 2",
       [] {
         Bytes b = bytes_of({'R', 'D', '2', 'H', 'U', 'C', 'X', 'M', 2, 0, 0, 0});
         b.resize(200, std::byte{0});
         return b;
       }(),
       "version 2 or earlier (led by \"RD2HUCXM\")"},
      {"more than the size limit", Bytes(kMaxUcxMetadataBytes + 1, std::byte{0x80}),
       "33554433 bytes exceed the limit of 33554432"},
  };
  for (const auto& c : cases) expect_refused(c.bytes, c.expect, c.name);
}

TEST(UcxMetadata, MapWithMoreFieldsThanAnyVersionIsRefused) {
  Bytes b = bytes_of({0xde, 0x00, 40});  // map16 of 40 fields
  for (int i = 0; i < 40; ++i) {
    const Bytes kv = pack(json::array({"k" + std::to_string(i), i}));
    b.insert(b.end(), kv.begin() + 1, kv.end());  // the pair without its array header
  }
  expect_refused(b, "a map declares more than 32 fields", "40 fields");
}

}  // namespace
}  // namespace rd2h::transfer
