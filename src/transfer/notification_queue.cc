#include "transfer/notification_queue.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <unordered_map>

namespace rd2h::transfer {

namespace {
// The queue whose consumer is polling on this thread.
thread_local const NotificationQueue* t_polling = nullptr;
}  // namespace

NotificationQueue::Polling::Polling(const NotificationQueue& queue) {
  t_polling = &queue;
}
NotificationQueue::Polling::~Polling() {
  t_polling = nullptr;
}

Expected<std::shared_ptr<NotificationQueue>> NotificationQueue::create() {
  std::shared_ptr<NotificationQueue> q(new NotificationQueue());
  q->wake_fd_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!q->wake_fd_.valid()) return internal_error("cannot create the notification wake-up fd");
  return q;
}

void NotificationQueue::open(uint64_t channel) {
  std::lock_guard lock(mu_);
  open_.insert(channel);
}

void NotificationQueue::close(uint64_t channel) {
  std::lock_guard lock(mu_);
  drop(channel);
}

void NotificationQueue::push(uint64_t channel, Notification::Kind kind,
                             std::span<const std::byte> message) {
  {
    std::lock_guard lock(mu_);
    if (open_.count(channel) == 0) return;  // closed: nothing more is heard of it
    const auto full = [&] {
      return events_.size() >= kMaxQueuedNotifications ||
             bytes_ + message.size() > kMaxQueuedNotificationBytes;
    };
    if (full()) {
      // A peer sends faster than the consumer takes: the channel holding the most closes.
      uint64_t flooder = channel;
      std::unordered_map<uint64_t, size_t> held;
      for (const auto& e : events_) {
        if (++held[e.channel] > held[flooder]) flooder = e.channel;
      }
      drop(flooder);
      overflowed_.push_back(flooder);
      if (flooder != channel && full()) {  // a message larger than what was dropped
        drop(channel);
        overflowed_.push_back(channel);
      }
    }
    if (open_.count(channel) != 0) {
      Notification& n = events_.emplace_back();
      n.channel = channel;
      n.kind = kind;
      n.message.assign(message.begin(), message.end());
      bytes_ += message.size();
      if (kind == Notification::Kind::kClosed) open_.erase(channel);
    }
  }
  signal();
}

std::vector<uint64_t> NotificationQueue::take(std::vector<Notification>& out) {
  std::vector<uint64_t> overflowed;
  std::lock_guard lock(mu_);
  for (auto& e : events_) out.push_back(std::move(e));
  events_.clear();
  bytes_ = 0;
  overflowed.swap(overflowed_);
  return overflowed;
}

void NotificationQueue::drop(uint64_t channel) {
  open_.erase(channel);
  std::erase_if(events_, [&](const Notification& n) {
    if (n.channel != channel) return false;
    bytes_ -= n.message.size();
    return true;
  });
  std::erase(overflowed_, channel);
}

void NotificationQueue::clear_wake() {
  uint64_t count;
  [[maybe_unused]] auto n = ::read(wake_fd_.get(), &count, sizeof(count));
}

void NotificationQueue::signal() {
  if (t_polling == this) return;
  uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(wake_fd_.get(), &one, sizeof(one));
}

}  // namespace rd2h::transfer
