#include "transfer/ucx_engine_links.h"

#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>

#include "rd2h/common/deadline.h"
#include "transfer/ucx_link.h"

namespace rd2h::transfer {

EngineLinks::~EngineLinks() {
  if (thread_.joinable()) {
    stopping_.store(true);
    wake_thread();
    thread_.join();
  }
}

Status EngineLinks::token_taken(uint64_t token) {
  return already_exists("link " + std::to_string(token) + " is in use on this engine");
}

Status EngineLinks::expect(uint64_t token, LinkHandler handler) {
  std::lock_guard lock(tokens_mu_);
  if (sessions_.count(token) != 0) return token_taken(token);
  return serving_.links().expect(token, std::move(handler));
}

Status EngineLinks::open(const std::shared_ptr<Session>& s, uint64_t token, LinkHandler handler) {
  RD2H_RETURN_IF_ERROR(start_thread());
  {
    std::lock_guard lock(tokens_mu_);
    if (sessions_.count(token) != 0 || serving_.links().has(token)) return token_taken(token);
    sessions_[token] = s;
  }
  Status st = open_on_session(s, token, std::move(handler));
  if (!st) {
    std::lock_guard lock(tokens_mu_);
    sessions_.erase(token);
  }
  return st;
}

Status EngineLinks::send(uint64_t token, std::span<const std::byte> message) {
  if (message.size() > kMaxLinkMessageBytes) {
    return invalid_argument("a link message of " + std::to_string(message.size()) +
                            " bytes is over the limit of " + std::to_string(kMaxLinkMessageBytes));
  }
  if (serving_.links().has(token)) return serving_.links().send(token, message);
  std::shared_ptr<Session> s;
  {
    std::lock_guard lock(tokens_mu_);
    auto it = sessions_.find(token);
    if (it != sessions_.end()) s = it->second.lock();
  }
  const auto closed = [token] {
    return failed_precondition("link " + std::to_string(token) + " is not open");
  };
  if (!s) return closed();
  std::lock_guard lock(s->mu);
  if (!s->worker || s->links.count(token) == 0) return closed();
  const LinkMessageHeader h{token};
  return send_and_wait(*s, kAmLinkMessage, &h, sizeof(h), message, send_timeout_);
}

void EngineLinks::close(uint64_t token) {
  serving_.links().close(token);
  std::shared_ptr<Session> s;
  {
    std::lock_guard lock(tokens_mu_);
    auto it = sessions_.find(token);
    if (it == sessions_.end()) return;
    s = it->second.lock();
    sessions_.erase(it);
  }
  if (!s) return;
  std::lock_guard lock(s->mu);
  s->links.erase(token);
}

int EngineLinks::fd() {
  std::lock_guard lock(thread_mu_);
  return make_fds().is_ok() ? driver_epoll_fd_.get() : -1;
}

void EngineLinks::drive(bool on) {
  if (on) {
    ++drivers_;
    return;
  }
  --drivers_;
  wake_thread();
}

bool EngineLinks::progress(bool arm) {
  const bool sessions = progress_sessions(arm);
  // One progress of the serving worker, which may be busy serving reads: a driver comes
  // back to check what it waits for, and calls again.
  return serving_.progress_once(arm) && sessions;
}

Status EngineLinks::open_on_session(const std::shared_ptr<Session>& s, uint64_t token,
                                    LinkHandler handler) {
  std::lock_guard lock(s->mu);
  if (s->broken.load() || !s->worker) {
    return failed_precondition("session " + s->id + " is broken (" + s->broken_reason +
                               "); connect again to open a link");
  }
  // Known before the peer can answer: nobody progresses the worker until this returns.
  s->links[token] = std::move(handler);
  const LinkOpenHeader h{token, s->err_mode == UCP_ERR_HANDLING_MODE_PEER ? 1u : 0u, 0};
  if (Status st =
          send_and_wait(*s, kAmLinkOpen, &h, sizeof(h), s->worker_address, connect_timeout_);
      !st) {
    s->links.erase(token);
    return st.with_context("opening link " + std::to_string(token));
  }
  if (s->watched) return Status::ok();
  int fd = -1;
  if (ucs_status_t st = ucp_worker_get_efd(s->worker.get(), &fd); st != UCS_OK) {
    s->links.erase(token);
    return ucs_error("ucp_worker_get_efd", st);
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  if (::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, fd, &ev) != 0 ||
      ::epoll_ctl(driver_epoll_fd_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
    s->links.erase(token);
    return internal_error("epoll_ctl(session worker fd) failed");
  }
  s->watched = true;
  std::lock_guard watch_lock(thread_mu_);
  watched_.push_back(s);
  wake_thread();  // it arms the new worker before it sleeps again
  return Status::ok();
}

Status EngineLinks::send_and_wait(Session& s, uint16_t id, const void* header, size_t header_length,
                                  std::span<const std::byte> data,
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

void EngineLinks::wake_thread() {
  if (!wake_fd_.valid()) return;
  uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(wake_fd_.get(), &one, sizeof(one));
}

Status EngineLinks::start_thread() {
  std::lock_guard lock(thread_mu_);
  RD2H_RETURN_IF_ERROR(make_fds());
  if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
  return Status::ok();
}

Status EngineLinks::make_fds() {
  if (driver_epoll_fd_.valid()) return Status::ok();
  epoll_fd_.reset(::epoll_create1(EPOLL_CLOEXEC));
  wake_fd_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  UniqueFd driver(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_fd_.valid() || !wake_fd_.valid() || !driver.valid()) {
    return internal_error("cannot create the links' fds");
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  if (::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, wake_fd_.get(), &ev) != 0 ||
      ::epoll_ctl(driver.get(), EPOLL_CTL_ADD, serving_.event_fd(), &ev) != 0) {
    return internal_error("epoll_ctl(links) failed");
  }
  driver_epoll_fd_ = std::move(driver);
  return Status::ok();
}

void EngineLinks::loop() {
  while (!stopping_.load()) {
    if (drivers_.load() > 0) {
      pollfd wake{wake_fd_.get(), POLLIN, 0};
      ::poll(&wake, 1, 100);
    } else if (progress_sessions(true)) {
      epoll_event events[8];
      // The timeout only bounds how long a missed wake-up could delay a message.
      ::epoll_wait(epoll_fd_.get(), events, 8, 100);
    }
    uint64_t count;
    [[maybe_unused]] auto n = ::read(wake_fd_.get(), &count, sizeof(count));
  }
}

bool EngineLinks::progress_sessions(bool arm) {
  std::vector<std::shared_ptr<Session>> sessions;
  {
    std::lock_guard lock(thread_mu_);
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
    std::lock_guard lock(thread_mu_);
    std::erase_if(watched_, [&](const std::weak_ptr<Session>& w) {
      auto s = w.lock();
      return !s || std::find(released.begin(), released.end(), s.get()) != released.end();
    });
  }
  return armed;  // a session dropped meanwhile is released with `sessions`, not held
}

}  // namespace rd2h::transfer
