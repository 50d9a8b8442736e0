#include "transfer/ucx_notifications.h"

#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>

#include "rd2h/common/deadline.h"
#include "transfer/ucx_link.h"

namespace rd2h::transfer {

namespace {
Status add_to_epoll(int epoll_fd, int fd) {
  epoll_event ev{};
  ev.events = EPOLLIN;
  if (::epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &ev) != 0) {
    return internal_error("epoll_ctl(notification fds) failed");
  }
  return Status::ok();
}
}  // namespace

Expected<std::unique_ptr<EngineNotifications>> EngineNotifications::create(
    ServingWorker& serving, std::chrono::milliseconds connect_timeout,
    std::chrono::milliseconds send_timeout) {
  auto n = std::unique_ptr<EngineNotifications>(
      new EngineNotifications(serving, connect_timeout, send_timeout));
  RD2H_TRY(queue, NotificationQueue::create());
  n->queue_ = std::move(queue);
  n->epoll_fd_.reset(::epoll_create1(EPOLL_CLOEXEC));
  if (!n->epoll_fd_.valid()) return internal_error("cannot create the notification fds");
  RD2H_RETURN_IF_ERROR(add_to_epoll(n->epoll_fd_.get(), n->queue_->wake_fd()));
  RD2H_RETURN_IF_ERROR(add_to_epoll(n->epoll_fd_.get(), serving.event_fd()));
  return n;
}

Status EngineNotifications::channel_taken(uint64_t channel) {
  return already_exists("notification channel " + std::to_string(channel) +
                        " is in use on this engine");
}

LinkHandler EngineNotifications::handler(uint64_t channel) {
  return [queue = queue_, channel](Notification::Kind event, std::span<const std::byte> message) {
    queue->push(channel, event, message);
  };
}

Status EngineNotifications::listen(uint64_t channel) {
  std::lock_guard lock(channels_mu_);
  if (sessions_.count(channel) != 0 || serving_.links().has(channel)) {
    return channel_taken(channel);
  }
  queue_->open(channel);
  Status st = serving_.links().expect(channel, handler(channel));
  if (!st) queue_->close(channel);
  return st;
}

Status EngineNotifications::open(const std::shared_ptr<Session>& s, uint64_t channel) {
  {
    std::lock_guard lock(channels_mu_);
    if (sessions_.count(channel) != 0 || serving_.links().has(channel)) {
      return channel_taken(channel);
    }
    sessions_[channel] = s;
    queue_->open(channel);
  }
  Status st = open_on_session(s, channel);
  if (!st) {
    queue_->close(channel);
    std::lock_guard lock(channels_mu_);
    sessions_.erase(channel);
    return st;
  }
  bool closed_meanwhile = false;
  {
    std::lock_guard lock(channels_mu_);
    auto it = sessions_.find(channel);
    closed_meanwhile = it == sessions_.end() || it->second.lock() != s;
  }
  if (closed_meanwhile) {
    // close() ran while the channel opened (from another thread): its handler goes too.
    std::lock_guard lock(s->mu);
    s->links.erase(channel);
  }
  return st;
}

Status EngineNotifications::send(uint64_t channel, std::span<const std::byte> message) {
  if (message.size() > kMaxNotificationBytes) {
    return invalid_argument("a notification of " + std::to_string(message.size()) +
                            " bytes is over the limit of " + std::to_string(kMaxNotificationBytes));
  }
  if (serving_.links().has(channel)) return serving_.links().send(channel, message);
  std::shared_ptr<Session> s;
  {
    std::lock_guard lock(channels_mu_);
    auto it = sessions_.find(channel);
    if (it != sessions_.end()) s = it->second.lock();
  }
  const auto closed = [channel] {
    return failed_precondition("notification channel " + std::to_string(channel) + " is not open");
  };
  if (!s) return closed();
  std::lock_guard lock(s->mu);
  if (!s->worker || s->links.count(channel) == 0) return closed();
  const LinkMessageHeader h{channel};
  return send_and_wait(*s, kAmLinkMessage, &h, sizeof(h), message, send_timeout_);
}

void EngineNotifications::close(uint64_t channel) {
  queue_->close(channel);
  serving_.links().close(channel);
  std::shared_ptr<Session> s;
  {
    std::lock_guard lock(channels_mu_);
    auto it = sessions_.find(channel);
    if (it == sessions_.end()) return;
    s = it->second.lock();
    sessions_.erase(it);
  }
  if (!s) return;
  std::lock_guard lock(s->mu);
  s->links.erase(channel);
}

