// What the wire messages' decoders refuse, each with a reason: malformed and truncated messages,
// readiness over an item limit, and msgpack nested too deep or declaring more than it holds.
#include <gtest/gtest.h>

#include <random>

#include "protocol/messages.h"
#include "protocol/messages_fixture.h"
#include "rd2h/connector/metadata.h"

namespace rd2h::protocol {
namespace {

using rd2h::testing::hex;
using rd2h::testing::sample_meta;

TEST(Protocol, MalformedMessagesAreRejectedWithAReason) {
  const std::string rrb = "c4 10 726561645f72656164795f6261746368";
  struct Case {
    const char* name;
    std::string hex;
    const char* expect;
  };
  const Case cases[] = {
      {"empty", "", "empty"},
      {"not an array", "a3 414243", "not an array"},
      {"tag as str", "92 a9 726561645f646f6e65 00", "expected bin"},
      {"unknown tag", "92 c4 03 666f6f 00", "unknown tag"},
      {"too few elements", "93 " + rrb + " 00 a1 78", "3 elements"},
      {"layer as str", "94 " + rrb + " a1 30 a1 78 90", "expected an integer"},
      {"negative layer", "94 " + rrb + " ff a1 78 90", "is negative"},
      {"negative block id", "94 " + rrb + " 00 a1 78 91 92 a1 72 91 ff", "is negative"},
      {"oversized block id", "94 " + rrb + " 00 a1 78 91 92 a1 72 91 cf 0000000100000000",
       "exceeds the limit"},
      {"float block id", "94 " + rrb + " 00 a1 78 91 92 a1 72 91 cb 3ff0000000000000",
       "expected an integer, got float"},
      {"read_req of 1 field", "94 " + rrb + " 00 a1 78 91 91 a1 72", "1 elements"},
      {"member not below ratio", "97 " + rrb + " 00 a1 78 90 90 02 02", "not below tp_ratio"},
      {"trailing bytes", "92 c4 09 726561645f646f6e65 00 00", "trailing"},
      {"truncated", "92 c4 09 726561645f646f6e", "truncated"},
      {"READ_DONE arity", "91 c4 09 726561645f646f6e65", "expected at least 2"},
      {"huge array header", "dd ffffffff", "not valid msgpack"},
  };
  for (const auto& c : cases) {
    auto d = decode_message(hex(c.hex));
    ASSERT_FALSE(d) << c.name;
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument) << c.name;
    EXPECT_NE(d.status().message().find(c.expect), std::string::npos)
        << c.name << ": " << d.status().message();
  }
}

TEST(Protocol, MalformedLayerMapsAreRejected) {
  auto with = [](void (*change)(LayerMeta&)) {
    MfMeta m = sample_meta();
    change(m.layers[0].second);
    return decode_message(encode(m));
  };
  auto a = with([](LayerMeta& l) { l.block_len.pop_back(); });
  ASSERT_FALSE(a);
  EXPECT_NE(a.status().message().find("they must match"), std::string::npos);
  auto b = with([](LayerMeta& l) { l.main_tensor_count = 3; });
  ASSERT_FALSE(b);
  EXPECT_NE(b.status().message().find("has_indexer is set"), std::string::npos);
  auto c = with([](LayerMeta& l) { l.block_size_scale[1] = 0; });
  ASSERT_FALSE(c);
  EXPECT_NE(c.status().message().find("tensor 1 has zero bytes"), std::string::npos);
}

TEST(Protocol, EveryTruncationAndRandomCorruptionFailsCleanly) {
  ReadReadyBatch rrb;
  rrb.layer_idx = 12;
  rrb.layer_name = "model.layers.12.self_attn";
  rrb.read_reqs.push_back({"x", {1, 2}, {3}, 1, 1});
  rrb.done_ext_ids = {"x"};
  for (const auto& valid : {encode(rrb), encode(sample_meta()), encode(ReadFailed{1, "e"})}) {
    for (size_t n = 0; n < valid.size(); ++n) {
      EXPECT_FALSE(decode_message(std::span(valid.data(), n))) << "prefix " << n;
    }
    std::mt19937 rng(42);
    for (int i = 0; i < 2000; ++i) {
      auto corrupt = valid;
      for (int k = 0; k < 3; ++k) {
        corrupt[rng() % corrupt.size()] = static_cast<std::byte>(rng() & 0xff);
      }
      (void)decode_message(corrupt);  // must return, valid or not, without crashing
    }
  }
}

TEST(Protocol, LayerIndexIsSalvagedFromABrokenReadiness) {
  // read_reqs is a str instead of an array: undecodable, but the layer is readable.
  auto broken = hex("94 c4 10 726561645f72656164795f6261746368 0c a1 78 a1 78");
  EXPECT_FALSE(decode_message(broken));
  EXPECT_EQ(salvage_layer_index(broken), std::optional<int64_t>(12));
  EXPECT_EQ(salvage_layer_index(hex("92 c4 09 726561645f646f6e65 00")), std::nullopt);
  EXPECT_EQ(salvage_layer_index(hex("c0")), std::nullopt);
}

namespace limits {

ReadReadyBatch readiness_with(size_t reqs, size_t ids_per_list) {
  ReadReadyBatch m;
  m.layer_idx = 3;
  m.layer_name = "model.layers.3.self_attn";
  m.read_reqs.resize(reqs);
  for (size_t i = 0; i < reqs; ++i) {
    auto& r = m.read_reqs[i];
    r.ext_id = "req-" + std::to_string(i);
    r.main_block_ids.resize(ids_per_list);
    r.indexer_block_ids.resize(ids_per_list);
    for (size_t k = 0; k < ids_per_list; ++k) {
      // Large ids (5 bytes each on the wire), as a big KV pool has.
      r.main_block_ids[k] = (int64_t{1} << 30) + static_cast<int64_t>(i * ids_per_list + k);
      r.indexer_block_ids[k] = static_cast<int64_t>(k);
    }
  }
  return m;
}

}  // namespace limits

TEST(Protocol, AReadinessOverAnItemLimitIsRefusedNamingTheLimit) {
  auto too_many_reqs = decode_message(encode(limits::readiness_with(kMaxReadReqs + 1, 0)));
  ASSERT_FALSE(too_many_reqs);
  EXPECT_NE(too_many_reqs.status().message().find("16385 read requests exceed the limit of 16384"),
            std::string::npos)
      << too_many_reqs.status().message();

  auto long_request = limits::readiness_with(1, 0);
  long_request.read_reqs[0].main_block_ids.assign(kMaxBlockIdsPerRequest + 1, 1);
  auto too_long = decode_message(encode(long_request));
  ASSERT_FALSE(too_long);
  EXPECT_NE(too_long.status().message().find("block ids exceed the limit of 1048576 per request"),
            std::string::npos)
      << too_long.status().message();

  // Each list within its limit, the readiness over its total.
  const size_t reqs = kMaxBlockIdsPerReadiness / kMaxBlockIdsPerRequest + 1;
  auto wide = limits::readiness_with(reqs, 0);
  for (auto& r : wide.read_reqs) r.main_block_ids.assign(kMaxBlockIdsPerRequest, 1);
  auto too_wide = decode_message(encode(wide));
  ASSERT_FALSE(too_wide);
  EXPECT_NE(too_wide.status().message().find("more than 4194304 block ids in one readiness"),
            std::string::npos)
      << too_wide.status().message();
  // The layer of a refused readiness is still readable, so Decode can answer it.
  EXPECT_EQ(salvage_layer_index(encode(wide)), std::optional<int64_t>(3));

  ReadReadyBatch done_ids = limits::readiness_with(0, 0);
  done_ids.done_ext_ids.assign(kMaxDoneExtIds + 1, "x");
  auto too_many_done = decode_message(encode(done_ids));
  ASSERT_FALSE(too_many_done);
  EXPECT_NE(too_many_done.status().message().find("done ext ids exceed the limit of 16384"),
            std::string::npos)
      << too_many_done.status().message();
}

TEST(Protocol, TheLargestLegalReadinessDecodes) {
  // Every block id the limit allows, over 4096 requests with 1 KiB ext ids.
  const size_t reqs = 4096;
  auto m = limits::readiness_with(reqs, kMaxBlockIdsPerReadiness / reqs / 2);
  for (size_t i = 0; i < reqs; ++i) m.read_reqs[i].ext_id.resize(kMaxExtIdBytes, 'e');
  const auto bytes = encode(m);
  EXPECT_GT(bytes.size(), size_t{16} << 20);
  EXPECT_LE(bytes.size(), kMaxMessageBytes);
  auto d = decode_message(bytes);
  ASSERT_TRUE(d) << d.status().to_string();
  const auto& got = std::get<ReadReadyBatch>(*d);
  ASSERT_EQ(got.read_reqs.size(), reqs);
  EXPECT_EQ(got.read_reqs[reqs - 1].main_block_ids, m.read_reqs[reqs - 1].main_block_ids);
  EXPECT_EQ(got.read_reqs[7].indexer_block_ids, m.read_reqs[7].indexer_block_ids);
  EXPECT_EQ(got.read_reqs[7].ext_id, m.read_reqs[7].ext_id);
}

TEST(Protocol, DeepNestingIsRefusedWithoutRecursion) {
  // 60 KB of nested one-element arrays around a nil.
  std::vector<std::byte> nested(60 << 10, std::byte{0x91});
  nested.push_back(std::byte{0xc0});
  Status st = check_msgpack_bounds(nested, kMaxNestingDepth, "test input");
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("test input: nested deeper than 32 levels"), std::string::npos)
      << st.message();
  auto d = decode_message(nested);
  ASSERT_FALSE(d);
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  // Inside MF_META's layer map too.
  std::vector<std::byte> meta = hex("93 c4 07 6d665f6d657461 a1 70 c5");
  const uint16_t n = static_cast<uint16_t>(nested.size());
  meta.push_back(static_cast<std::byte>(n >> 8));
  meta.push_back(static_cast<std::byte>(n & 0xff));
  meta.insert(meta.end(), nested.begin(), nested.end());
  auto m = decode_message(meta);
  ASSERT_FALSE(m);
  EXPECT_NE(m.status().message().find("MF_META layer map"), std::string::npos)
      << m.status().message();
}

