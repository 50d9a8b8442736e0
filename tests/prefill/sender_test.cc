// Prefill's sender against real Decode readers: ZeroMQ and UCX on loopback, one process.
#include "prefill/sender.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "decode/kv_fixture.h"
#include "decode/reader.h"
#include "support/http_server.h"

namespace rd2h::prefill {
namespace {

using namespace std::chrono_literals;
using namespace rd2h::testing;
using rd2h::testing::eventually;

const decode::AllGather kAlone =
    [](const decode::RankTerminal& mine) -> Expected<std::vector<decode::RankTerminal>> {
  return std::vector<decode::RankTerminal>{mine};
};

// A readiness sent as the Prefill worker sends it: encoded once, its done ids committed
// once Decode answers.
void send_ready(Sender& s, const std::string& url, const protocol::ReadReadyBatch& r,
                std::vector<GateTicket> tickets, std::shared_ptr<WriteEvent> event = nullptr) {
  s.send(url, r.layer_idx, protocol::encode(r), std::move(tickets), std::move(event), {},
         r.done_ext_ids);
}

class SenderTest : public ::testing::Test {
 protected:
  void start_reader(int port = 0, bool control_link = true,
                    std::chrono::microseconds busy_poll = {}) {
    reader_.reset();
    if (!decode_engine_) {
      decode_engine_ = std::shared_ptr<transfer::TransferEngine>(std::move(decode_.engine));
    }
    decode::DecodeLayout layout;
    for (int l = 0; l < kLayers; ++l) layout[layer_name(l)] = decode_.tensors(l);
    decode::ReaderConfig config;
    config.port = port;
    config.control_link = control_link;
    config.busy_poll = busy_poll;
    auto r = decode::Reader::start(config, decode_engine_, std::move(layout), context_);
    ASSERT_TRUE(r) << r.status().to_string();
    reader_ = std::move(*r);
  }
  std::unique_ptr<Sender> sender(SenderConfig config = {}) {
    auto s = Sender::start(config, context_, mf_meta(prefill_));
    EXPECT_TRUE(s) << s.status().to_string();
    return s ? std::move(*s) : nullptr;
  }
  // A sender whose connections may move to the Prefill engine's links (the pool outlives it).
  std::unique_ptr<Sender> linked_sender(SenderConfig config = {}) {
    std::shared_ptr<transfer::TransferEngine> engine(prefill_.engine.get(),
                                                     [](transfer::TransferEngine*) {});
    auto s = Sender::start(config, context_, mf_meta(prefill_), std::move(engine));
    EXPECT_TRUE(s) << s.status().to_string();
    return s ? std::move(*s) : nullptr;
  }
  // Sends empty layers one at a time until one more went on the link (at most 200): the
  // link opens on Prefill's side a moment after Decode opened it.
  bool reach_the_link(Sender& s, SlotGate& gate) {
    const uint64_t before = s.stats().readiness_on_link;
    for (int i = 0; i < 200 && s.stats().readiness_on_link == before; ++i) {
      if (!send_and_wait(s, ready(i % kLayers, {}), gate).is_ok()) return false;
    }
    return s.stats().readiness_on_link > before;
  }
  static protocol::ReadReadyBatch ready(int layer, std::vector<protocol::ReadReq> reqs,
                                        std::vector<std::string> done = {}, int member = 0,
                                        int ratio = 1) {
    return {layer, layer_name(layer), std::move(reqs), std::move(done), member, ratio};
  }
  // Waits for the gate's answers the way the Prefill worker does.
  static Status wait(SlotGate& gate) { return gate.settle(Deadline(10s)); }
  // Sends one readiness through a fresh gate generation and waits for its answer.
  Status send_and_wait(Sender& s, const protocol::ReadReadyBatch& r, SlotGate& gate) {
    const uint64_t g = gate.open(r.layer_idx, 1);
    send_ready(s, reader_url_or_(), r, {{&gate, g}});
    return wait(gate);
  }
  // A reader and a sender whose connection to it is acknowledged (one layer went through).
  std::unique_ptr<Sender> acknowledged_sender() {
    start_reader();
    auto s = sender();
    SlotGate gate;
    if (!s || !send_and_wait(*s, ready(0, {}), gate).is_ok()) return nullptr;
    return s;
  }
  // Returns once the reader took what `s` sent before, commits included (KV_COMMIT follows
  // a final layer's answer; an empty readiness behind it comes back after it was taken).
  void through(Sender& s) {
    SlotGate gate;
    ASSERT_TRUE(send_and_wait(s, ready(0, {}), gate).is_ok());
  }
  std::string reader_url_or_() const {
    return url_override_.empty() ? reader_->url() : url_override_;
  }
  void sync_with_reader() { (void)reader_->tracked_requests(); }