bool EngineNotifications::poll(std::vector<Notification>& out, bool arm) {
  // The wake-up is taken first: whatever signals it from now on (a session opened on
  // another thread, an event of a worker this pass does not progress) wakes the consumer
  // again.
  queue_->clear_wake();
  bool sessions = false, serving = false;
  {
    NotificationQueue::Polling polling(*queue_);
    sessions = progress_sessions(arm);
    // One progress of the serving worker, which may be busy serving reads: a consumer comes
    // back to check what it waits for, and calls again.
    serving = serving_.progress_once(arm);
  }
  const std::vector<uint64_t> overflowed = queue_->take(out);
  for (uint64_t channel : overflowed) {
    close(channel);
    out.push_back({channel, Notification::Kind::kClosed, {}});
  }
  return sessions && serving;
}

Status EngineNotifications::open_on_session(const std::shared_ptr<Session>& s, uint64_t channel) {
  std::lock_guard lock(s->mu);
  if (s->broken.load() || !s->worker) {
    return failed_precondition("session " + s->id + " is broken (" + s->broken_reason +
                               "); connect again to open a notification channel");
  }
  // Known before the peer can answer: nobody progresses the worker until this returns.
  s->links[channel] = handler(channel);
  const LinkOpenHeader h{channel, s->err_mode == UCP_ERR_HANDLING_MODE_PEER ? 1u : 0u, 0};
  if (Status st =
          send_and_wait(*s, kAmLinkOpen, &h, sizeof(h), s->worker_address, connect_timeout_);
      !st) {
    s->links.erase(channel);
    return st.with_context("opening notification channel " + std::to_string(channel));
  }
  if (s->watched) return Status::ok();
  int fd = -1;
  if (ucs_status_t st = ucp_worker_get_efd(s->worker.get(), &fd); st != UCS_OK) {
    s->links.erase(channel);
    return ucs_error("ucp_worker_get_efd", st);
  }
  if (Status st = add_to_epoll(epoll_fd_.get(), fd); !st) {
    s->links.erase(channel);
    return st;
  }
  s->watched = true;
  std::lock_guard watch_lock(watched_mu_);
  watched_.push_back(s);
  // The consumer arms the new worker at its next poll; until then the wake-up, which a poll
  // takes before it looks at the workers, brings it back.
  queue_->signal();
  return Status::ok();
}

Status EngineNotifications::send_and_wait(Session& s, uint16_t id, const void* header,
                                          size_t header_length, std::span<const std::byte> data,
                                          std::chrono::milliseconds timeout) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_AM_SEND_FLAG_EAGER;
  void* req = ucp_am_send_nbx(s.ep.get(), id, header, header_length, data.data(), data.size(), &p);
  if (req == nullptr) return Status::ok();
  if (UCS_PTR_IS_ERR(req)) {
    return s.fail(
        peer_dead("sending to " + s.id + " failed: " + ucs_status_string(UCS_PTR_STATUS(req))));
  }
  const Deadline deadline(timeout);
  auto next_check = Deadline::Clock::now();
  Status result = Status::ok();
  while (ucp_request_check_status(req) == UCS_INPROGRESS) {
    ucp_worker_progress(s.worker.get());
    const auto now = Deadline::Clock::now();
    if (now < next_check) continue;
    next_check = now + std::chrono::milliseconds(1);
    if (s.ep_error != UCS_OK || s.watch.exited()) {
      result = peer_dead("peer " + s.id + " failed while a message was sent to it");
      break;
    }
    if (deadline.expired()) {
      result = timeout_error("a message to " + s.id + " was not sent within " +
                             std::to_string(timeout.count()) + " ms");
      break;
    }
  }
  if (result.is_ok()) {
    if (ucs_status_t st = ucp_request_check_status(req); st != UCS_OK) {
      result = peer_dead("sending to " + s.id + " failed: " + ucs_status_string(st));
    }
  }
  ucp_request_free(req);  // one still in flight goes with the worker, next
  return result.is_ok() ? result : s.fail(std::move(result));
}

bool EngineNotifications::progress_sessions(bool arm) {
  std::vector<std::shared_ptr<Session>> sessions;
  {
    std::lock_guard lock(watched_mu_);
    std::erase_if(watched_, [](const std::weak_ptr<Session>& w) { return w.expired(); });
    for (const auto& w : watched_) {
      if (auto s = w.lock()) sessions.push_back(std::move(s));
    }
  }
  bool armed = arm;
  std::vector<const Session*> released;
  for (const auto& s : sessions) {
    std::lock_guard lock(s->mu);
    if (!s->worker) {
      released.push_back(s.get());
      continue;
    }
    while (ucp_worker_progress(s->worker.get()) != 0) {
    }
    if (arm && ucp_worker_arm(s->worker.get()) == UCS_ERR_BUSY) armed = false;
  }
  if (!released.empty()) {
    // A released session's worker is gone: it is not watched any more.
    std::lock_guard lock(watched_mu_);
    std::erase_if(watched_, [&](const std::weak_ptr<Session>& w) {
      auto s = w.lock();
      return !s || std::find(released.begin(), released.end(), s.get()) != released.end();
    });
  }
  return armed;  // a session dropped meanwhile is released with `sessions`, not held
}

}  // namespace rd2h::transfer
