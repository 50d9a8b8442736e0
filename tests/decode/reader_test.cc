// A Decode rank's reader against a Prefill made of the real pieces: a UCX engine exposing a
// KV pool and a ZMQ DEALER speaking the wire protocol, on loopback in one process: layers read
// into their destinations, readiness held for them, requests aborted, late or left by Prefill.
#include "decode/reader.h"

#include <gtest/gtest.h>

#include <thread>

#include "decode/reader_fixture.h"
#include "rd2h/common/deadline.h"
#include "support/http_server.h"
#include "transfer/fault_injecting_engine.h"

namespace rd2h::decode {
namespace {

using namespace std::chrono_literals;

using namespace rd2h::testing;

TEST_F(ReaderTest, EveryLayerIsReadIntoItsDestinationsAndTheRequestCompletes) {
  send_mf_meta(mf_meta(prefill_));
  ASSERT_TRUE(reader_->add_request("req-0", "int-0", {3, 9, 4}, {11, 12, 13}).is_ok());
  const std::vector<int64_t> src_main{1, 7, 2}, src_idx{5, 6, 0};
  for (int l = 0; l < kLayers; ++l) {
    std::vector<std::string> done;
    if (l == kLayers - 1) done = {"req-0"};
    auto m =
        exchange_message(protocol::encode(ready(l, {{"req-0", src_main, src_idx, 0, 0}}, done)));
    ASSERT_TRUE(std::holds_alternative<protocol::ReadDone>(m)) << "layer " << l;
    EXPECT_EQ(std::get<protocol::ReadDone>(m).layer_idx, l);
    EXPECT_TRUE(reader_->get_finished(kAlone)->finished.empty())
        << "complete before Prefill committed it, at layer " << l;
  }
  commit(kLayers - 1, {"req-0"});
  sync_with_reader();
  for (int l = 0; l < kLayers; ++l) {
    const std::vector<int64_t> dst_main{3, 9, 4}, dst_idx{11, 12, 13};
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_TRUE(decode_.holds(l, 0, dst_main[i], src_main[i]))
          << "K layer " << l << " block " << i;
      EXPECT_TRUE(decode_.holds(l, 1, dst_main[i], src_main[i]))
          << "V layer " << l << " block " << i;
      EXPECT_TRUE(decode_.holds(l, 2, dst_idx[i], src_idx[i])) << "indexer layer " << l;
    }
  }
  EXPECT_EQ(reader_->get_finished(kAlone)->finished, std::vector<std::string>{"int-0"});
}

TEST_F(ReaderTest, AReadinessWithNoBlocksIsStillAnswered) {
  send_mf_meta(mf_meta(prefill_));
  auto m = exchange_message(protocol::encode(ready(1, {})));
  ASSERT_TRUE(std::holds_alternative<protocol::ReadDone>(m));
  EXPECT_EQ(std::get<protocol::ReadDone>(m).layer_idx, 1);
}

TEST_F(ReaderTest, ReadinessBeforeTheDestinationsIsHeldUntilTheyArriveAndRepliesKeepOrder) {
  ReaderConfig config;
  config.hold_timeout = 30s;
  start_reader(config);
  send_mf_meta(mf_meta(prefill_));
  ASSERT_TRUE(dealer_->send(protocol::encode(ready(0, {{"late", {4}, {5}, 0, 0}}))).is_ok());
  ASSERT_TRUE(dealer_->send(protocol::encode(ready(1, {}))).is_ok());  // queued behind layer 0
  ASSERT_TRUE(wait_held(*reader_, 2)) << "the reader did not hold the readiness";
  ASSERT_TRUE(reader_->add_request("late", "int-late", {8}, {9}).is_ok());
  for (int l : {0, 1}) {
    auto reply = dealer_->receive(10s);
    ASSERT_TRUE(reply && reply->has_value());
    auto m = protocol::decode_message(**reply);
    ASSERT_TRUE(m && std::holds_alternative<protocol::ReadDone>(*m)) << "layer " << l;
    EXPECT_EQ(std::get<protocol::ReadDone>(*m).layer_idx, l);
  }
  sync_with_reader();
  EXPECT_TRUE(decode_.holds(0, 0, 8, 4));
  EXPECT_TRUE(decode_.holds(0, 2, 9, 5));
  EXPECT_GE(reader_->stats().readiness_held, 2u);
}

TEST_F(ReaderTest, AHeldReadinessFailsWhenItsHoldExpires) {
  send_mf_meta(mf_meta(prefill_));
  auto m = exchange_message(protocol::encode(ready(2, {{"never", {1}, {1}, 0, 0}})));
  ASSERT_TRUE(std::holds_alternative<protocol::ReadFailed>(m));
  EXPECT_NE(std::get<protocol::ReadFailed>(m).error.find("never"), std::string::npos);
  EXPECT_EQ(reader_->stats().held_now, 0u);
}

TEST_F(ReaderTest, AnAbortedRequestIsSkippedWithoutFailingTheLayer) {
  send_mf_meta(mf_meta(prefill_));
  ASSERT_TRUE(reader_->add_request("gone", "int-gone", {2}, {2}).is_ok());
  ASSERT_TRUE(reader_->add_request("kept", "int-kept", {3}, {3}).is_ok());
  reader_->remove_request("gone");
  auto m = exchange_message(protocol::encode(
      ready(0, {{"gone", {6}, {6}, 0, 0}, {"kept", {7}, {7}, 0, 0}}, {"gone", "kept"})));
  ASSERT_TRUE(std::holds_alternative<protocol::ReadDone>(m));
  sync_with_reader();
  EXPECT_TRUE(decode_.zero(0, 0, 2)) << "an aborted request's blocks were written";
  EXPECT_TRUE(decode_.holds(0, 0, 3, 7));
}

TEST_F(ReaderTest, AnAbortedLoadIsReportedFinishedOnceSoItsBlocksCanBeFreed) {
  // vLLM keeps the blocks of a request aborted while its KV loads until the id comes back
  // as received; an id that already ended is not reported again.
  ASSERT_TRUE(reader_->add_request("aborted", "int-aborted", {2}, {2}).is_ok());
  ASSERT_TRUE(reader_->add_request("done", "int-done", {3}, {3}).is_ok());
  send_mf_meta(mf_meta(prefill_));
  auto m = exchange_message(protocol::encode(ready(0, {{"done", {7}, {7}, 0, 0}}, {"done"})));
  ASSERT_TRUE(std::holds_alternative<protocol::ReadDone>(m));
  commit(0, {"done"});
  auto first = reader_->get_finished(kAlone);
  ASSERT_TRUE(first);
  EXPECT_EQ(first->finished, std::vector<std::string>{"int-done"});
  reader_->remove_request("aborted");
  reader_->remove_request("done");  // ended already: nothing to report
  auto second = reader_->get_finished(kAlone);
  ASSERT_TRUE(second);
  EXPECT_EQ(second->finished, std::vector<std::string>{"int-aborted"});
  EXPECT_TRUE(second->failed.empty());
  EXPECT_EQ(second->ended_ext_ids, std::vector<std::string>{"aborted"});
  EXPECT_TRUE(reader_->get_finished(kAlone)->finished.empty()) << "reported twice";
  EXPECT_EQ(reader_->tracked_requests(), 0u);
}

TEST_F(ReaderTest, ARequestGivenUpDuringAReadIntoItIsReportedOnlyOnceTheReadReturned) {
  auto engine = std::make_shared<transfer::FaultInjectingEngine>(decode_engine_);
  decode_engine_ = engine;
  ReaderConfig config;
  start_reader(config);
  send_mf_meta(mf_meta(prefill_));
  ASSERT_TRUE(reader_->add_request("r", "int-r", {2}, {2}).is_ok());
  engine->hold_reads();
  ASSERT_TRUE(dealer_->send(protocol::encode(ready(0, {{"r", {6}, {6}, 0, 0}}))).is_ok());
  ASSERT_TRUE(eventually([&] { return engine->held_reads() == 1; })) << "the read never began";
  reader_->remove_request("r");  // Decode gives it up while its blocks are being written
  EXPECT_TRUE(reader_->get_finished(kAlone)->finished.empty())
      << "reported while a read into its blocks was in flight";
  engine->release_reads();
  auto reply = dealer_->receive(10s);
  ASSERT_TRUE(reply && reply->has_value());
  EXPECT_EQ(reader_->get_finished(kAlone)->finished, std::vector<std::string>{"int-r"});
}

// A new Prefill's session is opened off the reader thread: a connect that takes its time
// stalls no Prefill already connected, and the new one gets its ACK once it is done.
TEST_F(ReaderTest, ASlowNewPrefillDoesNotStallAConnectedOne) {
  auto engine = std::make_shared<transfer::FaultInjectingEngine>(decode_engine_);
  decode_engine_ = engine;
  start_reader(ReaderConfig{});
  send_mf_meta(mf_meta(prefill_));
  ASSERT_TRUE(reader_->add_request("r", "int-r", {2}, {2}).is_ok());
  engine->hold_connects();
  auto slow = control::DealerChannel::connect(context_, reader_->url());
  ASSERT_TRUE(slow);
  ASSERT_TRUE((*slow)->send(protocol::encode(mf_meta(prefill_))).is_ok());
  ASSERT_TRUE(eventually([&] { return engine->held_connects() == 1; }));
  EXPECT_TRUE(std::holds_alternative<protocol::ReadDone>(
      exchange_message(protocol::encode(ready(0, {{"r", {6}, {6}, 0, 0}})))))
      << "the connected Prefill waited for the other's connect";
  EXPECT_EQ(engine->held_connects(), 1);
  // What the new connection sends before its ACK is answered after it, in order.
  ASSERT_TRUE((*slow)->send(protocol::encode(ready(1, {}))).is_ok());
  engine->release_connects();
  auto ack = (*slow)->receive(10s);
  ASSERT_TRUE(ack && ack->has_value());
  EXPECT_TRUE(protocol::is_commit_ack(**ack));
  auto answer = (*slow)->receive(10s);
  ASSERT_TRUE(answer && answer->has_value());
  auto m = protocol::decode_message(**answer);
  ASSERT_TRUE(m) << m.status().to_string();
  EXPECT_TRUE(std::holds_alternative<protocol::ReadDone>(*m));
}

// The answer `dealer` receives next, decoded.
protocol::Message next_answer(control::DealerChannel& dealer) {
  auto reply = dealer.receive(10s);
  EXPECT_TRUE(reply && reply->has_value()) << "no answer within 10 s";
  if (!reply || !reply->has_value()) return {};
  auto m = protocol::decode_message(**reply);
  EXPECT_TRUE(m) << m.status().to_string();
  return m ? *m : protocol::Message{};
}

int64_t done_layer(const protocol::Message& m) {
  const auto* done = std::get_if<protocol::ReadDone>(&m);
  return done != nullptr ? done->layer_idx : -1;
}

TEST_F(ReaderTest, ReadsOfTwoConnectionsAreInFlightAtOnceAndEachConnectionKeepsItsOrder) {
  auto engine = std::make_shared<transfer::FaultInjectingEngine>(decode_engine_);
  decode_engine_ = engine;
  start_reader(ReaderConfig{});
  send_mf_meta(mf_meta(prefill_));
  auto other = control::DealerChannel::connect(context_, reader_->url());
  ASSERT_TRUE(other);
  ASSERT_TRUE((*other)->send(protocol::encode(mf_meta(prefill_))).is_ok());
  auto ack = (*other)->receive(10s);
  ASSERT_TRUE(ack && ack->has_value() && protocol::is_commit_ack(**ack));
  ASSERT_TRUE(reader_->add_request("a", "int-a", {2}, {2}).is_ok());
  ASSERT_TRUE(reader_->add_request("b", "int-b", {3}, {3}).is_ok());

  engine->hold_completions();  // reads stay in flight until released
  ASSERT_TRUE(dealer_->send(protocol::encode(ready(0, {{"a", {6}, {6}, 0, 0}}))).is_ok());
  ASSERT_TRUE((*other)->send(protocol::encode(ready(0, {{"b", {7}, {7}, 0, 0}}))).is_ok());
  ASSERT_TRUE(eventually([&] { return engine->completions_held() == 2; }))
      << "the second connection's read waited for the first's";
  // Behind its read in flight, the connection's next readiness waits for that answer.
  ASSERT_TRUE(dealer_->send(protocol::encode(ready(1, {}))).is_ok());
  engine->release_completions();
  EXPECT_EQ(done_layer(next_answer(*dealer_)), 0);
  EXPECT_EQ(done_layer(next_answer(*dealer_)), 1) << "answers out of order";
  EXPECT_EQ(done_layer(next_answer(**other)), 0);
  sync_with_reader();
  EXPECT_TRUE(decode_.holds(0, 0, 2, 6));
  EXPECT_TRUE(decode_.holds(0, 2, 2, 6));
  EXPECT_TRUE(decode_.holds(0, 0, 3, 7));
  EXPECT_TRUE(decode_.holds(0, 2, 3, 7));
}

TEST_F(ReaderTest, ARequestWhoseKvDoesNotArriveInTimeFailsWithItsBlocks) {
  const auto now = std::chrono::steady_clock::now();
  ASSERT_TRUE(reader_->add_request("late", "int-late", {2, 3}, {4}, now).is_ok());
  ASSERT_TRUE(reader_->add_request("timely", "int-timely", {5}, {6}, now + 1h).is_ok());
  auto done = reader_->get_finished(kAlone);
  ASSERT_TRUE(done);
  EXPECT_EQ(done->failed, std::vector<std::string>{"int-late"});
  EXPECT_TRUE(done->finished.empty()) << "the request with time left ended";
  EXPECT_EQ(done->invalid_main_blocks, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(done->invalid_indexer_blocks, std::vector<int64_t>{4});
  EXPECT_EQ(reader_->tracked_requests(), 1u);
}

TEST_F(ReaderTest, AClosedConnectionTakesItsStateAlong) {
  ReaderConfig config;
  config.hold_timeout = 60s;
  start_reader(config);
  send_mf_meta(mf_meta(prefill_));
  ASSERT_TRUE(dealer_->send(protocol::encode(ready(0, {{"unknown", {1}, {1}, 0, 0}}))).is_ok());
  ASSERT_TRUE(wait_held(*reader_, 1));
  EXPECT_EQ(reader_->stats().connections, 1u);
  dealer_.reset();  // Prefill goes away
  Deadline deadline(10s);
  while (reader_->stats().connections != 0 || reader_->stats().held_now != 0) {
    ASSERT_FALSE(deadline.expired()) << "the closed connection's MF_META or readiness is kept";
    std::this_thread::yield();
  }
}

TEST_F(ReaderTest, ARequestReadWholeButNeverCommittedFailsWhenItsConnectionEnds) {
  // Prefill gave this Decode up after the last layer was read (its answer came too late):
  // no commit comes, and the connection's end fails the request rather than complete it.
  send_mf_meta(mf_meta(prefill_));
  ASSERT_TRUE(reader_->add_request("late", "int-late", {3}, {11}).is_ok());
  ASSERT_TRUE(reader_->add_request("committed", "int-committed", {4}, {12}).is_ok());
  auto m = exchange_message(protocol::encode(
      ready(kLayers - 1, {{"late", {1}, {5}, 0, 0}, {"committed", {2}, {6}, 0, 0}},
            {"late", "committed"})));
  ASSERT_TRUE(std::holds_alternative<protocol::ReadDone>(m));
  commit(kLayers - 1, {"committed"});  // a commit names what it commits, nothing else
  auto before = reader_->get_finished(kAlone);
  ASSERT_TRUE(before) << before.status().to_string();
  EXPECT_EQ(before->finished, std::vector<std::string>{"int-committed"});
  EXPECT_TRUE(before->failed.empty());
  dealer_.reset();
  Finished ended;
  Deadline deadline(10s);
  while (ended.failed.empty() && ended.finished.empty()) {
    ASSERT_FALSE(deadline.expired()) << "the uncommitted request outlived its connection";
    auto f = reader_->get_finished(kAlone);
    ASSERT_TRUE(f) << f.status().to_string();
    ended.finished = f->finished;
    ended.failed = f->failed;
    std::this_thread::yield();
  }
  EXPECT_TRUE(ended.finished.empty()) << "completed without Prefill's commit";
  EXPECT_EQ(ended.failed, std::vector<std::string>{"int-late"});
}

TEST_F(ReaderTest, APrefillConnectionThatClosesMidRequestFailsItAtOnce) {
  // Prefill's process died between two layers: no final layer will come for its requests,
  // and Decode must not wait out its arrival deadline for them.
  send_mf_meta(mf_meta(prefill_));
  ASSERT_TRUE(reader_->add_request("req-0", "int-0", {3}, {11}).is_ok());
  ASSERT_TRUE(reader_->add_request("req-1", "int-1", {4}, {12}).is_ok());
  auto m = exchange_message(protocol::encode(ready(0, {{"req-0", {1}, {5}, 0, 0}})));
  ASSERT_TRUE(std::holds_alternative<protocol::ReadDone>(m));
  // req-1 is complete before the connection goes: it is not failed with the other.
  m = exchange_message(
      protocol::encode(ready(kLayers - 1, {{"req-1", {2}, {6}, 0, 0}}, {"req-1"})));
  ASSERT_TRUE(std::holds_alternative<protocol::ReadDone>(m));
  commit(kLayers - 1, {"req-1"});
  auto before = reader_->get_finished(kAlone);
  ASSERT_TRUE(before) << before.status().to_string();
  EXPECT_TRUE(before->failed.empty());
  dealer_.reset();  // Prefill goes away
  Finished ended;
  ended.finished = before->finished;
  Deadline deadline(10s);
  while (ended.failed.empty()) {
    ASSERT_FALSE(deadline.expired()) << "req-0 still waits for a Prefill that is gone";
    auto f = reader_->get_finished(kAlone);
    ASSERT_TRUE(f) << f.status().to_string();
    ended.finished.insert(ended.finished.end(), f->finished.begin(), f->finished.end());
    ended.failed.insert(ended.failed.end(), f->failed.begin(), f->failed.end());
    std::this_thread::yield();
  }
  EXPECT_EQ(ended.failed, std::vector<std::string>{"int-0"});
  EXPECT_EQ(ended.finished, std::vector<std::string>{"int-1"});
}

}  // namespace
}  // namespace rd2h::decode
