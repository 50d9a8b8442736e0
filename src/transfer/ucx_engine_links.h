// The links of one UCX engine: those it serves on its serving worker and those it opened on its
// sessions, a token naming one link of either kind. Its thread progresses the linked sessions
// nobody reads on; a caller that drives the links (link_fd) takes its place meanwhile.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <unordered_map>
#include <vector>

#include "rd2h/common/status.h"
#include "rd2h/transfer/transfer_engine.h"
#include "transfer/ucx_serving.h"
#include "transfer/ucx_session.h"
#include "util/unique_fd.h"

namespace rd2h::transfer {

class EngineLinks {
 public:
  // `serving` must outlive this. An open waits at most `connect_timeout` for its message
  // to be sent, a message at most `send_timeout`.
  EngineLinks(ServingWorker& serving, std::chrono::milliseconds connect_timeout,
              std::chrono::milliseconds send_timeout)
      : serving_(serving), connect_timeout_(connect_timeout), send_timeout_(send_timeout) {}
  EngineLinks(const EngineLinks&) = delete;
  EngineLinks& operator=(const EngineLinks&) = delete;
  ~EngineLinks();  // joins the thread

  Status expect(uint64_t token, LinkHandler handler);
  Status open(const std::shared_ptr<Session>& s, uint64_t token, LinkHandler handler);
  Status send(uint64_t token, std::span<const std::byte> message);
  void close(uint64_t token);
  int fd();
  void drive(bool on);
  bool progress(bool arm);

 private:
  static Status token_taken(uint64_t token);
  Status open_on_session(const std::shared_ptr<Session>& s, uint64_t token, LinkHandler handler);
  // Sends one eager active message on the session's endpoint and progresses the session's
  // worker until it is sent (within `timeout`); a failure breaks the session. Caller holds
  // s.mu.
  static Status send_and_wait(Session& s, uint16_t id, const void* header, size_t header_length,
                              std::span<const std::byte> data, std::chrono::milliseconds timeout);
  void wake_thread();
  Status start_thread();
  // The thread's epoll set (the sessions' worker fds and its wake-up fd) and a driver's
  // (the same sessions, and the serving worker). Caller holds thread_mu_.
  Status make_fds();
  void loop();
  // One pass over the sessions with links: progresses each and (with `arm`) arms it for its
  // event fd. False when one had more events already (no time to sleep) or was not armed.
  bool progress_sessions(bool arm);

  ServingWorker& serving_;
  const std::chrono::milliseconds connect_timeout_;
  const std::chrono::milliseconds send_timeout_;

  std::mutex tokens_mu_;
  std::unordered_map<uint64_t, std::weak_ptr<Session>> sessions_;  // links opened on them
  std::mutex thread_mu_;
  std::vector<std::weak_ptr<Session>> watched_;  // under thread_mu_
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<int> drivers_{0};
  UniqueFd epoll_fd_;
  UniqueFd driver_epoll_fd_;  // what a driver of the links sleeps on (fd())
  UniqueFd wake_fd_;
};

}  // namespace rd2h::transfer
