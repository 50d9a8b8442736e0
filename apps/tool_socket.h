// Minimal blocking TCP for the tools' handshakes (which exchange engine metadata before any
// transfer). Every call is bounded by a deadline. Not the connector's control plane.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "util/unique_fd.h"
#include "rd2h/common/deadline.h"
#include "rd2h/common/status.h"

namespace rd2h::tools {

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}

  int fd() const { return fd_.get(); }

  // Listens on "host:port" (port 0 picks a free one).
  static Expected<Socket> listen(const std::string& host_port);
  static Expected<Socket> connect(const std::string& host_port, const Deadline& deadline);
  Expected<Socket> accept(const Deadline& deadline);
  // "host:port" this socket is bound to.
  std::string local_address() const;

  Status send_all(std::span<const std::byte> data, const Deadline& deadline);
  Status recv_exact(std::span<std::byte> out, const Deadline& deadline);
  // A u32 length then the bytes; frames above `max_len` are refused.
  Status send_frame(std::span<const std::byte> data, const Deadline& deadline);
  Expected<std::vector<std::byte>> recv_frame(size_t max_len, const Deadline& deadline);

 private:
  UniqueFd fd_;
};

// Splits "host:port"; the port must be 0..65535.
Expected<std::pair<std::string, int>> split_host_port(const std::string& host_port);

}  // namespace rd2h::tools
