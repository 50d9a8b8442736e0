#include "transfer/ucx_notifications.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>

#include "rd2h/common/deadline.h"
#include "transfer/ucx_link.h"

namespace rd2h::transfer {

namespace {
// The queue whose consumer is polling on this thread: what its handlers deliver here needs
// no wake-up.
thread_local const void* t_polling = nullptr;

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
  n->queue_ = std::make_shared<Queue>();
  n->queue_->wake_fd.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  n->epoll_fd_.reset(::epoll_create1(EPOLL_CLOEXEC));
  if (!n->queue_->wake_fd.valid() || !n->epoll_fd_.valid()) {
    return internal_error("cannot create the notification fds");
  }
  RD2H_RETURN_IF_ERROR(add_to_epoll(n->epoll_fd_.get(), n->queue_->wake_fd.get()));
  RD2H_RETURN_IF_ERROR(add_to_epoll(n->epoll_fd_.get(), serving.event_fd()));
  return n;
}

void EngineNotifications::Queue::push(uint64_t channel, LinkEvent event,
                                      std::span<const std::byte> message) {
  {
    std::lock_guard lock(mu);
    if (open.count(channel) == 0) return;  // closed: nothing more is heard of it
    if (events.size() >= kMaxQueuedNotifications) {
      // The peer sends faster than the consumer takes: its channel closes, once.
      open.erase(channel);
      overflowed.push_back(channel);
    } else {
      Notification& n = events.emplace_back();
      n.channel = channel;
      n.kind = event == LinkEvent::kOpened   ? Notification::Kind::kOpened
               : event == LinkEvent::kClosed ? Notification::Kind::kClosed
                                             : Notification::Kind::kMessage;
      n.message.assign(message.begin(), message.end());
      if (event == LinkEvent::kClosed) open.erase(channel);
    }
  }
  if (t_polling == this) return;
  uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(wake_fd.get(), &one, sizeof(one));
}

Status EngineNotifications::channel_taken(uint64_t channel) {
  return already_exists("notification channel " + std::to_string(channel) +
                        " is in use on this engine");
}

LinkHandler EngineNotifications::handler(uint64_t channel) {
  return [queue = queue_, channel](LinkEvent event, std::span<const std::byte> message) {
    queue->push(channel, event, message);
  };
}

void EngineNotifications::forget(uint64_t channel) {
  std::lock_guard lock(queue_->mu);
  queue_->open.erase(channel);
  std::erase_if(queue_->events, [channel](const Notification& n) { return n.channel == channel; });
}

Status EngineNotifications::listen(uint64_t channel) {
  std::lock_guard lock(channels_mu_);
  if (sessions_.count(channel) != 0) return channel_taken(channel);
  {
    std::lock_guard queue_lock(queue_->mu);
    queue_->open.insert(channel);
  }
  Status st = serving_.links().expect(channel, handler(channel));
  if (!st) forget(channel);
  return st;
}

Status EngineNotifications::open(const std::shared_ptr<Session>& s, uint64_t channel) {
  {
    std::lock_guard lock(channels_mu_);
    if (sessions_.count(channel) != 0 || serving_.links().has(channel)) {
      return channel_taken(channel);
    }
    sessions_[channel] = s;
    std::lock_guard queue_lock(queue_->mu);
    queue_->open.insert(channel);
  }
  Status st = open_on_session(s, channel);
  if (!st) {
    forget(channel);
    std::lock_guard lock(channels_mu_);
    sessions_.erase(channel);
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
  forget(channel);
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
  t_polling = queue_.get();
  const bool sessions = progress_sessions(arm);
  // One progress of the serving worker, which may be busy serving reads: a consumer comes
  // back to check what it waits for, and calls again.
  const bool serving = serving_.progress_once(arm);
  t_polling = nullptr;
  std::vector<uint64_t> overflowed;
  {
    std::lock_guard lock(queue_->mu);
    uint64_t count;
    [[maybe_unused]] auto n = ::read(queue_->wake_fd.get(), &count, sizeof(count));
    for (auto& e : queue_->events) out.push_back(std::move(e));
    queue_->events.clear();
    overflowed.swap(queue_->overflowed);
  }
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
  // The consumer arms the new worker at its next poll: until then a message on it finds
  // the queue's wake-up fd.
  uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(queue_->wake_fd.get(), &one, sizeof(one));
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