  Pool prefill_{transfer::Role::kPrefill, true};
  Pool decode_{transfer::Role::kDecode, false};
  std::shared_ptr<transfer::TransferEngine> decode_engine_;
  std::shared_ptr<control::Context> context_ = control::Context::create();
  std::unique_ptr<decode::Reader> reader_;
  std::string url_override_;
};

TEST_F(SenderTest, LayersFlowThroughTheSlotGatesAndTheBytesArrive) {
  start_reader();
  auto s = sender();
  ASSERT_TRUE(reader_->add_request("r", "i", {3, 9, 4}, {11, 12, 13}).is_ok());
  SlotGate gate;  // one physical slot reused by every layer
  for (int l = 0; l < kLayers; ++l) {
    std::vector<std::string> done;
    if (l == kLayers - 1) done = {"r"};
    Status st = send_and_wait(*s, ready(l, {{"r", {1, 7, 2}, {5, 6, 0}, 0, 0}}, done), gate);
    ASSERT_TRUE(st.is_ok()) << "layer " << l << ": " << st.to_string();
  }
  sync_with_reader();
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_TRUE(decode_.holds(l, 0, 9, 7)) << "layer " << l;
    EXPECT_TRUE(decode_.holds(l, 2, 13, 0)) << "layer " << l;
  }
  EXPECT_EQ(s->stats().mf_meta_sent, 1u) << "MF_META goes once per connection";
  EXPECT_EQ(s->stats().answers, static_cast<uint64_t>(kLayers));
  EXPECT_EQ(s->stats().commits, 1u) << "the final layer's answer is committed";
  through(*s);
  EXPECT_EQ(reader_->get_finished(kAlone)->finished, std::vector<std::string>{"i"});
}

TEST_F(SenderTest, TwoContributorsSplitTheIndexerAndBothMustFinish) {
  start_reader();
  auto member0 = sender(), member1 = sender();
  ASSERT_TRUE(reader_->add_request("r", "i", {1, 2, 3, 4}, {5, 6, 7, 8}).is_ok());
  const protocol::ReadReq req{"r", {10, 11, 12, 13}, {0, 1, 2, 3}, 0, 0};
  SlotGate g0, g1;
  ASSERT_TRUE(send_and_wait(*member0, ready(0, {req}, {"r"}, 0, 2), g0).is_ok());
  through(*member0);
  EXPECT_TRUE(reader_->get_finished(kAlone)->finished.empty()) << "finished on one contributor";
  // A duplicate final signal from member 0 does not finish it either.
  ASSERT_TRUE(send_and_wait(*member0, ready(0, {}, {"r"}, 0, 2), g0).is_ok());
  through(*member0);
  EXPECT_TRUE(reader_->get_finished(kAlone)->finished.empty());
  ASSERT_TRUE(send_and_wait(*member1, ready(0, {req}, {"r"}, 1, 2), g1).is_ok());
  through(*member1);
  sync_with_reader();
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_TRUE(decode_.holds(0, 0, 1 + static_cast<int64_t>(i), 10 + static_cast<int64_t>(i)));
    EXPECT_TRUE(decode_.holds(0, 2, 5 + static_cast<int64_t>(i), static_cast<int64_t>(i)))
        << "indexer block " << i;
  }
  EXPECT_EQ(reader_->get_finished(kAlone)->finished, std::vector<std::string>{"i"});
}

