// Test helpers over real HTTP: a stand-in for the proxy's metaserver endpoint on a free
// loopback port, and a bounded wait on a condition.
#pragma once

#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "rd2h/common/deadline.h"

namespace rd2h::testing {

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
