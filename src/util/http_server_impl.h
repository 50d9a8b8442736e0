// HttpServer's insides, shared by its two parts: the connection handling and its limits
// (http_connection.cc) and the server's front: routes and tokens, access log and metrics, start
// and stop (http_server.cc).
#pragma once

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>

#include "util/http_server.h"
#include "util/unique_fd.h"

namespace rd2h::http {

// httplib's server with rd2h's connection handling: its own keep-alive loop and stream, so
// that every wait has a deadline and stop() wakes every connection. It sets httplib's
// limits, socket options and error answers from the config itself.
class HttpServer::Server final : public httplib::Server {
 public:
  using Clock = std::chrono::steady_clock;

  explicit Server(const HttpServerConfig& config);
  ~Server() override;

  // Stops the accept loop and wakes every connection (they see the wake pipe readable).
  void wake_all();
  // httplib listens with a backlog of 5; Linux takes a new one from a second listen().
  bool set_backlog(int backlog);
  uint64_t rejected() const { return rejected_; }
  // Waits (bounded) until no request is being handled or answered.
  void wait_for_idle(std::chrono::milliseconds bound) {
    std::unique_lock lock(active_mu_);
    active_cv_.wait_for(lock, bound, [this] { return active_ == 0; });
  }
  void begin_active() {
    std::lock_guard lock(active_mu_);
    ++active_;
  }
  void end_active() {
    {
      std::lock_guard lock(active_mu_);
      --active_;
    }
    active_cv_.notify_all();
  }

  // When the request being handled on this thread began to arrive.
  static Clock::time_point request_start();

 private:
  class Connection;
  class Connections;

  bool process_and_close_socket(socket_t sock) override;
  // Serves `sock` (its head, read already, in `head`; begun at `started`) for up to
  // `requests_left` requests, then hands it back to `from` idle, or closes it.
  void serve(Connections& from, int sock, std::string head, Clock::time_point started,
             size_t requests_left);
  // Answers 503 (no thread to serve it) and closes.
  void reject(int sock);

  // Waits until `sock` has `events` or until `deadline`; false on the deadline or stop.
  bool wait(int sock, short events, Clock::time_point deadline) const;

  const HttpServerConfig& config_;
  // The wake pipe: stop() writes its end, every wait polls the other (none if no pipe).
  UniqueFd wake_read_, wake_write_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> rejected_{0};
  std::mutex active_mu_;
  std::condition_variable active_cv_;
  size_t active_ = 0;  // requests being handled or answered
};

}  // namespace rd2h::http