TEST_F(SenderTest, OneDecodeServesPrefillInstancesOfDifferentTpSizes) {
  start_reader();
  // A Prefill of two contributors per Decode rank and one of a single contributor.
  auto pair0 = sender(), pair1 = sender(), single = sender();
  ASSERT_TRUE(reader_->add_request("a", "ia", {1, 2}, {5, 6}).is_ok());
  ASSERT_TRUE(reader_->add_request("b", "ib", {3, 4}, {7, 8}).is_ok());
  const protocol::ReadReq a{"a", {10, 11}, {0, 1}, 0, 0}, b{"b", {12, 13}, {2, 3}, 0, 0};
  SlotGate g0, g1, g2;
  ASSERT_TRUE(send_and_wait(*single, ready(0, {b}, {"b"}, 0, 1), g2).is_ok());
  ASSERT_TRUE(send_and_wait(*pair0, ready(0, {a}, {"a"}, 0, 2), g0).is_ok());
  through(*single);
  through(*pair0);
  EXPECT_EQ(reader_->get_finished(kAlone)->finished, std::vector<std::string>{"ib"});
  ASSERT_TRUE(send_and_wait(*pair1, ready(0, {a}, {"a"}, 1, 2), g1).is_ok());
  through(*pair1);
  EXPECT_EQ(reader_->get_finished(kAlone)->finished, std::vector<std::string>{"ia"});
  sync_with_reader();
  for (int64_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(decode_.holds(0, 0, 1 + i, 10 + i)) << "a main block " << i;
    EXPECT_TRUE(decode_.holds(0, 2, 5 + i, i)) << "a indexer block " << i;
    EXPECT_TRUE(decode_.holds(0, 0, 3 + i, 12 + i)) << "b main block " << i;
    EXPECT_TRUE(decode_.holds(0, 2, 7 + i, 2 + i)) << "b indexer block " << i;
  }
}

TEST_F(SenderTest, AnswersAreServedWhileALaterLayerIsStillBeingWritten) {
  start_reader();
  auto s = sender();
  SlotGate g0, g1;
  const uint64_t first = g0.open(0, 1);
  send_ready(*s, reader_->url(), ready(0, {}), {{&g0, first}});
  auto writing = std::make_shared<HostWriteEvent>();
  const uint64_t second = g1.open(1, 1);
  send_ready(*s, reader_->url(), ready(1, {}), {{&g1, second}}, writing);
  // Layer 0's answer comes in while layer 1's write runs (the sender is not stuck on it).
  Status st = wait(g0);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(s->stats().readiness_sent, 1u) << "layer 1 went out before its write completed";
  writing->complete();
  st = wait(g1);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(s->stats().readiness_sent, 2u);
}

TEST_F(SenderTest, AReadinessWhoseWriteIsDoneGoesOutWithNobodyWaitingForIt) {
  auto s = acknowledged_sender();
  ASSERT_TRUE(s);
  const uint64_t before = s->stats().readiness_sent;
  auto written = std::make_shared<HostWriteEvent>();
  written->complete();
  SlotGate g0, g1;
  send_ready(*s, reader_->url(), ready(1, {}), {{&g0, g0.open(1, 1)}});
  send_ready(*s, reader_->url(), ready(2, {}), {{&g1, g1.open(2, 1)}}, written);
  EXPECT_TRUE(eventually([&] { return s->stats().readiness_sent == before + 2; }))
      << "the sender thread sends only when someone waits";
  EXPECT_TRUE(wait(g0).is_ok());
  EXPECT_TRUE(wait(g1).is_ok());
}

