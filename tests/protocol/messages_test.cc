#include "protocol/messages.h"

#include <gtest/gtest.h>

#include <random>

#include "rd2h/connector/metadata.h"

namespace rd2h::protocol {
namespace {

std::vector<std::byte> hex(std::string_view text) {
  std::vector<std::byte> out;
  std::string digits;
  for (char c : text) {
    if (std::isxdigit(static_cast<unsigned char>(c))) digits += c;
  }
  for (size_t i = 0; i + 1 < digits.size(); i += 2) {
    out.push_back(static_cast<std::byte>(std::stoi(digits.substr(i, 2), nullptr, 16)));
  }
  return out;
}

std::vector<std::byte> bytes(std::initializer_list<int> v) {
  std::vector<std::byte> out;
  for (int x : v) out.push_back(static_cast<std::byte>(x));
  return out;
}

// The example of wire-format.md, byte for byte.
const char* kReadyExample =
    "97 c4 10 72656164 5f726561 64795f62 61746368 00"
    "b8 6d6f6465 6c2e6c61 79657273 2e302e73 656c665f 6174746e"
    "91 95 a5 7265712d30 92 03 04 91 07 00 00"
    "91 a5 7265712d30"
    "00 01";

TEST(Protocol, ReadReadyBatchMatchesTheWireFormatExample) {
  ReadReadyBatch m;
  m.layer_idx = 0;
  m.layer_name = "model.layers.0.self_attn";
  m.read_reqs.push_back({"req-0", {3, 4}, {7}, 0, 0});
  m.done_ext_ids = {"req-0"};
  auto encoded = encode(m);
  EXPECT_EQ(encoded.size(), 69u);
  EXPECT_EQ(encoded, hex(kReadyExample));
}

TEST(Protocol, ReadReadyBatchExampleDecodes) {
  auto d = decode_message(hex(kReadyExample));
  ASSERT_TRUE(d) << d.status().to_string();
  const auto& m = std::get<ReadReadyBatch>(*d);
  EXPECT_EQ(m.layer_idx, 0);
  EXPECT_EQ(m.layer_name, "model.layers.0.self_attn");
  ASSERT_EQ(m.read_reqs.size(), 1u);
  EXPECT_EQ(m.read_reqs[0].ext_id, "req-0");
  EXPECT_EQ(m.read_reqs[0].main_block_ids, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(m.read_reqs[0].indexer_block_ids, (std::vector<int64_t>{7}));
  EXPECT_EQ(m.done_ext_ids, (std::vector<std::string>{"req-0"}));
  EXPECT_EQ(m.group_member_idx, 0);
  EXPECT_EQ(m.tp_ratio, 1);
}

TEST(Protocol, RepliesMatchTheWireFormatExamples) {
  EXPECT_EQ(encode(ReadDone{0}), hex("92 c4 09 726561645f646f6e65 00"));
  EXPECT_EQ(encode(ReadFailed{3, "boom"}), hex("93 c4 0b 726561645f6661696c6564 03 a4 626f6f6d"));
  auto done = decode_message(hex("92 c4 09 726561645f646f6e65 00"));
  ASSERT_TRUE(done);
  EXPECT_EQ(std::get<ReadDone>(*done).layer_idx, 0);
  auto failed = decode_message(hex("93 c4 0b 726561645f6661696c6564 03 a4 626f6f6d"));
  ASSERT_TRUE(failed);
  EXPECT_EQ(std::get<ReadFailed>(*failed).layer_idx, 3);
  EXPECT_EQ(std::get<ReadFailed>(*failed).error, "boom");
}

TEST(Protocol, IntegersUseTheirSmallestEncoding) {
  EXPECT_EQ(encode(ReadDone{127}), hex("92 c4 09 726561645f646f6e65 7f"));
  EXPECT_EQ(encode(ReadDone{128}), hex("92 c4 09 726561645f646f6e65 cc 80"));
  EXPECT_EQ(encode(ReadDone{70000}), hex("92 c4 09 726561645f646f6e65 ce 00011170"));
}

TEST(Protocol, TupleLengthGuardsFillLegacyDefaults) {
  // 4 elements: no done ids, member 0, ratio 1.
  auto four = decode_message(hex("94 c4 10 726561645f72656164795f6261746368 05 a1 78 90"));
  ASSERT_TRUE(four) << four.status().to_string();
  const auto& a = std::get<ReadReadyBatch>(*four);
  EXPECT_EQ(a.layer_idx, 5);
  EXPECT_TRUE(a.done_ext_ids.empty());
  EXPECT_EQ(a.group_member_idx, 0);
  EXPECT_EQ(a.tp_ratio, 1);

  // 2-field read_req: one block list for main and indexer, starts 0.
  auto legacy = decode_message(
      hex("95 c4 10 726561645f72656164795f6261746368 01 a1 78 91 92 a1 72 92 02 09 90"));
  ASSERT_TRUE(legacy) << legacy.status().to_string();
  const auto& r = std::get<ReadReadyBatch>(*legacy).read_reqs.at(0);
  EXPECT_EQ(r.main_block_ids, (std::vector<int64_t>{2, 9}));
  EXPECT_EQ(r.indexer_block_ids, (std::vector<int64_t>{2, 9}));
  EXPECT_EQ(r.main_start, 0);
  EXPECT_EQ(r.indexer_start, 0);

  // 4-field read_req: the main start; the indexer's is 0, as the existing connector reads it.
  auto one_start = decode_message(
      hex("95 c4 10 726561645f72656164795f6261746368 01 a1 78 91 94 a1 72 91 02 91 03 06 90"));
  ASSERT_TRUE(one_start) << one_start.status().to_string();
  const auto& r4 = std::get<ReadReadyBatch>(*one_start).read_reqs.at(0);
  EXPECT_EQ(r4.main_start, 6);
  EXPECT_EQ(r4.indexer_start, 0);

  // tp_ratio 0 or negative means 1.
  for (const char* ratio : {"00", "ff", "d3 8000000000000000"}) {
    auto r = decode_message(
        hex(std::string("97 c4 10 726561645f72656164795f6261746368 01 a1 78 90 90 00 ") + ratio));
    ASSERT_TRUE(r) << ratio << ": " << r.status().to_string();
    EXPECT_EQ(std::get<ReadReadyBatch>(*r).tp_ratio, 1) << ratio;
  }

  // Elements past the seventh (a newer sender's) are skipped whole, nested ones too.
  auto newer = decode_message(hex(
      "99 c4 10 726561645f72656164795f6261746368 01 a1 78 90 90 01 02 "
      "82 a1 6b 92 01 c4 02 abcd a1 6c cb 3ff0000000000000 93 c0 c3 90"));
  ASSERT_TRUE(newer) << newer.status().to_string();
  EXPECT_EQ(std::get<ReadReadyBatch>(*newer).group_member_idx, 1);
  EXPECT_EQ(std::get<ReadReadyBatch>(*newer).tp_ratio, 2);
  auto cut = decode_message(
      hex("98 c4 10 726561645f72656164795f6261746368 01 a1 78 90 90 01 02 92 01"));
  ASSERT_FALSE(cut);
  EXPECT_NE(cut.status().message().find("truncated"), std::string::npos)
      << cut.status().message();

  // READ_DONE and READ_FAILED with more elements than they need.
  auto done = decode_message(hex("93 c4 09 726561645f646f6e65 07 a3 6e6577"));
  ASSERT_TRUE(done) << done.status().to_string();
  EXPECT_EQ(std::get<ReadDone>(*done).layer_idx, 7);
  auto failed = decode_message(hex("94 c4 0b 726561645f6661696c6564 03 a1 65 c0"));
  ASSERT_TRUE(failed) << failed.status().to_string();
  EXPECT_EQ(std::get<ReadFailed>(*failed).error, "e");

  // READ_FAILED without an error string.
  auto bare = decode_message(hex("92 c4 0b 726561645f6661696c6564 03"));
  ASSERT_TRUE(bare);
  EXPECT_EQ(std::get<ReadFailed>(*bare).error, "");
}

TEST(Protocol, AReadinessEncodedInTwoPartsIsTheSameBytesAsWhole) {
  ReadReadyBatch m;
  m.layer_idx = 3;
  m.layer_name = "model.layers.3.self_attn";
  m.read_reqs.push_back({"a", {1, 2, 3}, {4, 5}, 7, 9});
  m.read_reqs.push_back({"b", {}, {6}, 0, 2});
  m.done_ext_ids = {"a"};
  m.group_member_idx = 1;
  m.tp_ratio = 2;
  const auto body = encode_readiness_body(m);
  EXPECT_EQ(encode_readiness(3, "model.layers.3.self_attn", body), encode(m));
  // Another layer from the same body: only the layer's fields differ.
  auto other = decode_message(encode_readiness(40, "model.layers.40.self_attn", body));
  ASSERT_TRUE(other) << other.status().to_string();
  const auto& back = std::get<ReadReadyBatch>(*other);
  EXPECT_EQ(back.layer_idx, 40);
  EXPECT_EQ(back.layer_name, "model.layers.40.self_attn");
  ASSERT_EQ(back.read_reqs.size(), 2u);
  EXPECT_EQ(back.read_reqs[1].indexer_block_ids, std::vector<int64_t>{6});
  EXPECT_EQ(back.done_ext_ids, std::vector<std::string>{"a"});
  EXPECT_EQ(back.tp_ratio, 2);
}

TEST(Protocol, UnequalTpFieldsRoundTrip) {
  ReadReadyBatch m;
  m.layer_idx = 60;
  m.layer_name = "model.layers.60.self_attn";
  m.read_reqs.push_back({"a", {1, 2, 3}, {4, 5}, 7, 9});
  m.group_member_idx = 3;
  m.tp_ratio = 4;
  auto d = decode_message(encode(m));
  ASSERT_TRUE(d) << d.status().to_string();
  const auto& back = std::get<ReadReadyBatch>(*d);
  EXPECT_EQ(back.group_member_idx, 3);
  EXPECT_EQ(back.tp_ratio, 4);
  EXPECT_EQ(back.read_reqs[0].main_start, 7);
  EXPECT_EQ(back.read_reqs[0].indexer_start, 9);
}

MfMeta sample_meta() {
  MfMeta m;
  m.p_session = "10.0.0.1:5000";
  LayerMeta l;
  l.base_addrs = {0x7f0000000000, 0x7f0000100000, 0x7f0000200000};
  l.block_len = {4096, 512, 512};
  l.block_size_scale = {32, 32, 32};
  l.tensor_group_idx = {0, 0, 1};
  l.main_tensor_count = 2;
  l.has_indexer = true;
  m.layers = {{"model.layers.0.self_attn", l}, {"model.layers.1.self_attn", l}};
  m.backend_name = "ucx";
  m.backend_metadata = bytes({1, 2, 3});
  return m;
}

TEST(Protocol, MfMetaRoundTripsWithAppendedFields) {
  auto d = decode_message(encode(sample_meta()));
  ASSERT_TRUE(d) << d.status().to_string();
  const auto& m = std::get<MfMeta>(*d);
  EXPECT_EQ(m.p_session, "10.0.0.1:5000");
  ASSERT_EQ(m.layers.size(), 2u);
  EXPECT_EQ(m.layers[1].first, "model.layers.1.self_attn");
  EXPECT_EQ(m.layers[0].second.bytes_per_block(0), 4096u * 32);
  EXPECT_TRUE(m.layers[0].second.has_indexer);
  EXPECT_EQ(m.protocol_version, kProtocolVersion);
  EXPECT_EQ(m.cache_layout_version, kCacheLayoutVersion);
  EXPECT_EQ(m.backend_name, "ucx");
  EXPECT_EQ(m.backend_metadata, bytes({1, 2, 3}));
  EXPECT_TRUE(check_compatible(m).is_ok());
}

TEST(Protocol, LegacyMfMetaHasNoVersionsAndIsAccepted) {
  auto full = encode(sample_meta());
  // A legacy peer sends only the first three elements: rewrite the array header to 3 and
  // cut the appended fields (versions 01 01, str "ucx", bin of 3 bytes: 1+1+4+5 bytes).
  std::vector<std::byte> legacy(full.begin(), full.end() - 11);
  legacy[0] = std::byte{0x93};
  auto d = decode_message(legacy);
  ASSERT_TRUE(d) << d.status().to_string();
  const auto& m = std::get<MfMeta>(*d);
  EXPECT_FALSE(m.protocol_version.has_value());
  EXPECT_FALSE(m.cache_layout_version.has_value());
  EXPECT_TRUE(check_compatible(m).is_ok());
}

TEST(Protocol, IncompatibleVersionsAreRefusedNamingBoth) {
  MfMeta m = sample_meta();
  m.protocol_version = kProtocolVersion + 1;
  Status st = check_compatible(m);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("protocol version " + std::to_string(kProtocolVersion + 1)),
            std::string::npos);
  EXPECT_NE(st.message().find("this build speaks " + std::to_string(kProtocolVersion)),
            std::string::npos);
  m.protocol_version = kProtocolVersion;
  m.cache_layout_version = 7;
  st = check_compatible(m);
  EXPECT_NE(st.message().find("cache-layout version 7"), std::string::npos) << st.message();
}

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

TEST(Protocol, ALayerMapNeedsOnlyBaseAddrsAndBlockLen) {
  // {"L": {"base_addrs": [1, 2, 3], "block_len": [4096, 512, 512]}}
  const std::string map =
      "81 a1 4c 82 aa 626173655f6164647273 93 01 02 03 a9 626c6f636b5f6c656e 93 cd1000 cd0200 "
      "cd0200";
  auto d = decode_message(hex("93 c4 07 6d665f6d657461 a1 53 c4 27 " + map));
  ASSERT_TRUE(d) << d.status().to_string();
  const auto& l = std::get<MfMeta>(*d).layers.at(0).second;
  EXPECT_EQ(l.block_size_scale, (std::vector<uint64_t>{1, 1, 1}));
  EXPECT_EQ(l.main_tensor_count, 2u);
  EXPECT_TRUE(l.has_indexer) << "three tensors, two of them main";
  EXPECT_EQ(l.bytes_per_block(0), 4096u);
  // Without block_len there is nothing to read.
  auto e = decode_message(hex("93 c4 07 6d665f6d657461 a1 53 c4 13 81 a1 4c 81 aa "
                              "626173655f6164647273 93 01 02 03"));
  ASSERT_FALSE(e);
  EXPECT_NE(e.status().message().find("missing base_addrs or block_len"), std::string::npos)
      << e.status().message();
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

TEST(Protocol, AckIsTheThreeRawBytes) {
  EXPECT_TRUE(is_ack(bytes({'A', 'C', 'K'})));
  EXPECT_FALSE(is_ack(bytes({'A', 'C'})));
  EXPECT_FALSE(is_ack(bytes({0xa3, 'A', 'C', 'K'})));
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
