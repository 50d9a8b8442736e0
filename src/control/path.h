// The paths the control protocol's messages take between a Prefill and a Decode rank, behind
// one interface: ZeroMQ (channel.h) and the transfer engine's notification channels. A path,
// and the Notifications that feed the engine's, belong to one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "control/channel.h"
#include "rd2h/common/status.h"
#include "rd2h/transfer/transfer_engine.h"

namespace rd2h::control {

// One connection's way to its peer.
class Path {
 public:
  virtual ~Path() = default;
  // Sends one message. An error means the path can carry no more.
  virtual Status send(std::span<const std::byte> message) = 0;
  // The next message that came, without blocking; nullopt when none is in.
  virtual Expected<std::optional<std::vector<std::byte>>> try_receive() = 0;
  // Why the path can carry no more (its peer closed, restarted or died), once it cannot.
  virtual std::optional<Status> lost() = 0;
};

// Prefill's ZeroMQ path: a DEALER connected to one Decode rank port.
class DealerPath final : public Path {
 public:
  // With `security`, the connection is encrypted and reaches only the holder of its key.
  static Expected<std::unique_ptr<DealerPath>> connect(
      std::shared_ptr<Context> context, const std::string& url,
      const std::optional<ClientSecurity>& security = std::nullopt);
  Status send(std::span<const std::byte> message) override { return dealer_->send(message); }
  Expected<std::optional<std::vector<std::byte>>> try_receive() override {
    return dealer_->try_receive();
  }
  // A closed connection (ZeroMQ reconnects, but to a peer that does not know what was said
  // on the old one), a failed CURVE handshake or a connect that failed.
  std::optional<Status> lost() override;
  // For poll(2); see DealerChannel::notify_fd.
  int notify_fd() const { return dealer_->notify_fd(); }

 private:
  explicit DealerPath(std::unique_ptr<DealerChannel> dealer) : dealer_(std::move(dealer)) {}
  std::unique_ptr<DealerChannel> dealer_;
};

// Decode's ZeroMQ path back to one connection of its ROUTER. It only sends: the router
// delivers every connection's messages (RouterChannel::receive) and reports those that
// closed (take_disconnected).
class RouterPath final : public Path {
 public:
  RouterPath(RouterChannel& router, std::string identity)
      : router_(router), identity_(std::move(identity)) {}
  Status send(std::span<const std::byte> message) override {
    return router_.send(identity_, message);
  }
  Expected<std::optional<std::vector<std::byte>>> try_receive() override {
    return std::optional<std::vector<std::byte>>();
  }
  std::optional<Status> lost() override { return std::nullopt; }

 private:
  RouterChannel& router_;
  std::string identity_;
};

class Notifications;

// A path on one notification channel of a transfer engine, fed by the Notifications that
// made it. Destroyed, it closes its channel.
class NotificationPath final : public Path {
 public:
  ~NotificationPath() override;
  NotificationPath(const NotificationPath&) = delete;
  NotificationPath& operator=(const NotificationPath&) = delete;

  uint64_t channel() const { return channel_; }
  // Serving side: the peer opened the channel.
  bool opened() const { return inbox_->opened; }
  Status send(std::span<const std::byte> message) override;
  Expected<std::optional<std::vector<std::byte>>> try_receive() override;
  std::optional<Status> lost() override;

 private:
  friend class Notifications;
  // What came on the channel. Prefill sends a readiness per slot and Decode an answer per
  // readiness, so it holds no more than that from a peer that keeps the protocol; past
  // kMaxQueuedNotifications messages the path is lost.
  struct Inbox {
    std::deque<std::vector<std::byte>> messages;
    bool opened = false;
    bool closed = false;
  };
  NotificationPath(Notifications& owner, uint64_t channel, std::shared_ptr<Inbox> inbox)
      : owner_(owner), channel_(channel), inbox_(std::move(inbox)) {}
  Notifications& owner_;
  uint64_t channel_;
  std::shared_ptr<Inbox> inbox_;
};

// The consumer of one transfer engine's notifications (its only one: see the engine's
// progress rule). It takes what came and hands it to the paths of the channels. It must
// outlive its paths.
class Notifications {
 public:
  explicit Notifications(std::shared_ptr<transfer::TransferEngine> engine)
      : engine_(std::move(engine)) {}
  Notifications(const Notifications&) = delete;
  Notifications& operator=(const Notifications&) = delete;

  // Whether the engine has notification channels at all.
  bool available() const { return engine_ && engine_->supports_notifications(); }
  // Serving side: a path on a new channel with an unguessable number (the capability the
  // peer is given over another path), listened on.
  Expected<std::unique_ptr<NotificationPath>> listen();
  // Connecting side: the path of `channel`, which the caller opens on the engine
  // (open_notifications, from any thread); what comes on it from now on is kept for it.
  // A channel that has a path already is refused.
  Expected<std::unique_ptr<NotificationPath>> expect(uint64_t channel);
  // Takes what came into the paths, progressing the engine (see
  // TransferEngine::get_notifications, whose `arm` this passes). True when the caller may
  // sleep on fd() once it handled what the paths hold.
  bool poll(bool arm = true);
  int fd() const { return engine_ ? engine_->notification_fd() : -1; }
  transfer::TransferEngine& engine() const { return *engine_; }

 private:
  friend class NotificationPath;
  std::shared_ptr<transfer::TransferEngine> engine_;
  std::unordered_map<uint64_t, std::shared_ptr<NotificationPath::Inbox>> inboxes_;
  std::vector<transfer::Notification> taken_;  // reused from one poll to the next
};

}  // namespace rd2h::control
