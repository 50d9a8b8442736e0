// The wire messages as rd2h writes and reads them: byte for byte as docs/wire-format.md, the
// defaults of shorter (legacy) tuples, round trips, versions and the ACK.
#include "protocol/messages.h"

#include <gtest/gtest.h>

#include "protocol/messages_fixture.h"

namespace rd2h::protocol {
namespace {

using rd2h::testing::bytes;
using rd2h::testing::hex;
using rd2h::testing::sample_meta;

// The example of docs/wire-format.md, byte for byte.
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

TEST(Protocol, AckIsTheThreeRawBytes) {
  EXPECT_TRUE(is_ack(bytes({'A', 'C', 'K'})));
  EXPECT_FALSE(is_ack(bytes({'A', 'C'})));
  EXPECT_FALSE(is_ack(bytes({0xa3, 'A', 'C', 'K'})));
}

}  // namespace
}  // namespace rd2h::protocol
