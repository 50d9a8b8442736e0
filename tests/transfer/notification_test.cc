// Notifications of the UCX engine: short messages between a serving engine and one that
// connected to it, on the session's own connection, over shared memory and TCP on loopback.
// The test thread is each engine's consumer.
#include <gtest/gtest.h>
#include <poll.h>

#include <vector>

#include "rd2h/common/deadline.h"
#include "rd2h/transfer/transfer_engine.h"

namespace rd2h::transfer {
namespace {

using namespace std::chrono_literals;
using Kind = Notification::Kind;

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

// What one engine's consumer heard, in order.
struct Heard {
  std::vector<Notification> all;
  // Polls `engine` (at most 10 s) until `n` notifications of `channel` are in; returns them.
  std::vector<Notification> wait_for(TransferEngine& engine, uint64_t channel, size_t n) {
    const Deadline deadline(10s);
    while (of(channel).size() < n && !deadline.expired()) {
      engine.wait_notifications(all, 100ms);
    }
    return of(channel);
  }
  // Takes whatever came, without waiting.
  void take(TransferEngine& engine) {
    while (!engine.get_notifications(all)) {
    }
  }
  std::vector<Notification> of(uint64_t channel) const {
    std::vector<Notification> out;
    for (const auto& n : all) {
      if (n.channel == channel) out.push_back(n);
    }
    return out;
  }
};

class Notifications : public ::testing::TestWithParam<Transport> {
 protected:
  void SetUp() override {
    serving_ = make_engine(Role::kPrefill, GetParam());
    connecting_ = make_engine(Role::kDecode, GetParam());
    ASSERT_TRUE(serving_ && connecting_);
    ASSERT_TRUE(serving_->supports_notifications());
    auto region = serving_->allocate_memory(4096);
    ASSERT_TRUE(region) << region.status().to_string();
    auto metadata = serving_->export_metadata();
    ASSERT_TRUE(metadata) << metadata.status().to_string();
    auto session = connecting_->connect(*metadata);
    ASSERT_TRUE(session) << session.status().to_string();
    session_ = *session;
  }

  // Opens `channel` and waits until the serving side heard it open.
  void open(uint64_t channel) {
    ASSERT_TRUE(serving_->listen_notifications(channel).is_ok());
    Status st = connecting_->open_notifications(session_, channel);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    auto events = served.wait_for(*serving_, channel, 1);
    ASSERT_EQ(events.size(), 1u);
    ASSERT_EQ(events[0].kind, Kind::kOpened);
  }

