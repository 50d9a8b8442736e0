// The queue between an engine's notification channels and its consumer: order, open channels
// only, the two bounds and which channel closes at them, the wake-up fd.
#include "transfer/notification_queue.h"

#include <gtest/gtest.h>
#include <poll.h>

#include <thread>

namespace rd2h::transfer {
namespace {

using Kind = Notification::Kind;

std::vector<std::byte> bytes_of(const std::string& text) {
  const auto* p = reinterpret_cast<const std::byte*>(text.data());
  return {p, p + text.size()};
}

bool readable(int fd) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, 0) == 1;
}

std::shared_ptr<NotificationQueue> make_queue() {
  auto q = NotificationQueue::create();
  EXPECT_TRUE(q) << q.status().to_string();
  return q ? *q : nullptr;
}

TEST(NotificationQueue, KeepsEventsOfOpenChannelsInOrder) {
  auto q = make_queue();
  ASSERT_TRUE(q);
  q->open(1);
  q->push(1, Kind::kOpened, {});
  q->push(2, Kind::kMessage, bytes_of("not open"));
  q->push(1, Kind::kMessage, bytes_of("a"));
  q->push(1, Kind::kClosed, {});
  q->push(1, Kind::kMessage, bytes_of("after its close"));
  std::vector<Notification> out;
  EXPECT_TRUE(q->take(out).empty());
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0].kind, Kind::kOpened);
  EXPECT_EQ(out[1].message, bytes_of("a"));
  EXPECT_EQ(out[2].kind, Kind::kClosed);
}

TEST(NotificationQueue, AClosedChannelsEventsGoWithIt) {
  auto q = make_queue();
  ASSERT_TRUE(q);
  q->open(1);
  q->open(2);
  q->push(1, Kind::kMessage, bytes_of("one"));
  q->push(2, Kind::kMessage, bytes_of("two"));
  q->close(1);
  q->push(1, Kind::kMessage, bytes_of("late"));
  std::vector<Notification> out;
  q->take(out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].channel, 2u);
}

TEST(NotificationQueue, AtTheCountBoundTheChannelHoldingMostClosesNotTheOneThatFoundItFull) {
  auto q = make_queue();
  ASSERT_TRUE(q);
  q->open(1);
  q->open(2);
  q->push(2, Kind::kMessage, bytes_of("before"));
  for (size_t i = 1; i < kMaxQueuedNotifications; ++i) q->push(1, Kind::kMessage, bytes_of("m"));
  q->push(2, Kind::kMessage, bytes_of("finds it full"));
  q->push(1, Kind::kMessage, bytes_of("after its close"));
  std::vector<Notification> out;
  EXPECT_EQ(q->take(out), std::vector<uint64_t>{1});
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].message, bytes_of("before"));
  EXPECT_EQ(out[1].message, bytes_of("finds it full"));
  // Reported once: closing the channel is the consumer's, and the queue forgets it.
  out.clear();
  EXPECT_TRUE(q->take(out).empty());
}

TEST(NotificationQueue, AtTheByteBoundTheChannelHoldingMostCloses) {
  auto q = make_queue();
  ASSERT_TRUE(q);
  q->open(1);
  q->open(2);
  q->push(2, Kind::kMessage, bytes_of("before"));
  const std::vector<std::byte> large(kMaxQueuedNotificationBytes / 4 - 16, std::byte{7});
  for (int i = 0; i < 4; ++i) q->push(1, Kind::kMessage, large);
  const std::vector<std::byte> last(1024, std::byte{8});
  q->push(2, Kind::kMessage, last);
  std::vector<Notification> out;
  EXPECT_EQ(q->take(out), std::vector<uint64_t>{1});
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[1].message, last);
}

TEST(NotificationQueue, AMessageTooLargeForWhatTheFlooderFreedClosesItsOwnChannelToo) {
  auto q = make_queue();
  ASSERT_TRUE(q);
  for (uint64_t c = 1; c <= 3; ++c) q->open(c);
  const std::vector<std::byte> large(kMaxQueuedNotificationBytes / 4, std::byte{7});
  q->push(1, Kind::kMessage, large);
  q->push(1, Kind::kMessage, large);
  q->push(2, Kind::kMessage, large);  // 2 holds the most events, 1 the most bytes
  q->push(2, Kind::kMessage, bytes_of("small"));
  q->push(2, Kind::kMessage, bytes_of("small"));
  const std::vector<std::byte> huge(kMaxQueuedNotificationBytes / 4 * 3, std::byte{9});
  q->push(3, Kind::kMessage, huge);  // 2 holds most; without it, 3's still does not fit
  std::vector<Notification> out;
  EXPECT_EQ(q->take(out), (std::vector<uint64_t>{2, 3}));
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].channel, 1u);
  EXPECT_EQ(out[1].channel, 1u);
}

TEST(NotificationQueue, APushWakesAConsumerUnlessItIsTheConsumerPolling) {
  auto q = make_queue();
  ASSERT_TRUE(q);
  q->open(1);
  {
    NotificationQueue::Polling polling(*q);
    q->push(1, Kind::kMessage, bytes_of("while polling"));
  }
  EXPECT_FALSE(readable(q->wake_fd()));
  std::thread other([&] { q->push(1, Kind::kMessage, bytes_of("from another thread")); });
  other.join();
  EXPECT_TRUE(readable(q->wake_fd()));
  q->clear_wake();
  EXPECT_FALSE(readable(q->wake_fd()));
  std::vector<Notification> out;
  q->take(out);
  EXPECT_EQ(out.size(), 2u);
}

}  // namespace
}  // namespace rd2h::transfer
