// The connector end to end: Prefill workers publishing layers, Decode workers reading them,
// over real UCX (shared memory) and ZeroMQ on loopback, in every supported TP topology.
#include <gtest/gtest.h>

#include "e2e/pd_cluster.h"

namespace rd2h::testing {
namespace {

// Request `id` of `blocks` blocks: Prefill blocks from `p_first` up, Decode destinations
// from `d_first` up in a shuffled order, indexer ids distinct from main ids on both sides.
PdRequest make_request(std::string id, size_t blocks, int64_t p_first, int64_t d_first,
                       uint64_t total_blocks, int instance = 0) {
  PdRequest r;
  r.id = std::move(id);
  r.instance = instance;
  const auto n = static_cast<int64_t>(total_blocks);
  for (size_t i = 0; i < blocks; ++i) {
    const auto k = static_cast<int64_t>(i);
    r.p_main.push_back(p_first + k);
    r.p_indexer.push_back((p_first + k + 5) % n);
    r.d_main.push_back(d_first + static_cast<int64_t>(blocks) - 1 - k);  // reversed
    r.d_indexer.push_back((d_first + k * 3) % n);
  }
  return r;
}

ClusterShape with_tp(int p_tp, int d_tp) {
  ClusterShape shape;
  shape.p_tp = p_tp;
  shape.d_tp = d_tp;
  return shape;
}

void expect_all_ok(const std::vector<Status>& results) {
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_TRUE(results[r].is_ok()) << "Prefill rank " << r << ": " << results[r].to_string();
  }
}

std::vector<std::string> sorted(std::vector<std::string> v) {
  std::sort(v.begin(), v.end());
  return v;
}

struct Topology {
  int p_tp;
  int d_tp;
};

class PdTopology : public ::testing::TestWithParam<Topology> {};

TEST_P(PdTopology, ConcurrentAndChunkedRequestsLandByteExactOnEveryDecodeRank) {
  ClusterShape shape;
  shape.p_tp = GetParam().p_tp;
  shape.d_tp = GetParam().d_tp;
  shape.bytes = {512, 64, 128, 32};  // with a LIC8 scale
  Cluster c(shape);
  // Token counts with a block size of 16: a long request prefilled in two chunks (the
  // second ending in a partial block), a one-block request (most ranks own nothing of it)
  // and a mid-sized one.
  const uint64_t bs = 16;
  const PdRequest chunked = make_request("chunked", 7, 0, 0, shape.blocks);  // 100 tokens
  const PdRequest tiny = make_request("tiny", 1, 10, 8, shape.blocks);       // 5 tokens
  const PdRequest mid = make_request("mid", 5, 12, 10, shape.blocks);        // 70 tokens
  for (const auto* r : {&chunked, &tiny, &mid}) c.expect_request(*r);

  auto first = layout::chunk_slice({0, 0, 64, false}, bs, 7);
  auto last = layout::chunk_slice({0, 64, 100, true}, bs, 7);
  auto whole_tiny = layout::chunk_slice({0, 0, 5, true}, bs, 1);
  auto whole_mid = layout::chunk_slice({0, 0, 70, true}, bs, 5);
  ASSERT_TRUE(first && last && whole_tiny && whole_mid);

  expect_all_ok(c.run_step({{&chunked, *first, false}, {&tiny, *whole_tiny, true}}));
  auto done = c.ended(0, 1);
  ASSERT_TRUE(done) << done.status().to_string();
  EXPECT_EQ(done->finished, std::vector<std::string>{"internal-tiny"});
  EXPECT_TRUE(done->failed.empty());

  expect_all_ok(c.run_step({{&chunked, *last, true}, {&mid, *whole_mid, true}}));
  done = c.ended(0, 2);
  ASSERT_TRUE(done) << done.status().to_string();
  EXPECT_EQ(sorted(done->finished), (std::vector<std::string>{"internal-chunked", "internal-mid"}));
  for (int l = 0; l < shape.layers; ++l) {
    for (const auto* r : {&chunked, &tiny, &mid}) {
      std::string why;
      EXPECT_TRUE(c.holds(*r, l, &why)) << why;
    }
  }
  for (int d = 0; d < shape.d_tp; ++d) {
    const auto& rank = c.decode_rank(0, d);
    EXPECT_EQ(rank.worker->reader().stats().layers_failed, 0u);
    EXPECT_EQ(rank.worker->reader().tracked_requests(), 0u) << "request state outlived the request";
  }
}

INSTANTIATE_TEST_SUITE_P(Topologies, PdTopology,
                         ::testing::Values(Topology{1, 1}, Topology{2, 2}, Topology{4, 2},
                                           Topology{8, 2}, Topology{4, 1}),
                         [](const auto& info) {
                           return "P" + std::to_string(info.param.p_tp) + "D" +
                                  std::to_string(info.param.d_tp);
                         });

TEST(PdTransfer, ZeroBlockContributorsStillAnswerAndCompleteTheRequest) {
  ClusterShape shape =
      with_tp(4, 1);  // four contributors, one block: three of them read nothing at all
  Cluster c(shape);
  const PdRequest r = make_request("one", 1, 3, 4, shape.blocks);
  c.expect_request(r);
  expect_all_ok(c.run_step({{&r, {0, 1}, true}}));
  auto done = c.ended(0, 1);
  ASSERT_TRUE(done);
  EXPECT_EQ(done->finished, std::vector<std::string>{"internal-one"});
  for (int l = 0; l < shape.layers; ++l) EXPECT_TRUE(c.holds(r, l)) << "layer " << l;
  // Every contributor's readiness got an answer: 4 contributors x 3 layers.
  EXPECT_EQ(c.decode_rank(0, 0).worker->reader().stats().layers_done, 12u);
}

TEST(PdTransfer, ADuplicateFinalSignalDoesNotCompleteARequestEarly) {
  ClusterShape shape = with_tp(2, 1);
  Cluster c(shape);
  const PdRequest r = make_request("dup", 2, 0, 0, shape.blocks);
  c.expect_request(r);
  // Member 0 alone reports the final chunk twice (two steps), member 1 never does.
  for (int step = 0; step < 2; ++step) {
    auto& p = c.prefill(0);
    ASSERT_TRUE(p.worker
                    ->bind_step({{r.id, "127.0.0.1", c.decode().kv_port, 1, r.p_main, r.p_indexer,
                                  0, 0, true, {}}})
                    .is_ok());
    for (int l = 0; l < shape.layers; ++l) {
      ASSERT_TRUE(p.worker->save_kv_layer(layer_name(l)).is_ok());
    }
    ASSERT_TRUE(p.worker->wait_for_save().is_ok());
    auto done = c.gather_finished();
    ASSERT_TRUE(done);
    EXPECT_TRUE(done->finished.empty()) << "finished on one of two contributors";
  }
}

TEST(PdTransfer, EachLayoutMismatchFailsTheLayerOnBothSidesAndWritesNothing) {
  struct Case {
    const char* what;
    std::vector<uint64_t> decode_bytes;
    int64_t bad_destination;  // -1: none
    const char* reason;
  };
  const std::vector<Case> cases = {
      {"main bytes", {512, 32, 128, 32}, -1, "main tensor 1"},
      {"indexer bytes", {512, 64, 256, 32}, -1, "indexer"},
      {"scale missing on Decode", {512, 64, 128}, -1, "scale"},
      {"scale bytes", {512, 64, 128, 16}, -1, "scale"},
      {"destination block outside the allocation", {}, 40, "destination block 40"},
  };
  for (const auto& k : cases) {
    SCOPED_TRACE(k.what);
    ClusterShape shape = with_tp(2, 2);
    shape.bytes = {512, 64, 128, 32};
    shape.decode_bytes = k.decode_bytes;
    Cluster c(shape);
    PdRequest r = make_request("r", 6, 0, 0, shape.blocks);
    if (k.bad_destination >= 0) r.d_main[2] = r.d_indexer[2] = k.bad_destination;
    c.expect_request(r);
    const auto results = c.run_step({{&r, {0, 6}, true}});
    for (size_t p = 0; p < results.size(); ++p) {
      EXPECT_FALSE(results[p].is_ok()) << "Prefill rank " << p << " did not raise";
      EXPECT_NE(results[p].message().find(k.reason), std::string::npos) << results[p].message();
      EXPECT_NE(results[p].message().find("layer 0"), std::string::npos) << results[p].message();
    }
    EXPECT_TRUE(c.untouched()) << "a layer that failed validation wrote bytes";
    auto done = c.ended(0, 1);
    ASSERT_TRUE(done) << done.status().to_string();
    EXPECT_EQ(done->failed, std::vector<std::string>{"internal-r"});
    EXPECT_TRUE(done->finished.empty());
    std::vector<int64_t> invalid = done->invalid_main_blocks;
    std::sort(invalid.begin(), invalid.end());
    std::vector<int64_t> expected = r.d_main;
    std::sort(expected.begin(), expected.end());
    EXPECT_EQ(invalid, expected) << "the failed request's blocks are reported invalid";
  }
}

TEST(PdTransfer, AFailedReadReachesDecodeStateAndThePrefillComputePathAndFreesTheSlots) {
  ClusterShape shape = with_tp(2, 2);
  Cluster c(shape);
  const PdRequest bad = make_request("bad", 4, 0, 0, shape.blocks);
  c.expect_request(bad);
  c.decode_rank(0, 1).engine->fail_next_reads(1, transport_error("injected link failure"));
  const auto results = c.run_step({{&bad, {0, 4}, true}});
  // Prefill rank 1 sends to Decode rank 1, whose first read fails.
  EXPECT_TRUE(results[0].is_ok()) << results[0].to_string();
  ASSERT_FALSE(results[1].is_ok());
  EXPECT_NE(results[1].message().find("injected link failure"), std::string::npos)
      << results[1].message();
  EXPECT_NE(results[1].message().find("layer 0"), std::string::npos) << results[1].message();
  auto done = c.ended(0, 1);
  ASSERT_TRUE(done) << done.status().to_string();
  EXPECT_EQ(done->failed, std::vector<std::string>{"internal-bad"}) << "failed on any rank";
  EXPECT_EQ(done->invalid_indexer_blocks.size(), bad.d_indexer.size());

  // The slots were released: the next step runs and its request arrives whole.
  const PdRequest good = make_request("good", 4, 8, 8, shape.blocks);
  c.expect_request(good);
  expect_all_ok(c.run_step({{&good, {0, 4}, true}}));
  done = c.ended(0, 1);
  ASSERT_TRUE(done);
  EXPECT_EQ(done->finished, std::vector<std::string>{"internal-good"});
  for (int l = 0; l < shape.layers; ++l) EXPECT_TRUE(c.holds(good, l)) << "layer " << l;
}

TEST(PdTransfer, AKilledDecodeRankMakesPrefillWaitsFailInsteadOfHanging) {
  ClusterShape shape = with_tp(2, 2);
  shape.reply_timeout = 300ms;
  Cluster c(shape);
  const PdRequest first = make_request("first", 2, 0, 0, shape.blocks);
  c.expect_request(first);
  expect_all_ok(c.run_step({{&first, {0, 2}, true}}));  // both connections are up
  c.decode_rank(0, 1).worker.reset();                   // Decode rank 1 dies
  const PdRequest second = make_request("second", 2, 4, 4, shape.blocks);
  c.expect_request(second);
  const auto results = c.run_step({{&second, {0, 2}, true}});
  EXPECT_TRUE(results[0].is_ok()) << results[0].to_string();
  ASSERT_FALSE(results[1].is_ok()) << "Prefill rank 1 waited on a dead Decode rank and passed";
  // Depending on when the sender notices: the connection closed, the readiness got no
  // answer, a new connection found nothing listening, or its MF_META got no ACK. The kind
  // survives: a dead peer, or a deadline.
  const std::string& why = results[1].message();
  EXPECT_TRUE(why.find("Decode restarted or died") != std::string::npos ||
              why.find("no answer") != std::string::npos || why.find("no ACK") != std::string::npos)
      << why;
  EXPECT_TRUE(results[1].code() == StatusCode::kPeerDead ||
              results[1].code() == StatusCode::kUnreachable ||
              results[1].code() == StatusCode::kTimeout)
      << results[1].to_string();
}

TEST(PdTransfer, ADeadDecodeFailsOnlyItsRequestsAndThePrefillComputePathGoesOn) {
  ClusterShape shape = with_tp(2, 1);
  shape.decode_instances = 2;
  shape.reply_timeout = 300ms;
  shape.raise_on_peer_failure = false;  // the connector's default
  Cluster c(shape);
  const PdRequest first = make_request("first", 2, 0, 0, shape.blocks, 0);
  c.expect_request(first);
  expect_all_ok(c.run_step({{&first, {0, 2}, true}}));  // the connections to instance 0 are up
  ASSERT_TRUE(c.ended(0, 1));
  c.decode_rank(0, 0).worker.reset();  // instance 0 dies
  const PdRequest lost = make_request("lost", 2, 4, 4, shape.blocks, 0);
  const PdRequest kept = make_request("kept", 2, 8, 8, shape.blocks, 1);
  c.expect_request(kept);
  expect_all_ok(c.run_step({{&lost, {0, 2}, true}, {&kept, {0, 2}, true}}));
  for (int r = 0; r < shape.p_tp; ++r) {
    EXPECT_GT(c.prefill(r).worker->stats().peer_failures, 0u) << "Prefill rank " << r;
  }
  const auto done = c.ended(1, 1);
  ASSERT_TRUE(done);
  EXPECT_EQ(done->finished, std::vector<std::string>{"internal-kept"});
  for (int l = 0; l < shape.layers; ++l) EXPECT_TRUE(c.holds(kept, l)) << "layer " << l;
  // And the next step runs as any other.
  const PdRequest next = make_request("next", 2, 12, 12, shape.blocks, 1);
  c.expect_request(next);
  expect_all_ok(c.run_step({{&next, {0, 2}, true}}));
  EXPECT_EQ(c.ended(1, 1)->finished, std::vector<std::string>{"internal-next"});
}

// The fence: a Decode stalls in the read of a request's last layer; Prefill gives it up at
// its deadline and the next step overwrites the slot. When the Decode resumes, its read
// copies the overwritten bytes, and the request must fail, never complete: Prefill commits
// nothing on a connection it gave up (KV_COMMIT).
TEST(PdTransfer, ADecodeStalledMidReadNeverCompletesFromASlotPrefillReused) {
  ClusterShape shape;
  shape.decode_instances = 2;
  shape.layers = 2;
  shape.prefill_slots = 1;  // both layers in one slot: the next step's layer 0 overwrites it
  shape.reply_timeout = 300ms;
  shape.raise_on_peer_failure = false;
  Cluster c(shape);
  const PdRequest stalled = make_request("stalled", 2, 0, 0, shape.blocks, 0);
  const PdRequest healthy = make_request("healthy", 2, 4, 4, shape.blocks, 1);
  c.expect_request(stalled, std::chrono::steady_clock::now() + 10s);
  c.expect_request(healthy);
  c.decode_rank(0, 0).engine->hold_reads(/*after=*/1);  // layer 0 is read; layer 1 stalls
  expect_all_ok(c.run_step({{&stalled, {0, 2}, true}, {&healthy, {0, 2}, true}}));
  EXPECT_GT(c.prefill(0).worker->stats().peer_failures, 0u);
  EXPECT_EQ(c.ended(1, 1)->finished, std::vector<std::string>{"internal-healthy"});

  const PdRequest next = make_request("next", 2, 8, 8, shape.blocks, 1);
  c.expect_request(next);
  expect_all_ok(c.run_step({{&next, {0, 2}, true}}));
  EXPECT_EQ(c.ended(1, 1)->finished, std::vector<std::string>{"internal-next"});
  // The step ended with layer 1 in the slot again (the same bytes the stalled request was
  // sent): the next compute puts layer 0's there, and the stalled read resumes into that.
  c.write_layer(0, 0);

  c.decode_rank(0, 0).engine->release_reads();
  const auto done = c.ended(0, 1, 20s);
  ASSERT_TRUE(done);
  EXPECT_FALSE(c.holds(stalled, 1)) << "the stalled read did not read the overwritten slot";
  EXPECT_TRUE(done->finished.empty()) << "a request completed from bytes Prefill overwrote";
  EXPECT_EQ(done->failed, std::vector<std::string>{"internal-stalled"});
}

TEST(PdTransfer, SixtyOneLayersShareThreeSlotsAndNoSlotIsOverwrittenBeforeItIsRead) {
  ClusterShape shape = with_tp(2, 1);
  shape.decode_instances = 2;  // every Prefill rank talks to two Decode endpoints
  shape.layers = 61;
  shape.prefill_slots = 3;
  Cluster c(shape);
  EXPECT_EQ(c.prefill(0).worker->slots().main_slot_count(), 3u);
  EXPECT_EQ(c.prefill(0).worker->slots().indexer_slot_count(), 3u);
  // Slow reads on one Decode instance: without the gate, the writer of layer L+3 would
  // overwrite the slot before that instance read layer L.
  c.decode_rank(1, 0).engine->delay_reads(2ms);
  const PdRequest a = make_request("a", 6, 0, 0, shape.blocks, 0);
  const PdRequest b = make_request("b", 6, 6, 6, shape.blocks, 1);
  c.expect_request(a);
  c.expect_request(b);
  expect_all_ok(c.run_step({{&a, {0, 6}, true}, {&b, {0, 6}, true}}));
  for (int d = 0; d < 2; ++d) {
    auto done = c.ended(d, 1);
    ASSERT_TRUE(done);
    EXPECT_EQ(done->finished.size(), 1u) << "instance " << d;
  }
  for (int l = 0; l < shape.layers; ++l) {
    std::string why;
    EXPECT_TRUE(c.holds(a, l, &why)) << why;
    EXPECT_TRUE(c.holds(b, l, &why)) << why;
  }
}

}  // namespace
}  // namespace rd2h::testing
