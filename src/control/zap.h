// ZeroMQ's authentication hook (ZAP, RFC 27) for CURVE servers: one handler per context, on
// its own thread. Each secured ROUTER gets a ZAP domain naming the client keys it trusts; any
// other client is refused (it gets nothing) and the refusal is logged with its address.
#pragma once

#include <atomic>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

#include "rd2h/common/status.h"
#include "util/log.h"

namespace rd2h::control {

class ZapHandler {
 public:
  static Expected<std::unique_ptr<ZapHandler>> start(zmq::context_t& context);
  ~ZapHandler();  // stops and joins its thread
  ZapHandler(const ZapHandler&) = delete;
  ZapHandler& operator=(const ZapHandler&) = delete;

  // A new domain trusting `clients` (Z85 public keys); set it as the socket's ZAP domain.
  std::string add_domain(const std::vector<std::string>& clients);
  void remove_domain(const std::string& domain);
  uint64_t refused() const { return refused_.load(); }

 private:
  explicit ZapHandler(zmq::socket_t socket);
  void run();
  void answer(std::vector<zmq::message_t>& request);

  zmq::socket_t socket_;
  std::mutex mu_;
  std::map<std::string, std::set<std::string>> domains_;
  uint64_t next_domain_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> refused_{0};
  log::RateLimit refusal_log_;  // a peer retrying a refused handshake does not flood the log
  std::thread thread_;
};

}  // namespace rd2h::control