TEST_F(SenderTest, ReadinessGivenAndWritesCompletedOnManyThreadsAreAllAnswered) {
  // The connections have one owner, the sender thread: send() and the events' notifications
  // only hand it work, from any thread (the sanitizer presets see a second toucher).
  auto s = acknowledged_sender();
  ASSERT_TRUE(s);
  constexpr int kThreads = 4, kLayersEach = 25;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      SlotGate gate;
      for (int l = 0; l < kLayersEach; ++l) {
        auto written = std::make_shared<HostWriteEvent>();
        const uint64_t g = gate.open(i % kLayers, 1);
        send_ready(*s, reader_->url(), ready(i % kLayers, {}), {{&gate, g}}, written);
        std::thread completer([&] { written->complete(); });
        completer.join();
        if (!wait(gate).is_ok()) ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(s->stats().answers, 1u + kThreads * kLayersEach);
}

// A write event that can only be waited on (a device event without callbacks).
class WaitOnlyEvent final : public WriteEvent {
 public:
  Status wait(const Deadline& deadline) override {
    if (deadline.remaining() > std::chrono::milliseconds(10)) ++blocking_waits;
    return inner.wait(deadline);
  }
  HostWriteEvent inner;
  std::atomic<int> blocking_waits{0};
};

TEST_F(SenderTest, AWriteEventThatCannotNotifyIsWaitedOnAndItsOutcomeDecides) {
  start_reader();
  auto s = sender();
  auto good = std::make_shared<WaitOnlyEvent>(), bad = std::make_shared<WaitOnlyEvent>();
  SlotGate g0, g1;
  send_ready(*s, reader_->url(), ready(0, {}), {{&g0, g0.open(0, 1)}}, good);
  send_ready(*s, reader_->url(), ready(1, {}), {{&g1, g1.open(1, 1)}}, bad);
  EXPECT_EQ(s->stats().readiness_sent, 0u) << "sent before its write completed";
  ASSERT_TRUE(eventually([&] { return good->blocking_waits.load() > 0; }))
      << "nobody waits on an event that cannot notify";
  good->inner.complete();
  Status st = wait(g0);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  bad->inner.complete(transport_error("the scatter kernel failed"));
  st = wait(g1);
  EXPECT_NE(st.message().find("layer 1 was not published: the scatter kernel failed"),
            std::string::npos)
      << st.to_string();
  EXPECT_EQ(s->stats().readiness_sent, 1u);
}

TEST_F(SenderTest, AWriteThatNeverCompletesFailsItsLayerInTimeAndOutlivesTheSender) {
  start_reader();
  SenderConfig config;
  config.event_timeout = 200ms;
  auto s = sender(config);
  auto never = std::make_shared<HostWriteEvent>();
  SlotGate gate;
  const uint64_t g = gate.open(2, 1);
  send_ready(*s, reader_->url(), ready(2, {}), {{&gate, g}}, never);
  Status st = gate.settle(Deadline(10s));
  EXPECT_EQ(st.code(), StatusCode::kTimeout) << st.to_string();
  EXPECT_NE(st.message().find("layer 2 was not published: the layer's KV write did not complete"),
            std::string::npos)
      << st.message();
  // An event the host still holds may complete after the sender is gone.
  auto late = std::make_shared<HostWriteEvent>();
  SlotGate other;
  const uint64_t h = other.open(3, 1);
  send_ready(*s, reader_->url(), ready(3, {}), {{&other, h}}, late);
  s.reset();
  late->complete();
  EXPECT_EQ(other.settle(Deadline(10s)).code(), StatusCode::kFailedPrecondition);
}

TEST_F(SenderTest, ADecodeThatNeverAcknowledgesFailsTheGateInTime) {
  auto silent = control::RouterChannel::bind(context_, "127.0.0.1", 0);  // bound, never read
  ASSERT_TRUE(silent);
  url_override_ = (*silent)->url();
  SenderConfig config;
  config.ack_timeout = 200ms;
  auto s = sender(config);
  SlotGate gate;
  Status st = send_and_wait(*s, ready(0, {}), gate);
  EXPECT_EQ(st.code(), StatusCode::kTimeout) << st.to_string();
  EXPECT_NE(st.message().find("no ACK for MF_META"), std::string::npos) << st.message();
  EXPECT_EQ(s->stats().readiness_sent, 0u) << "a readiness went out before the ACK";
}

TEST_F(SenderTest, AReadinessWaitsBehindAnEarlierLayerWhoseWriteIsStillRunning) {
  auto s = acknowledged_sender();
  ASSERT_TRUE(s);
  const uint64_t before = s->stats().readiness_sent;
  auto writing = std::make_shared<HostWriteEvent>();
  SlotGate g1, g2;
  send_ready(*s, reader_->url(), ready(1, {}), {{&g1, g1.open(1, 1)}}, writing);
  send_ready(*s, reader_->url(), ready(2, {}), {{&g2, g2.open(2, 1)}});  // written already
  ASSERT_TRUE(eventually([&] { return s->stats().waiting_for_write == 2; }))
      << "the sender thread never took both";
  EXPECT_EQ(s->stats().readiness_sent, before) << "layer 2 overtook layer 1";
  writing->complete();
  EXPECT_TRUE(wait(g2).is_ok());
  EXPECT_TRUE(g1.answered()) << "answers come in order: layer 1's before layer 2's";
  EXPECT_EQ(s->stats().readiness_sent, before + 2);
}

TEST_F(SenderTest, AnswersNobodyWaitsForAreReadAllTheSame) {
  start_reader();
  auto s = sender();
  SlotGate gate;
  const uint64_t g = gate.open(0, 1);
  send_ready(*s, reader_->url(), ready(0, {}), {{&gate, g}});
  // Nobody waits on the gate: the sender thread reads the answer all the same.
  EXPECT_TRUE(eventually([&] { return gate.answered(); })) << "the answer was never read";
  EXPECT_EQ(s->stats().answers, 1u);
}

TEST_F(SenderTest, StoppingTheSenderFailsWhatIsStillPending) {
  auto silent = control::RouterChannel::bind(context_, "127.0.0.1", 0);
  ASSERT_TRUE(silent);
  SenderConfig config;
  config.ack_timeout = 60s;
  auto s = sender(config);
  SlotGate gate;
  const uint64_t g = gate.open(4, 1);
  send_ready(*s, (*silent)->url(), ready(4, {}), {{&gate, g}});
  s.reset();  // the sender thread ends with the answer still owed
  Status st = gate.settle(Deadline(10s));
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
  EXPECT_NE(st.message().find("layer 4: the Prefill sender stopped"), std::string::npos)
      << st.message();
}

TEST_F(SenderTest, ARestartedDecodeGetsMfMetaAgainAndLaterLayersSucceed) {
  for (const bool linked : {false, true}) {
    SCOPED_TRACE(linked ? "on a link" : "on ZeroMQ");
    url_override_.clear();
    start_reader();
    const std::string url = reader_->url();
    const int port = std::stoi(url.substr(url.rfind(':') + 1));
    SenderConfig config;
    config.reply_timeout = 300ms;
    config.ack_timeout = 300ms;  // a Decode that is away fails the layer quickly either way
    auto s = linked ? linked_sender(config) : sender(config);
    SlotGate gate;
    ASSERT_TRUE(reader_->add_request("r", "i", {3}, {3}).is_ok());
    ASSERT_TRUE(send_and_wait(*s, ready(0, {{"r", {1}, {1}, 0, 0}}), gate).is_ok());
    if (linked) {
      ASSERT_TRUE(reach_the_link(*s, gate));
    }

    url_override_ = url;
    reader_.reset();  // Decode goes away
    Status st = send_and_wait(*s, ready(1, {{"r", {1}, {1}, 0, 0}}), gate);
    EXPECT_FALSE(st.is_ok()) << "a layer with no Decode to read it succeeded";

    start_reader(port);  // Decode is back on the same port, knowing nothing of Prefill
    ASSERT_TRUE(reader_->add_request("r", "i", {3}, {3}).is_ok());
    st = send_and_wait(*s, ready(2, {{"r", {1}, {1}, 0, 0}}), gate);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    sync_with_reader();
    EXPECT_TRUE(decode_.holds(2, 0, 3, 1));
    // Once to the first Decode, then on every new connection: layer 1 may already have gone
    // on one (unacknowledged) if the sender saw the old connection close first.
    EXPECT_GE(s->stats().mf_meta_sent, 2u);
  }
}

TEST_F(SenderTest, ADecodeRestartedBetweenLayersIsToldMfMetaAgainBeforeTheNextLayer) {
  start_reader();
  const std::string url = reader_->url();
  const int port = std::stoi(url.substr(url.rfind(':') + 1));
  auto s = sender();
  SlotGate gate;
  ASSERT_TRUE(reader_->add_request("r", "i", {3, 4}, {3, 4}).is_ok());
  ASSERT_TRUE(send_and_wait(*s, ready(0, {{"r", {1}, {1}, 0, 0}}), gate).is_ok());

  // Decode restarts on the same port. ZeroMQ reconnects the DEALER to it by itself; the
  // sender must notice, or the next layer reaches a Decode without its MF_META.
  url_override_ = url;
  reader_.reset();
  ASSERT_TRUE(eventually([&] { return s->stats().connections_lost == 1; }))
      << "the closed connection went unnoticed";
  start_reader(port);
  ASSERT_TRUE(reader_->add_request("r", "i", {3, 4}, {3, 4}).is_ok());
  Status st = send_and_wait(*s, ready(1, {{"r", {2}, {2}, 1, 1}}), gate);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  sync_with_reader();
  EXPECT_TRUE(decode_.holds(1, 0, 4, 2));
  EXPECT_EQ(s->stats().mf_meta_sent, 2u);
}

TEST_F(SenderTest, AReadinessForADecodeThatIsDownFailsAtOnceAndNeverReachesItsSuccessor) {
  start_reader();
  const std::string url = reader_->url();
  const int port = std::stoi(url.substr(url.rfind(':') + 1));
  SenderConfig config;
  config.ack_timeout = 60s;  // far beyond wait()'s 10 s: only the refused connect can fail it
  auto s = sender(config);
  SlotGate gate;
  ASSERT_TRUE(reader_->add_request("r", "i", {3, 4}, {3, 4}).is_ok());
  ASSERT_TRUE(send_and_wait(*s, ready(0, {{"r", {1}, {1}, 0, 0}}), gate).is_ok());

  url_override_ = url;
  reader_.reset();  // Decode dies; the sender drops the connection
  ASSERT_TRUE(eventually([&] { return s->stats().connections_lost == 1; }));
  // A readiness for the dead Decode's request goes on a new connection nobody accepts.
  Status st = send_and_wait(*s, ready(1, {{"gone", {2}, {2}, 1, 1}}), gate);
  EXPECT_EQ(st.code(), StatusCode::kUnreachable) << st.to_string();
  EXPECT_NE(st.message().find("nothing listens at " + url), std::string::npos) << st.message();

  // The Decode that comes back on the port never hears of it: it holds no readiness for a
  // request it does not know (which would stall the connection), and serves its own.
  start_reader(port);
  ASSERT_TRUE(reader_->add_request("r", "i", {3, 4}, {3, 4}).is_ok());
  st = send_and_wait(*s, ready(2, {{"r", {2}, {2}, 1, 1}}), gate);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  const decode::ReaderStats stats = reader_->stats();
  EXPECT_EQ(stats.readiness_held, 0u) << "the dead Decode's readiness reached its successor";
  EXPECT_EQ(stats.layers_done, 1u);
  sync_with_reader();
  EXPECT_TRUE(decode_.holds(2, 0, 4, 2));
}

TEST_F(SenderTest, ReadinessAndAnswersMoveToTheLinkDecodeOpensAndTheBytesArrive) {
  start_reader();
  auto s = linked_sender();
  SlotGate gate;
  ASSERT_TRUE(reach_the_link(*s, gate));
  EXPECT_EQ(reader_->stats().links_opened, 1u);
  const uint64_t on_link = s->stats().readiness_on_link;
  const uint64_t read_on_link = reader_->stats().readiness_on_link;
  ASSERT_TRUE(reader_->add_request("r", "i", {3, 9, 4}, {11, 12, 13}).is_ok());
  for (int l = 0; l < kLayers; ++l) {
    std::vector<std::string> done;
    if (l == kLayers - 1) done = {"r"};
    Status st = send_and_wait(*s, ready(l, {{"r", {1, 7, 2}, {5, 6, 0}, 0, 0}}, done), gate);
    ASSERT_TRUE(st.is_ok()) << "layer " << l << ": " << st.to_string();
  }
  // Every layer went on the link, and Decode took each from it.
  EXPECT_EQ(s->stats().readiness_on_link - on_link, static_cast<uint64_t>(kLayers));
  EXPECT_EQ(reader_->stats().readiness_on_link - read_on_link, static_cast<uint64_t>(kLayers));
  EXPECT_EQ(reader_->stats().readiness_polled, 0u) << "Decode polled with busy_poll 0";
  sync_with_reader();
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_TRUE(decode_.holds(l, 0, 9, 7)) << "layer " << l;
    EXPECT_TRUE(decode_.holds(l, 2, 13, 0)) << "layer " << l;
  }
  through(*s);
  EXPECT_EQ(reader_->get_finished(kAlone)->finished, std::vector<std::string>{"i"});
  EXPECT_EQ(s->stats().mf_meta_sent, 1u);
}

