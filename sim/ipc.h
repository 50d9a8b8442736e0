// The simulator's IPC between its processes (the core and its TP ranks, the Decode ranks'
// gather): a ZeroMQ ROUTER that binds and DEALERs that connect, each with its own context. A
// message is one frame of at most kMaxIpcMessageBytes; a larger one closes its connection unread.
#pragma once

#include <chrono>
#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "rd2h/common/status.h"

namespace rd2h::sim {

inline constexpr size_t kMaxIpcMessageBytes = 256u << 20;

class IpcRouter {
 public:
  struct Inbound {
    std::string identity;  // the sending DEALER's
    std::vector<std::byte> payload;
  };
  // `endpoint`: "ipc://<path>", or "tcp://<host>:0" for any free port (see url()).
  static Expected<IpcRouter> bind(const std::string& endpoint);

  // The next message, or none within `timeout`.
  Expected<std::optional<Inbound>> receive(std::chrono::milliseconds timeout);
  // Fails when no connected peer has `identity`.
  Status send(const std::string& identity, std::span<const std::byte> payload);
  const std::string& url() const { return url_; }

 private:
  IpcRouter() = default;
  zmq::context_t context_{1};
  zmq::socket_t socket_;
  std::string url_;
};

class IpcDealer {
 public:
  static Expected<IpcDealer> connect(const std::string& url);

  // The next message, or none within `timeout`.
  Expected<std::optional<std::vector<std::byte>>> receive(std::chrono::milliseconds timeout);
  Status send(std::span<const std::byte> payload);

 private:
  IpcDealer() = default;
  zmq::context_t context_{1};
  zmq::socket_t socket_;
  std::string url_;
};

}  // namespace rd2h::sim
