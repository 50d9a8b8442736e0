// The notification channels of one UCX engine: those it listens on (on its serving worker) and
// those it opened on its sessions, one number naming a channel of either kind. What arrives
// waits in one queue for the engine's consumer, whose poll() progresses the channels.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "rd2h/common/status.h"
#include "rd2h/transfer/transfer_engine.h"
#include "transfer/notification_queue.h"
#include "transfer/ucx_serving.h"
#include "transfer/ucx_session.h"
#include "util/unique_fd.h"

namespace rd2h::transfer {

class EngineNotifications {
 public:
  // `serving` must outlive this. An open waits at most `connect_timeout` for its message
  // to be sent, a message at most `send_timeout`.
  static Expected<std::unique_ptr<EngineNotifications>> create(
      ServingWorker& serving, std::chrono::milliseconds connect_timeout,
      std::chrono::milliseconds send_timeout);
  EngineNotifications(const EngineNotifications&) = delete;
  EngineNotifications& operator=(const EngineNotifications&) = delete;

  Status listen(uint64_t channel);
  Status open(const std::shared_ptr<Session>& s, uint64_t channel);
  Status send(uint64_t channel, std::span<const std::byte> message);
  void close(uint64_t channel);
  int fd() const { return epoll_fd_.get(); }
  bool poll(std::vector<Notification>& out, bool arm);

 private:
  EngineNotifications(ServingWorker& serving, std::chrono::milliseconds connect_timeout,
                      std::chrono::milliseconds send_timeout)
      : serving_(serving), connect_timeout_(connect_timeout), send_timeout_(send_timeout) {}
  static Status channel_taken(uint64_t channel);
  LinkHandler handler(uint64_t channel);
  Status open_on_session(const std::shared_ptr<Session>& s, uint64_t channel);
  // Sends one eager active message on the session's endpoint and progresses the session's
  // worker until it is sent (within `timeout`); a failure breaks the session. Caller holds
  // s.mu.
  static Status send_and_wait(Session& s, uint16_t id, const void* header, size_t header_length,
                              std::span<const std::byte> data, std::chrono::milliseconds timeout);
  // One pass over the sessions with channels: progresses each and (with `arm`) arms it for
  // its event fd. False when one had more events already (no time to sleep) or was not armed.
  bool progress_sessions(bool arm);

  ServingWorker& serving_;
  const std::chrono::milliseconds connect_timeout_;
  const std::chrono::milliseconds send_timeout_;
  std::shared_ptr<NotificationQueue> queue_;  // shared with the handlers

  std::mutex channels_mu_;
  std::unordered_map<uint64_t, std::weak_ptr<Session>> sessions_;  // channels opened on them
  std::mutex watched_mu_;
  std::vector<std::weak_ptr<Session>> watched_;  // sessions whose worker fd is in epoll_fd_
  // What the consumer sleeps on: the sessions' and the serving worker's event fds, and the
  // queue's wake-up fd.
  UniqueFd epoll_fd_;
};

}  // namespace rd2h::transfer