TEST_F(SenderTest, WhileARequestOwesLayersDecodePollsItsLinkAndSleepsOnceItIsDone) {
  // A minute of polling: no layer here comes that late, so whether one was polled depends
  // on the request alone.
  start_reader(0, true, std::chrono::minutes(1));
  auto s = linked_sender();
  SlotGate gate;
  ASSERT_TRUE(reach_the_link(*s, gate));
  for (const std::string id : {"a", "b"}) {
    ASSERT_TRUE(reader_->add_request(id, "i" + id, {3, 9}, {11, 12}).is_ok());
    const uint64_t polled = reader_->stats().readiness_polled;
    for (int l = 0; l < kLayers; ++l) {
      std::vector<std::string> done;
      if (l == kLayers - 1) done = {id};
      Status st = send_and_wait(*s, ready(l, {{id, {1, 7}, {5, 6}, 0, 0}}, done), gate);
      ASSERT_TRUE(st.is_ok()) << "request " << id << ", layer " << l << ": " << st.to_string();
    }
    // The first layer found Decode asleep (owed nothing before it); every later one found
    // it polling. After the last, it sleeps again: the next request's first is not polled.
    EXPECT_EQ(reader_->stats().readiness_polled - polled, static_cast<uint64_t>(kLayers - 1))
        << "request " << id;
    sync_with_reader();
    EXPECT_TRUE(decode_.holds(kLayers - 1, 0, 9, 7)) << "request " << id;
    EXPECT_TRUE(decode_.holds(kLayers - 1, 2, 12, 6)) << "request " << id;
  }
}

