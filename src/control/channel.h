// ZeroMQ channels of the control plane (spec "Control Protocol", docs/wire-format.md
// "Connections"): Decode binds one ROUTER per TP rank, Prefill connects one DEALER per Decode
// endpoint. A message is one non-empty payload frame (empty ones dropped); every wait is bounded.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "control/curve.h"
#include "rd2h/common/status.h"

namespace rd2h::control {

// The largest frame any control socket accepts (ZMQ_MAXMSGSIZE): the largest protocol
// message. A peer sending more loses its connection; nothing is allocated for the frame.
inline constexpr size_t kMaxFrameBytes = 64u << 20;

// "tcp://host:port", with an IPv6 host in brackets.
std::string endpoint_url(const std::string& host, int port);

// A ZeroMQ context shared by the channels of one process. Channels keep it alive.
class Context {
 public:
  struct Impl;
  static std::shared_ptr<Context> create();
  ~Context();
  Impl& impl() const { return *impl_; }

 private:
  Context();
  std::unique_ptr<Impl> impl_;
};

struct Inbound {
  std::string identity;  // the ROUTER's name for the sending connection
  std::vector<std::byte> payload;
  // Why the message was refused (delivered only when asked for): then `payload` is its
  // first payload frame, if it had one.
  std::string malformed;
};

// Frames a control message may have on a ROUTER: identity, empty delimiter, payload, and a
// few empty frames more (which receivers drop). A legitimate message is at most
// kMaxFrameBytes in all, in exactly one payload frame.
inline constexpr size_t kMaxMessageParts = 8;

// Decode's end: a ROUTER bound at one rank port.
class RouterChannel {
 public:
  // Port 0 binds any free port (see url()). With `security`, only CURVE clients whose key
  // is trusted get through; others are refused during the handshake.
  static Expected<std::unique_ptr<RouterChannel>> bind(
      std::shared_ptr<Context> context, const std::string& host, int port,
      const std::optional<ServerSecurity>& security = std::nullopt);
  // Binds a Unix socket at `path` ("ipc://path"): for a process's own children, in a
  // directory only its user can enter.
  static Expected<std::unique_ptr<RouterChannel>> bind_ipc(std::shared_ptr<Context> context,
                                                           const std::string& path);
  ~RouterChannel();
  RouterChannel(const RouterChannel&) = delete;
  RouterChannel& operator=(const RouterChannel&) = delete;

  // The next well-formed message, or nullopt when none arrives within `timeout`, or
  // when one of `wake_fds` (descriptors of the caller's, at most 4) is readable first.
  // Malformed messages (no payload frame or more than one, too many frames, too many bytes)
  // are counted and dropped, or delivered marked (Inbound::malformed) after
  // deliver_malformed(true), so that their sender can be answered.
  Expected<std::optional<Inbound>> receive(std::chrono::milliseconds timeout,
                                           std::span<const int> wake_fds = {});
  // Sends [identity, "", payload]. An identity with no live connection is an error.
  Status send(const std::string& identity, std::span<const std::byte> payload);

  // Identities whose connection closed since the last call (each once): what was kept
  // for them can go. Only identities that sent something are known.
  std::vector<std::string> take_disconnected();

  const std::string& url() const { return url_; }
  size_t dropped() const { return dropped_; }
  void deliver_malformed(bool on) { deliver_malformed_ = on; }

  struct Impl;

 private:
  void note_disconnects();
  RouterChannel(std::shared_ptr<Context> context, std::unique_ptr<Impl> impl, std::string url);
  std::shared_ptr<Context> context_;
  std::unique_ptr<Impl> impl_;
  std::string url_;
  size_t dropped_ = 0;
  bool deliver_malformed_ = false;
};

// Prefill's end: a DEALER connected to one Decode rank port.
class DealerChannel {
 public:
  // With `security`, the connection is encrypted and reaches only the server holding
  // security->server_key.
  static Expected<std::unique_ptr<DealerChannel>> connect(
      std::shared_ptr<Context> context, const std::string& url,
      const std::optional<ClientSecurity>& security = std::nullopt);
  ~DealerChannel();
  DealerChannel(const DealerChannel&) = delete;
  DealerChannel& operator=(const DealerChannel&) = delete;

  Status send(std::span<const std::byte> payload);
  // The next payload, or nullopt when none arrives within `timeout`. Malformed replies are
  // dropped and counted.
  Expected<std::optional<std::vector<std::byte>>> receive(std::chrono::milliseconds timeout);
  // The next payload if one is in already, without a system call when none is.
  Expected<std::optional<std::vector<std::byte>>> try_receive();

  // ZeroMQ's notification descriptor (ZMQ_FD) for waiting with poll(2) on other threads
  // than the socket's user: it becomes readable when the socket's state may have changed,
  // edge-triggered. Whoever sees it must try_receive() until nothing is left; a send or a
  // receive on the socket can consume the edge of a message it did not read.
  int notify_fd() const;

  // Whether the connection to the peer closed since the last call. ZeroMQ reconnects on
  // its own, but the peer then sees a new connection: whatever was said on the old one
  // (MF_META) must be said again, and answers owed on it will not come.
  // A failed CURVE handshake counts as lost, and so does a connect that failed (nothing
  // listens at the URL); refusal() then says why.
  bool connection_lost();
  const std::string& refusal() const { return refusal_; }

  const std::string& url() const { return url_; }
  size_t dropped() const { return dropped_; }

  struct Impl;
  Impl& impl() const { return *impl_; }

 private:
  DealerChannel(std::shared_ptr<Context> context, std::unique_ptr<Impl> impl, std::string url);
  std::shared_ptr<Context> context_;
  std::unique_ptr<Impl> impl_;
  std::string url_;
  size_t dropped_ = 0;
  std::string refusal_;
};

}  // namespace rd2h::control
