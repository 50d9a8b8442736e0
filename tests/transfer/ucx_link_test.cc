// Links of the UCX engine: control messages between a serving engine and one that connected
// to it, on the session's own connection, over shared memory and TCP on loopback.
#include <gtest/gtest.h>

#include <condition_variable>
#include <cstring>
#include <mutex>
#include <vector>

#include "rd2h/common/deadline.h"
#include "rd2h/transfer/transfer_engine.h"

namespace rd2h::transfer {
namespace {

using namespace std::chrono_literals;

std::unique_ptr<TransferEngine> make_engine(Role role, Transport transport) {
  EngineConfig cfg;
  cfg.role = role;
  cfg.transport = transport;
  cfg.read_timeout = 2000ms;
  cfg.connect_timeout = 5000ms;
  auto e = create_ucx_engine(cfg);
  EXPECT_TRUE(e) << e.status().to_string();
  return e ? std::move(*e) : nullptr;
}

std::vector<std::byte> bytes_of(const std::string& text) {
  const auto* p = reinterpret_cast<const std::byte*>(text.data());
  return {p, p + text.size()};
}
std::string text_of(const std::vector<std::byte>& bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

// What one end of a link heard, in order.
struct Inbox {
  struct Event {
    LinkEvent event;
    std::vector<std::byte> message;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Event> events;

  LinkHandler handler() {
    return [this](LinkEvent event, std::span<const std::byte> message) {
      std::lock_guard lock(mu);
      events.push_back({event, {message.begin(), message.end()}});
      cv.notify_all();
    };
  }
  // Waits (at most 10 s) until `n` events are in; returns a copy of them.
  std::vector<Event> wait_for(size_t n) {
    std::unique_lock lock(mu);
    cv.wait_for(lock, 10s, [&] { return events.size() >= n; });
    return events;
  }
  size_t count() {
    std::lock_guard lock(mu);
    return events.size();
  }
};

class Link : public ::testing::TestWithParam<Transport> {
 protected:
  void SetUp() override {
    serving_ = make_engine(Role::kPrefill, GetParam());
    connecting_ = make_engine(Role::kDecode, GetParam());
    ASSERT_TRUE(serving_ && connecting_);
    ASSERT_TRUE(serving_->supports_links());
    auto region = serving_->allocate_memory(4096);
    ASSERT_TRUE(region) << region.status().to_string();
    auto metadata = serving_->export_metadata();
    ASSERT_TRUE(metadata) << metadata.status().to_string();
    auto session = connecting_->connect(*metadata);
    ASSERT_TRUE(session) << session.status().to_string();
    session_ = *session;
  }

  // Opens link `token` and waits until the serving side heard it open.
  void open(uint64_t token, Inbox& served, Inbox& opened) {
    ASSERT_TRUE(serving_->expect_link(token, served.handler()).is_ok());
    Status st = connecting_->open_link(session_, token, opened.handler());
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    auto events = served.wait_for(1);
    ASSERT_EQ(events.size(), 1u);
    ASSERT_EQ(events[0].event, LinkEvent::kOpened);
  }

  // Declared first, so they outlive the engines, whose teardown may still report to them.
  Inbox served, opened, other_served, other_opened;
  std::unique_ptr<TransferEngine> serving_, connecting_;
  transfer::SessionHandle session_;
};

TEST_P(Link, MessagesTravelBothWaysInTheOrderTheyWereSent) {
  open(7, served, opened);
  constexpr int kMessages = 200;
  for (int i = 0; i < kMessages; ++i) {
    ASSERT_TRUE(serving_->send_on_link(7, bytes_of("readiness " + std::to_string(i))).is_ok());
  }
  // One far larger than a transport's segment arrives whole.
  std::vector<std::byte> large(3u << 20);
  for (size_t i = 0; i < large.size(); ++i) large[i] = std::byte(i * 131 % 251);
  ASSERT_TRUE(serving_->send_on_link(7, large).is_ok());
  auto got = opened.wait_for(kMessages + 1);
  ASSERT_EQ(got.size(), size_t{kMessages + 1});
  for (int i = 0; i < kMessages; ++i) {
    EXPECT_EQ(got[i].event, LinkEvent::kMessage);
    EXPECT_EQ(text_of(got[i].message), "readiness " + std::to_string(i));
  }
  EXPECT_TRUE(got[kMessages].message == large);

  for (int i = 0; i < kMessages; ++i) {
    ASSERT_TRUE(connecting_->send_on_link(7, bytes_of("answer " + std::to_string(i))).is_ok());
  }
  auto answers = served.wait_for(1 + kMessages);
  ASSERT_EQ(answers.size(), size_t{1 + kMessages});
  for (int i = 0; i < kMessages; ++i) {
    EXPECT_EQ(answers[1 + i].event, LinkEvent::kMessage);
    EXPECT_EQ(text_of(answers[1 + i].message), "answer " + std::to_string(i));
  }
}

TEST_P(Link, OnlyAnExpectedTokenOpensAndItsMessagesReachOnlyItsHandler) {
  Inbox& stranger = other_opened;
  ASSERT_TRUE(serving_->expect_link(1, served.handler()).is_ok());
  // A token the serving side never expected: its open and its messages are dropped.
  ASSERT_TRUE(connecting_->open_link(session_, 2, stranger.handler()).is_ok());
  ASSERT_TRUE(connecting_->send_on_link(2, bytes_of("forged answer")).is_ok());
  EXPECT_FALSE(serving_->send_on_link(2, bytes_of("x")).is_ok());
  ASSERT_TRUE(connecting_->open_link(session_, 1, opened.handler()).is_ok());
  ASSERT_TRUE(connecting_->send_on_link(1, bytes_of("answer")).is_ok());
  // Messages on the session's connection arrive in order: the forged one came first.
  auto events = served.wait_for(2);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].event, LinkEvent::kOpened);
  EXPECT_EQ(text_of(events[1].message), "answer");
  // A token in use is refused on either side.
  EXPECT_EQ(serving_->expect_link(1, served.handler()).code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(connecting_->open_link(session_, 1, opened.handler()).code(),
            StatusCode::kAlreadyExists);
}

TEST_P(Link, NothingIsHeardOfALinkOnceItClosed) {
  open(1, served, opened);
  open(2, other_served, other_opened);
  serving_->close_link(1);
  EXPECT_FALSE(serving_->send_on_link(1, bytes_of("late")).is_ok());
  ASSERT_TRUE(connecting_->send_on_link(1, bytes_of("late answer")).is_ok());
  ASSERT_TRUE(connecting_->send_on_link(2, bytes_of("marker")).is_ok());
  ASSERT_EQ(other_served.wait_for(2).size(), 2u);  // the marker, sent after the late answer
  EXPECT_EQ(served.count(), 1u);                   // the open only
}

TEST_P(Link, ALinkClosesWithItsSession) {
  open(3, served, opened);
  ASSERT_TRUE(connecting_->disconnect(session_).is_ok());
  auto events = opened.wait_for(1);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].event, LinkEvent::kClosed);
  EXPECT_EQ(connecting_->send_on_link(3, bytes_of("x")).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(connecting_->open_link(session_, 4, opened.handler()).code(),
            StatusCode::kFailedPrecondition);  // its handle reads as broken
}

TEST_P(Link, AMessageOverTheLimitIsRefusedBeforeAnythingIsSent) {
  open(5, served, opened);
  std::vector<std::byte> huge(kMaxLinkMessageBytes + 1);
  EXPECT_EQ(serving_->send_on_link(5, huge).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(connecting_->send_on_link(5, huge).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(serving_->send_on_link(5, bytes_of("after")).is_ok());
  auto events = opened.wait_for(1);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(text_of(events[0].message), "after");
}

INSTANTIATE_TEST_SUITE_P(Transports, Link, ::testing::Values(Transport::kShm, Transport::kTcp),
                         [](const auto& info) { return std::string(to_string(info.param)); });

}  // namespace
}  // namespace rd2h::transfer