TEST_F(SenderTest, WithoutAnOfferOrWhenDecodeDeclinesTheConnectionStaysOnZeroMq) {
  for (const bool decode_takes_links : {false, true}) {
    SCOPED_TRACE(decode_takes_links ? "the sender offers none" : "Decode declines");
    start_reader(0, decode_takes_links);
    SenderConfig config;
    config.control_link = !decode_takes_links;
    auto s = linked_sender(config);
    SlotGate gate;
    for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(send_and_wait(*s, ready(l, {}), gate).is_ok());
    EXPECT_EQ(s->stats().readiness_sent, static_cast<uint64_t>(kLayers));
    EXPECT_EQ(s->stats().readiness_on_link, 0u);
    EXPECT_EQ(reader_->stats().links_opened, 0u);
  }
}

TEST_F(SenderTest, ALinkThatClosesUnderAConnectionStartsItAgainWithMfMeta) {
  start_reader();
  auto s = linked_sender();
  SlotGate gate;
  ASSERT_TRUE(reach_the_link(*s, gate));
  // Decode's end of the link goes with its transfer session.
  auto metadata = prefill_.engine->export_metadata();
  ASSERT_TRUE(metadata);
  auto session = decode_engine_->connect(*metadata);  // the live session, as the reader has it
  ASSERT_TRUE(session) << session.status().to_string();
  ASSERT_EQ(session->id, prefill_.engine->session_id());
  ASSERT_TRUE(decode_engine_->disconnect(*session).is_ok());
  ASSERT_TRUE(eventually([&] { return s->stats().connections_lost == 1; }));
  const uint64_t on_link = s->stats().readiness_on_link;
  Status st = send_and_wait(*s, ready(0, {}), gate);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(s->stats().mf_meta_sent, 2u) << "a new connection, with a new link offered";
  ASSERT_TRUE(eventually([&] { return reader_->stats().links_opened == 2; }));
  EXPECT_TRUE(reach_the_link(*s, gate)) << "the new connection never moved to its link";
  EXPECT_GT(s->stats().readiness_on_link, on_link);
}

}  // namespace
}  // namespace rd2h::prefill
