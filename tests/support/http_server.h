// Test helpers over real HTTP: a stand-in for the proxy's metaserver endpoint on a free
// loopback port, a port that refuses connections, a bounded wait on a condition, and a
// series read from a server's /metrics.
#pragma once

#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "rd2h/common/deadline.h"

namespace rd2h::testing {

// The value of the series `series` (its name and labels as rendered) in `origin`'s /metrics.
inline std::optional<double> metric(const std::string& origin, const std::string& series) {
  httplib::Client c(origin);
  auto r = c.Get("/metrics");
  if (!r || r->status != 200) return std::nullopt;
  const std::string key = "\n" + series + " ";
  const size_t at = ("\n" + r->body).find(key);
  if (at == std::string::npos) return std::nullopt;
  return std::stod(r->body.substr(at + key.size() - 1));
}

using namespace std::chrono_literals;

// Waits (bounded) until `done` holds.
template <typename F>
bool eventually(F done, std::chrono::milliseconds limit = 20s) {
  const Deadline deadline(limit);
  while (!done()) {
    if (deadline.expired()) return false;
    std::this_thread::sleep_for(5ms);  // polling a condition, not synchronising on time
  }
  return true;
}

// A stand-in server's socket options: SO_REUSEADDR only, as rd2h's own servers. httplib's
// default adds SO_REUSEPORT.
inline void reuse_address_only(httplib::Server& server) {
  server.set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
}

// A loopback port that refuses connections, as a killed server's does, and that the kernel
// hands to no other socket binding port 0 while this lives: tests run side by side, and a
// port freed in one could otherwise be taken by the next server another test starts, which
// would then get this test's requests. A server may still bind it on purpose
// (SO_REUSEADDR: this socket never listens).
class ClosedPort {
 public:
  // `port` 0: a fresh one.
  explicit ClosedPort(int port = 0) : fd_(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    int yes = 1;
    ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    socklen_t n = sizeof(a);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&a), n), 0) << "port " << port;
    EXPECT_EQ(::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &n), 0);
    port_ = ntohs(a.sin_port);
  }
  ~ClosedPort() { ::close(fd_); }
  ClosedPort(const ClosedPort&) = delete;
  ClosedPort& operator=(const ClosedPort&) = delete;
  int port() const { return port_; }
  std::string origin() const { return "http://127.0.0.1:" + std::to_string(port_); }

 private:
  int fd_;
  int port_ = 0;
};

// An HTTP server on a free loopback port answering POST /v1/metaserver with `status`,
// keeping every body it got.
class MetaserverStub {
 public:
  explicit MetaserverStub(int status, std::chrono::milliseconds hold = 0ms, int port = 0)
      : status_(status), hold_(hold) {
    server_.Post("/v1/metaserver", [this](const httplib::Request& req, httplib::Response& res) {
      if (hold_.count() > 0) std::this_thread::sleep_for(hold_);  // a proxy that holds posts
      {
        std::lock_guard lock(mu_);
        bodies_.push_back(req.body);
      }
      res.status = status_;
      res.set_content(status_ == 200 ? R"({"status":"ok"})" : "boom", "application/json");
    });
    reuse_address_only(server_);
    // Bound and listening from here on: connections queue until the accept loop runs.
    port_ = port == 0 ? server_.bind_to_any_port("127.0.0.1") : port;
    if (port != 0) {
      EXPECT_TRUE(server_.bind_to_port("127.0.0.1", port)) << "port " << port;
    }
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    // stop() only stops a server whose accept loop runs.
    EXPECT_TRUE(eventually([this] { return server_.is_running(); }));
  }
  ~MetaserverStub() {
    server_.stop();
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_) + "/v1/metaserver"; }
  int port() const { return port_; }
  std::vector<std::string> bodies() const {
    std::lock_guard lock(mu_);
    return bodies_;
  }

 private:
  int status_;
  std::chrono::milliseconds hold_;
  httplib::Server server_;
  int port_ = 0;
  std::thread thread_;
  mutable std::mutex mu_;
  std::vector<std::string> bodies_;
};

}  // namespace rd2h::testing
