// The ZeroMQ exchange between a pd-read source and its destination, before and after the
// reads: the source binds a ROUTER; the destination connects a DEALER, asks for the
// handshake, and when done sends its verdict, which the source acknowledges. Every wait is
// bounded by a deadline; every frame by the control plane's limit before it is buffered.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "control/channel.h"
#include "rd2h/common/deadline.h"
#include "rd2h/common/status.h"

namespace rd2h::tools {

// Splits "host:port" (an IPv6 host in brackets); the port must be 0..65535.
Expected<std::pair<std::string, int>> split_host_port(const std::string& host_port);

// The source's end.
class SourceChannel {
 public:
  // Binds "host:port" (port 0: any free port; host "*", "0.0.0.0" or "::": every interface).
  static Expected<SourceChannel> bind(const std::string& host_port);

  // "host:port" as bound, for the destination's --connect.
  std::string address() const;

  // Waits for a destination to ask, then answers it with `handshake`.
  Status serve(std::span<const std::byte> handshake, const Deadline& deadline);
  // The served destination's verdict (true: every byte matched), once acknowledged and the
  // destination gone. A destination that closes without one is an error at once.
  Expected<bool> await_verdict(const Deadline& deadline);

 private:
  explicit SourceChannel(std::unique_ptr<control::RouterChannel> router)
      : router_(std::move(router)) {}
  Expected<bool> receive_verdict(const Deadline& deadline);
  void await_close(const Deadline& deadline);

  std::unique_ptr<control::RouterChannel> router_;
  std::string reader_;  // the ROUTER's identity of the served destination
};

// The destination's end.
class DestChannel {
 public:
  // Connects to a source at "host:port"; nothing is exchanged yet.
  static Expected<DestChannel> connect(const std::string& host_port);

  // The source's handshake, as sent. A source that refuses the connection, or closes it,
  // is an error at once; one that never answers, at `deadline`. Errors name the address.
  Expected<std::vector<std::byte>> fetch_handshake(const Deadline& deadline);
  // Tells the source whether every byte matched, waits for its acknowledgement, and closes.
  Status send_verdict(bool ok, const Deadline& deadline);

 private:
  DestChannel(std::unique_ptr<control::DealerChannel> dealer, std::string address)
      : dealer_(std::move(dealer)), address_(std::move(address)) {}
  // The next payload; peer_dead when the connection was refused or closed.
  Expected<std::vector<std::byte>> receive(const Deadline& deadline);

  std::unique_ptr<control::DealerChannel> dealer_;  // null once the verdict is sent
  std::string address_;                             // as the user gave it
};

}  // namespace rd2h::tools
