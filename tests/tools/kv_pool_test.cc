#include "kv_pool.h"

#include <gtest/gtest.h>

#include <functional>
#include <msgpack.hpp>
#include <span>

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

TEST(Handshake, RoundTripPreservesEveryField) {
  std::vector<std::byte> metadata(300);
  for (size_t i = 0; i < metadata.size(); ++i) metadata[i] = static_cast<std::byte>(i * 7);
  const SourceHandshake h{deepseek(), ~0ull - 5, 0x7f0000001000, metadata};
  auto d = decode_handshake(encode_handshake(h));
  ASSERT_TRUE(d) << d.status().to_string();
  EXPECT_EQ(d->layout.layers, 61u);
  EXPECT_EQ(d->layout.blocks, 32u);
  EXPECT_EQ(d->layout.tensor_bytes, h.layout.tensor_bytes);
  EXPECT_EQ(d->seed, h.seed);
  EXPECT_EQ(d->base, h.base);
  EXPECT_EQ(d->engine_metadata, h.engine_metadata);
}

TEST(Handshake, EveryTruncationIsRefused) {
  auto bytes = encode_handshake({deepseek(), 9, 0x1000, std::vector<std::byte>(50)});
  EXPECT_NE(decode_handshake({}).status().message().find("pd-read handshake: empty"),
            std::string::npos);
  for (size_t n = 1; n < bytes.size(); ++n) {
    auto d = decode_handshake(std::span(bytes.data(), n));
    ASSERT_FALSE(d) << "prefix " << n;
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(d.status().message().find("pd-read handshake"), std::string::npos)
        << d.status().message();
  }
  bytes.push_back(std::byte{0});
  auto d = decode_handshake(bytes);
  ASSERT_FALSE(d);
  EXPECT_NE(d.status().message().find("1 trailing bytes"), std::string::npos)
      << d.status().message();
}

using Packer = msgpack::packer<msgpack::sbuffer>;

// One field of a hand-made handshake map: its key and how its value is written.
struct Entry {
  std::string key;
  std::function<void(Packer&)> value;
};