  std::unique_ptr<TransferEngine> serving_, connecting_;
  transfer::SessionHandle session_;
  Heard served, opened;
};

TEST_P(Notifications, MessagesTravelBothWaysInTheOrderTheyWereSent) {
  open(7);
  constexpr int kMessages = 200;
  for (int i = 0; i < kMessages; ++i) {
    ASSERT_TRUE(serving_->send_notification(7, bytes_of("readiness " + std::to_string(i))).is_ok());
  }
  // One far larger than a transport's segment arrives whole.
  std::vector<std::byte> large(3u << 20);
  for (size_t i = 0; i < large.size(); ++i) large[i] = std::byte(i * 131 % 251);
  ASSERT_TRUE(serving_->send_notification(7, large).is_ok());
  auto got = opened.wait_for(*connecting_, 7, kMessages + 1);
  ASSERT_EQ(got.size(), size_t{kMessages + 1});
  for (int i = 0; i < kMessages; ++i) {
    EXPECT_EQ(got[i].kind, Kind::kMessage);
    EXPECT_EQ(text_of(got[i].message), "readiness " + std::to_string(i));
  }
  EXPECT_TRUE(got[kMessages].message == large);

  for (int i = 0; i < kMessages; ++i) {
    ASSERT_TRUE(connecting_->send_notification(7, bytes_of("answer " + std::to_string(i))).is_ok());
  }
  auto answers = served.wait_for(*serving_, 7, 1 + kMessages);
  ASSERT_EQ(answers.size(), size_t{1 + kMessages});
  for (int i = 0; i < kMessages; ++i) {
    EXPECT_EQ(answers[1 + i].kind, Kind::kMessage);
    EXPECT_EQ(text_of(answers[1 + i].message), "answer " + std::to_string(i));
  }
}

TEST_P(Notifications, WhatCameWhileNobodyPolledWaitsAndTheFdWakesTheConsumer) {
  open(8);
  // The consumer polls until the engine armed its fd, then sleeps on it.
  while (!connecting_->get_notifications(opened.all)) {
  }
  ASSERT_TRUE(serving_->send_notification(8, bytes_of("first")).is_ok());
  ASSERT_TRUE(serving_->send_notification(8, bytes_of("second")).is_ok());
  pollfd p{connecting_->notification_fd(), POLLIN, 0};
  ASSERT_GE(p.fd, 0);
  ASSERT_EQ(::poll(&p, 1, 10000), 1) << "the fd did not wake the consumer";
  auto got = opened.wait_for(*connecting_, 8, 2);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(text_of(got[0].message), "first");
  EXPECT_EQ(text_of(got[1].message), "second");
}

TEST_P(Notifications, OnlyAChannelListenedOnOpensAndItsMessagesReachOnlyIt) {
  ASSERT_TRUE(serving_->listen_notifications(1).is_ok());
  // A channel the serving side never listened on: its open and its messages are dropped.
  ASSERT_TRUE(connecting_->open_notifications(session_, 2).is_ok());
  ASSERT_TRUE(connecting_->send_notification(2, bytes_of("forged answer")).is_ok());
  EXPECT_FALSE(serving_->send_notification(2, bytes_of("x")).is_ok());
  ASSERT_TRUE(connecting_->open_notifications(session_, 1).is_ok());
  ASSERT_TRUE(connecting_->send_notification(1, bytes_of("answer")).is_ok());
  // Messages on the session's connection arrive in order: the forged one came first.
  auto events = served.wait_for(*serving_, 1, 2);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].kind, Kind::kOpened);
  EXPECT_EQ(text_of(events[1].message), "answer");
  served.take(*serving_);
  EXPECT_TRUE(served.of(2).empty());
  // A channel in use is refused on either side.
  EXPECT_EQ(serving_->listen_notifications(1).code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(connecting_->open_notifications(session_, 1).code(), StatusCode::kAlreadyExists);
  // Refused, the second listen left the channel as it was.
  ASSERT_TRUE(connecting_->send_notification(1, bytes_of("still heard")).is_ok());
  events = served.wait_for(*serving_, 1, 3);
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(text_of(events[2].message), "still heard");
}

TEST_P(Notifications, NothingIsHeardOfAChannelOnceItClosed) {
  open(1);
  open(2);
  serving_->close_notifications(1);
  EXPECT_FALSE(serving_->send_notification(1, bytes_of("late")).is_ok());
  ASSERT_TRUE(connecting_->send_notification(1, bytes_of("late answer")).is_ok());
  ASSERT_TRUE(connecting_->send_notification(2, bytes_of("marker")).is_ok());
  ASSERT_EQ(served.wait_for(*serving_, 2, 2).size(), 2u);  // the marker, after the late answer
  EXPECT_EQ(served.of(1).size(), 1u);                      // the open only
}

TEST_P(Notifications, AChannelClosesWithItsSession) {
  open(3);
  ASSERT_TRUE(connecting_->disconnect(session_).is_ok());
  auto events = opened.wait_for(*connecting_, 3, 1);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, Kind::kClosed);
  EXPECT_EQ(connecting_->send_notification(3, bytes_of("x")).code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(connecting_->open_notifications(session_, 4).code(),
            StatusCode::kFailedPrecondition);  // its handle reads as broken
}

TEST_P(Notifications, AMessageOverTheLimitIsRefusedBeforeAnythingIsSent) {
  open(5);
  std::vector<std::byte> huge(kMaxNotificationBytes + 1);
  EXPECT_EQ(serving_->send_notification(5, huge).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(connecting_->send_notification(5, huge).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(serving_->send_notification(5, bytes_of("after")).is_ok());
  auto events = opened.wait_for(*connecting_, 5, 1);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(text_of(events[0].message), "after");
}

TEST_P(Notifications, AChannelWhoseMessagesOverflowTheQueueCloses) {
  // On shared memory at most a FIFO's worth (64) of what was sent is not yet in the serving
  // engine's queue when the last send returns: the serving thread took the rest.
  if (GetParam() != Transport::kShm) GTEST_SKIP() << "bounded in flight on shm only";
  open(9);
  open(10);
  const auto one = bytes_of("m");
  for (size_t i = 0; i < kMaxQueuedNotifications + 256; ++i) {
    ASSERT_TRUE(connecting_->send_notification(9, one).is_ok()) << i;
  }
  auto nine = served.wait_for(*serving_, 9, 2);
  // Its open, then its close: what it held was dropped with it. The other channel goes on.
  ASSERT_EQ(nine.size(), 2u);
  EXPECT_EQ(nine[1].kind, Kind::kClosed);
  EXPECT_FALSE(serving_->send_notification(9, one).is_ok());
  ASSERT_TRUE(connecting_->send_notification(10, bytes_of("still here")).is_ok());
  auto ten = served.wait_for(*serving_, 10, 2);
  ASSERT_EQ(ten.size(), 2u);
  EXPECT_EQ(text_of(ten[1].message), "still here");
}

INSTANTIATE_TEST_SUITE_P(Transports, Notifications,
                         ::testing::Values(Transport::kShm, Transport::kTcp),
                         [](const auto& info) { return std::string(to_string(info.param)); });

}  // namespace
}  // namespace rd2h::transfer