TEST(Protocol, DeclaredItemsAreCheckedBeforeAnyTreeIsBuilt) {
  // 16 nested arrays each declaring 4096 items, too few present: msgpack-c would allocate
  // every declared item (1 MiB) before finding the message short.
  std::vector<std::byte> claims;
  for (int level = 0; level < 16; ++level) {
    const auto header = hex("dc 1000");
    claims.insert(claims.end(), header.begin(), header.end());
  }
  claims.resize(4096, std::byte{0xc0});
  auto d = decode_message(claims);
  ASSERT_FALSE(d);
  EXPECT_NE(d.status().message().find("message: not valid msgpack (a container of 4096 items"),
            std::string::npos)
      << d.status().message();
}

TEST(Protocol, DeeplyNestedStepMetadataIsRefused) {
  std::vector<std::byte> nested(60 << 10, std::byte{0x91});
  nested.push_back(std::byte{0xc0});
  auto m = connector::decode_metadata(nested);
  ASSERT_FALSE(m);
  EXPECT_NE(m.status().message().find("connector metadata: nested deeper than 32"),
            std::string::npos)
      << m.status().message();
  EXPECT_TRUE(connector::decode_metadata(connector::encode(connector::ConnectorMetadata{})));
}

TEST(Protocol, BoundsCheckAcceptsWhatFitsAndNamesWhatDoesNot) {
  auto nest = [](size_t levels) {
    std::vector<std::byte> v(levels - 1, std::byte{0x91});
    v.push_back(std::byte{0x90});
    return v;
  };
  EXPECT_TRUE(check_msgpack_bounds(nest(kMaxNestingDepth), kMaxNestingDepth, "x").is_ok());
  EXPECT_FALSE(check_msgpack_bounds(nest(kMaxNestingDepth + 1), kMaxNestingDepth, "x"));
  // A map, strings, bins, floats, ints and ext skipped at their sizes.
  EXPECT_TRUE(check_msgpack_bounds(hex("82 a1 61 92 cb 3ff0000000000000 c4 02 0102 a1 62 "
                                       "93 cd 0100 d3 ffffffffffffffff d4 01 02"),
                                   4, "x")
                  .is_ok());
  Status huge = check_msgpack_bounds(hex("dd ffffffff 00"), 4, "x");
  EXPECT_NE(huge.message().find("4294967295 items in the 1 bytes left"), std::string::npos)
      << huge.message();
  EXPECT_NE(check_msgpack_bounds(hex("91 a5 41"), 4, "x").message().find("truncated"),
            std::string::npos);
  EXPECT_NE(check_msgpack_bounds(hex("91 00 00"), 4, "x").message().find("1 trailing bytes"),
            std::string::npos);
  EXPECT_NE(check_msgpack_bounds(hex("c1"), 4, "x").message().find("not valid msgpack"),
            std::string::npos);
}

}  // namespace
}  // namespace rd2h::protocol