void pack_str(Packer& pk, const std::string& s) {
  pk.pack_str(static_cast<uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

// The fields encode_handshake writes, for a small valid layout.
std::vector<Entry> valid_entries() {
  return {{"format", [](Packer& pk) { pack_str(pk, "rd2h pd-read 1"); }},
          {"layers", [](Packer& pk) { pk.pack(2u); }},
          {"blocks", [](Packer& pk) { pk.pack(4u); }},
          {"tensor_bytes",
           [](Packer& pk) {
             pk.pack(std::vector<uint64_t>{64, 8});
           }},
          {"seed", [](Packer& pk) { pk.pack(1u); }},
          {"base", [](Packer& pk) { pk.pack(4096u); }},
          {"engine_metadata", [](Packer& pk) {
             pk.pack_bin(3);
             pk.pack_bin_body("abc", 3);
           }}};
}

std::vector<std::byte> pack(const std::vector<Entry>& entries) {
  msgpack::sbuffer buffer;
  Packer pk(buffer);
  pk.pack_map(static_cast<uint32_t>(entries.size()));
  for (const auto& e : entries) {
    pack_str(pk, e.key);
    e.value(pk);
  }
  const auto* p = reinterpret_cast<const std::byte*>(buffer.data());
  return {p, p + buffer.size()};
}

std::vector<Entry> with_value(std::vector<Entry> entries, const std::string& key,
                              std::function<void(Packer&)> value) {
  for (auto& e : entries) {
    if (e.key == key) e.value = std::move(value);
  }
  return entries;
}

std::vector<Entry> without(std::vector<Entry> entries, const std::string& key) {
  std::erase_if(entries, [&](const Entry& e) { return e.key == key; });
  return entries;
}

std::vector<Entry> plus(std::vector<Entry> entries, Entry extra) {
  entries.push_back(std::move(extra));
  return entries;
}

TEST(Handshake, HandMadeValidMapDecodes) {
  auto d = decode_handshake(pack(valid_entries()));
  ASSERT_TRUE(d) << d.status().to_string();
  EXPECT_EQ(d->layout.tensor_bytes, (std::vector<uint64_t>{64, 8}));
  EXPECT_EQ(d->engine_metadata.size(), 3u);
}

TEST(Handshake, MalformedFieldsAreRefusedNamingTheField) {
  struct Case {
    std::vector<std::byte> bytes;
    const char* expect;
  };
  const auto str = [](std::string s) { return [s](Packer& pk) { pack_str(pk, s); }; };
  const Case cases[] = {
      {std::vector<std::byte>(64, std::byte{'G'}), "pd-read handshake: 63 trailing bytes"},
      {pack({}), "missing field 'format'"},
      {[] {
         msgpack::sbuffer b;
         Packer(b).pack(std::vector<int>{1, 2});
         const auto* p = reinterpret_cast<const std::byte*>(b.data());
         return std::vector<std::byte>(p, p + b.size());
       }(),
       "pd-read handshake: expected a map, got array"},
      {pack(with_value(valid_entries(), "format", str("rd2h pd-read 2"))),
       "pd-read handshake.format: 'rd2h pd-read 2' is not 'rd2h pd-read 1'"},
      {pack(without(valid_entries(), "seed")), "pd-read handshake: missing field 'seed'"},
      {pack(plus(valid_entries(), {"extra", str("x")})), "unknown field 'extra'"},
      {pack(plus(valid_entries(), {"base", [](Packer& pk) { pk.pack(1u); }})),
       "field 'base' appears twice"},
      {pack(with_value(valid_entries(), "layers", str("61"))),
       "pd-read handshake.layers: expected an integer, got str"},
      {pack(with_value(valid_entries(), "blocks", [](Packer& pk) { pk.pack(1ull << 32); })),
       "pd-read handshake.blocks: 4294967296 exceeds the limit of 4294967295"},
      {pack(with_value(valid_entries(), "seed", [](Packer& pk) { pk.pack(-1); })),
       "pd-read handshake.seed: -1 is negative"},
      {pack(with_value(valid_entries(), "base", [](Packer& pk) { pk.pack(1.5); })),
       "pd-read handshake.base: expected an unsigned integer, got float"},
      {pack(with_value(valid_entries(), "tensor_bytes",
                       [](Packer& pk) { pk.pack(std::vector<uint64_t>(65, 8)); })),
       "pd-read handshake.tensor_bytes: 65 elements, expected 0 to 64"},
      {pack(with_value(valid_entries(), "tensor_bytes",
                       [](Packer& pk) {
                         pk.pack(std::vector<int>{8, -8});
                       })),
       "pd-read handshake.tensor_bytes[1]: -8 is negative"},
      {pack(with_value(valid_entries(), "engine_metadata", str("abc"))),
       "pd-read handshake.engine_metadata: expected bin, got str"},
  };
  for (const auto& c : cases) {
    auto d = decode_handshake(c.bytes);
    ASSERT_FALSE(d) << c.expect;
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument) << c.expect;
    EXPECT_NE(d.status().message().find(c.expect), std::string::npos)
        << "expected '" << c.expect << "' in: " << d.status().message();
  }
}

TEST(Handshake, OversizedHandshakeIsRefusedBeforeItIsParsed) {
  std::vector<std::byte> huge(kMaxHandshakeBytes + 1, std::byte{0x80});
  auto d = decode_handshake(huge);
  ASSERT_FALSE(d);
  EXPECT_NE(d.status().message().find("pd-read handshake: 33554433 bytes exceed the limit of "
                                      "33554432"),
            std::string::npos)
      << d.status().message();
}

TEST(Handshake, OversizedEngineMetadataIsRefusedNamingIt) {
  auto bytes = encode_handshake(
      {deepseek(), 9, 0x1000, std::vector<std::byte>(kMaxEngineMetadataBytes + 1)});
  auto d = decode_handshake(bytes);
  ASSERT_FALSE(d);
  EXPECT_NE(d.status().message().find("pd-read handshake.engine_metadata: 16777217 bytes exceed"),
            std::string::npos)
      << d.status().message();
}

TEST(Handshake, HeadersClaimingMoreThanTheBytesHoldAreRefused) {
  // A map of 2^32-1 pairs and an array of 2^32-1 items, each in a handful of bytes.
  for (const std::vector<uint8_t>& raw :
       {std::vector<uint8_t>{0xdf, 0xff, 0xff, 0xff, 0xff, 0xa1, 'x'},
        std::vector<uint8_t>{0x81, 0xac, 't', 'e', 'n',  's',  'o',  'r',  '_',  'b',
                             'y',  't',  'e', 's', 0xdd, 0xff, 0xff, 0xff, 0xff, 0x01}}) {
    auto d = decode_handshake(std::as_bytes(std::span(raw)));
    ASSERT_FALSE(d);
    EXPECT_NE(d.status().message().find("pd-read handshake"), std::string::npos)
        << d.status().message();
  }
}

TEST(Handshake, DecodedLayoutStillGoesThroughValidate) {
  // The codec reads ranges; a layout it accepts is validated by its own rules after.
  auto d = decode_handshake(
      pack(with_value(valid_entries(), "layers", [](Packer& pk) { pk.pack(0u); })));
  ASSERT_TRUE(d) << d.status().to_string();
  Status st = d->layout.validate(64ull << 30);
  EXPECT_NE(st.message().find("layers must be at least 1"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace rd2h::tools
