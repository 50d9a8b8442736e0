#include "control/path.h"

#include <sodium.h>

namespace rd2h::control {

Expected<std::unique_ptr<DealerPath>> DealerPath::connect(
    std::shared_ptr<Context> context, const std::string& url,
    const std::optional<ClientSecurity>& security) {
  RD2H_TRY(dealer, DealerChannel::connect(std::move(context), url, security));
  return std::unique_ptr<DealerPath>(new DealerPath(std::move(dealer)));
}

std::optional<Status> DealerPath::lost() {
  if (!dealer_->connection_lost()) return std::nullopt;
  if (!dealer_->refusal().empty()) return unreachable(dealer_->refusal());
  return peer_dead("the connection to " + dealer_->url() + " closed (Decode restarted or died)");
}

NotificationPath::~NotificationPath() {
  owner_.inboxes_.erase(channel_);
  owner_.engine_->close_notifications(channel_);
}

Status NotificationPath::send(std::span<const std::byte> message) {
  if (inbox_->closed) return *lost();
  return owner_.engine_->send_notification(channel_, message);
}

Expected<std::optional<std::vector<std::byte>>> NotificationPath::try_receive() {
  std::optional<std::vector<std::byte>> message;
  if (inbox_->messages.empty()) return message;
  message = std::move(inbox_->messages.front());
  inbox_->messages.pop_front();
  return message;
}

std::optional<Status> NotificationPath::lost() {
  if (!inbox_->closed) return std::nullopt;
  return peer_dead("notification channel " + std::to_string(channel_) +
                   " closed (its session broke, or the peer went)");
}

Expected<std::unique_ptr<NotificationPath>> Notifications::listen() {
  if (!available()) return failed_precondition("the transfer engine has no notifications");
  uint64_t channel = 0;
  randombytes_buf(&channel, sizeof(channel));  // the channel's capability: unguessable
  if (inboxes_.count(channel) != 0) {
    return already_exists("notification channel " + std::to_string(channel) + " has a path");
  }
  RD2H_RETURN_IF_ERROR(engine_->listen_notifications(channel));
  return expect(channel);
}

Expected<std::unique_ptr<NotificationPath>> Notifications::expect(uint64_t channel) {
  auto inbox = std::make_shared<NotificationPath::Inbox>();
  if (!inboxes_.try_emplace(channel, inbox).second) {
    return already_exists("notification channel " + std::to_string(channel) + " has a path");
  }
  return std::unique_ptr<NotificationPath>(new NotificationPath(*this, channel, std::move(inbox)));
}

bool Notifications::poll(bool arm) {
  if (!available()) return true;
  taken_.clear();
  const bool armed = engine_->get_notifications(taken_, arm);
  for (auto& n : taken_) {
    auto it = inboxes_.find(n.channel);
    if (it == inboxes_.end()) continue;  // its path went meanwhile
    NotificationPath::Inbox& inbox = *it->second;
    switch (n.kind) {
      case transfer::Notification::Kind::kOpened:
        inbox.opened = true;
        break;
      case transfer::Notification::Kind::kMessage:
        if (inbox.closed) break;
        if (inbox.messages.size() >= transfer::kMaxQueuedNotifications) {
          // Its peer says more than the path's owner takes: the path is lost.
          inbox.messages.clear();
          inbox.closed = true;
          engine_->close_notifications(n.channel);
          break;
        }
        inbox.messages.push_back(std::move(n.message));
        break;
      case transfer::Notification::Kind::kClosed:
        inbox.closed = true;
        break;
    }
  }
  return armed;
}

}  // namespace rd2h::control
