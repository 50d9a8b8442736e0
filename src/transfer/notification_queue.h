// What an engine's notification channels hand to its one consumer: events in arrival order,
// of open channels only, within kMaxQueuedNotifications and kMaxQueuedNotificationBytes. Any
// thread pushes; the consumer takes.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_set>
#include <vector>

#include "rd2h/common/status.h"
#include "rd2h/transfer/transfer_engine.h"
#include "util/unique_fd.h"

namespace rd2h::transfer {

class NotificationQueue {
 public:
  static Expected<std::shared_ptr<NotificationQueue>> create();

  // Events of `channel` are kept from now on.
  void open(uint64_t channel);
  // Nothing more of `channel` is kept or reported; what it held is dropped.
  void close(uint64_t channel);
  // Keeps one event of an open channel (a kClosed closes it) and signals the wake-up fd,
  // unless the consumer is polling on this thread. An event that would go past a bound
  // closes the channel holding the most events, dropping them: that channel is reported
  // by the next take().
  void push(uint64_t channel, Notification::Kind kind, std::span<const std::byte> message);
  // Appends what is kept to `out`; returns the channels closed for overflow since the last
  // take, whose kClosed the caller reports once it has closed them.
  std::vector<uint64_t> take(std::vector<Notification>& out);

  // Readable when something was pushed while the consumer was not polling.
  int wake_fd() const { return wake_fd_.get(); }
  void clear_wake();
  void signal();
  // While alive, the consumer is polling on this thread: what it pushes needs no wake-up.
  class Polling {
   public:
    explicit Polling(const NotificationQueue& queue);
    ~Polling();
    Polling(const Polling&) = delete;
    Polling& operator=(const Polling&) = delete;
  };

 private:
  NotificationQueue() = default;
  void drop(uint64_t channel);  // mu_ held

  std::mutex mu_;
  std::unordered_set<uint64_t> open_;
  std::deque<Notification> events_;
  size_t bytes_ = 0;  // of the messages in events_
  std::vector<uint64_t> overflowed_;
  UniqueFd wake_fd_;  // an eventfd
};

}  // namespace rd2h::transfer
