#include "prefill/sender.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "common/trace.h"

namespace rd2h::prefill {

namespace {
using Clock = std::chrono::steady_clock;
constexpr std::chrono::milliseconds kPollSlice{50};
}  // namespace

Expected<std::unique_ptr<Sender>> Sender::start(SenderConfig config,
                                                std::shared_ptr<control::Context> context,
                                                protocol::MfMeta meta) {
  const int fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (fd < 0) return internal_error("cannot create the sender's wakeup fd");
  const int driver_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (driver_fd < 0) {
    ::close(fd);
    return internal_error("cannot create the sender's wakeup fd");
  }
  auto sender = std::unique_ptr<Sender>(
      new Sender(config, std::move(context), std::move(meta), fd, driver_fd));
  sender->thread_ = std::thread([s = sender.get()] { s->run(); });
  return sender;
}

Sender::Sender(SenderConfig config, std::shared_ptr<control::Context> context,
               protocol::MfMeta meta, int wake_fd, int driver_fd)
    : config_(config),
      context_(std::move(context)),
      mf_meta_(protocol::encode(meta)),
      wake_fd_(wake_fd),
      driver_fd_(driver_fd),
      waker_(std::make_shared<Waker>()) {
  waker_->fd = wake_fd;
  waker_->driver_fd = driver_fd;
}

namespace {
void signal_fd(int fd) {
  uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(fd, &one, sizeof(one));
}
void drain_fd(int fd) {
  uint64_t count;
  [[maybe_unused]] auto n = ::read(fd, &count, sizeof(count));
}
int poll_ms(Clock::time_point until) {
  const auto left = until - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  return static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(left).count());
}
}  // namespace

void Sender::Waker::wake() {
  std::lock_guard lock(mu);
  if (fd < 0) return;  // the sender is gone: nobody to wake
  signal_fd(fd);
  signal_fd(driver_fd);
}

Sender::~Sender() {
  stopping_.store(true);
  waker_->wake();
  if (thread_.joinable()) thread_.join();
  {
    // An event completing later (its host may keep it) finds no fd to write.
    std::lock_guard lock(waker_->mu);
    waker_->fd = waker_->driver_fd = -1;
  }
  ::close(wake_fd_);
  ::close(driver_fd_);
}

void Sender::send(const std::string& url, const protocol::ReadReadyBatch& ready,
                  std::vector<GateTicket> tickets, std::shared_ptr<WriteEvent> event,
                  std::string server_key) {
  send(url, ready.layer_idx, protocol::encode(ready), std::move(tickets), std::move(event),
       std::move(server_key));
}

void Sender::send(const std::string& url, int64_t layer_idx, std::vector<std::byte> payload,
                  std::vector<GateTicket> tickets, std::shared_ptr<WriteEvent> event,
                  std::string server_key) {
  Task t;
  t.url = url;
  t.layer_idx = layer_idx;
  t.payload = std::move(payload);
  t.tickets = std::move(tickets);
  t.event = std::move(event);
  t.server_key = std::move(server_key);
  t.event_deadline = Clock::now() + config_.event_timeout;
  std::lock_guard lock(mu_);
  if (stopping_.load()) {
    return settle(t.tickets, false, "the Prefill sender stopped");
  }
  queued_.push_back(std::move(t));
  pump();
}

SenderStats Sender::stats() const {
  std::lock_guard lock(stats_mu_);
  return stats_;
}

void Sender::count(uint64_t SenderStats::*field) {
  std::lock_guard lock(stats_mu_);
  ++(stats_.*field);
}

void Sender::settle(const std::vector<GateTicket>& tickets, bool ok, const std::string& why,
                    bool from_decode) {
  // Counted before the gates open, so whoever a gate wakes sees the count.
  count(from_decode ? &SenderStats::answers : &SenderStats::failures);
  for (const auto& t : tickets) t.gate->answer(t.generation, ok, why);
}

bool Sender::serve_until(const std::function<bool()>& done, const Deadline& deadline) {
  std::vector<pollfd> fds;
  std::unique_lock lock(mu_);
  ++drivers_;
  bool reached = false;
  for (;;) {
    serve();
    if ((reached = done()) || deadline.expired() || stopping_.load()) break;
    fds.clear();
    fds.push_back({driver_fd_, POLLIN, 0});
    for (const auto& [url, ep] : endpoints_) {
      if (ep.dealer) fds.push_back({ep.dealer->notify_fd(), POLLIN, 0});
    }
    const int timeout =
        poll_ms(next_deadline(std::min(deadline.time_point(), Clock::now() + kPollSlice)));
    lock.unlock();
    ::poll(fds.data(), fds.size(), timeout);
    lock.lock();
    drain_fd(driver_fd_);
  }
  --drivers_;
  return reached;
}

void Sender::serve() {
  pump();
  for (auto& [url, ep] : endpoints_) {
    if (ep.dealer) receive(url, ep);
  }
  for (auto& [url, ep] : endpoints_) drop_if_lost(url, ep);
  check_deadlines();
}

Clock::time_point Sender::next_deadline(Clock::time_point cap) const {
  Clock::time_point next = cap;
  for (const auto& [url, ep] : endpoints_) {
    if (!ep.dealer) continue;
    if (!ep.acked) next = std::min(next, ep.ack_deadline);
    if (!ep.pending.empty()) next = std::min(next, ep.pending.front().deadline);
  }
  if (!queued_.empty()) next = std::min(next, queued_.front().event_deadline);
  return next;
}

void Sender::run() {
  std::vector<pollfd> fds;
  std::unique_lock lock(mu_);
  while (!stopping_.load()) {
    serve();
    // Someone waiting in serve_until polls without the lock: tell it something changed.
    if (drivers_ > 0) signal_fd(driver_fd_);
    // A write event that cannot notify is waited on here, without the lock.
    if (!queued_.empty() && queued_.front().written && !queued_.front().notifies &&
        !queued_.front().written->done.load()) {
      auto event = queued_.front().event;
      auto written = queued_.front().written;
      const auto until = queued_.front().event_deadline;
      lock.unlock();
      written->status = event->wait(Deadline::at(until));
      written->done.store(true);
      waker_->wake();
      lock.lock();
      continue;
    }
    // The sender thread watches what nobody waits on: the wake-up fd (a write completed,
    // a new connection, stop) and connections waiting for their ACK. Answers are read by
    // whoever waits for them, or at the latest here, every slice.
    fds.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    for (const auto& [url, ep] : endpoints_) {
      if (ep.dealer && !ep.acked) fds.push_back({ep.dealer->notify_fd(), POLLIN, 0});
    }
    const int timeout = poll_ms(next_deadline(Clock::now() + kPollSlice));
    lock.unlock();
    ::poll(fds.data(), fds.size(), timeout);
    lock.lock();
    drain_fd(wake_fd_);
  }
  const std::string stopped = "the Prefill sender stopped";
  for (auto& [url, ep] : endpoints_) fail_endpoint(url, ep, stopped);
  std::deque<Task> unsent;
  unsent.swap(queued_);
  for (auto& t : unsent) settle(t.tickets, false, stopped);  // queued last: failed all the same
}

std::optional<Status> Sender::write_outcome(Task& t) {
  if (t.written && t.written->done.load()) {
    // Complete: its outcome (the sender thread's wait holds it for an event that cannot
    // notify).
    return t.notifies ? t.event->wait(Deadline(std::chrono::milliseconds(0))) : t.written->status;
  }
  Status st = t.event->wait(Deadline(std::chrono::milliseconds(0)));
  if (st.code() != StatusCode::kTimeout) return st;  // complete, or failed
  if (Clock::now() >= t.event_deadline) {
    return timeout_error("the layer's KV write did not complete in time");
  }
  if (t.written) return std::nullopt;  // still being written; told already
  t.written = std::make_shared<Written>();
  t.notifies = t.event->notify([written = t.written, waker = waker_] {
    written->done.store(true);
    waker->wake();
  });
  if (!t.notifies) {
    waker_->wake();  // the sender thread waits on it
    return std::nullopt;
  }
  if (t.written->done.load()) return write_outcome(t);  // it completed meanwhile
  return std::nullopt;
}

void Sender::pump() {
  while (!queued_.empty()) {
    Task& t = queued_.front();
    if (t.event) {
      const std::optional<Status> st = write_outcome(t);
      if (!st) return;
      if (!*st) {
        Task failed = std::move(t);
        queued_.pop_front();
        settle(
            failed.tickets, false,
            "layer " + std::to_string(failed.layer_idx) + " was not published: " + st->message());
        continue;
      }
    }
    Task ready = std::move(t);
    queued_.pop_front();
    dispatch(std::move(ready));
  }
}

void Sender::dispatch(Task task) {
  Endpoint& ep = endpoints_[task.url];
  // Never send on a connection the peer no longer knows; what it answered before it went
  // counts (answers nobody waited for may still be in the socket).
  if (ep.dealer) receive(task.url, ep);
  drop_if_lost(task.url, ep);
  if (!ep.dealer) {
    // A new connection, or one rebuilt after a failure: it starts with MF_META, since the
    // Decode side keys its metadata by connection.
    std::optional<control::ClientSecurity> security;
    if (config_.curve) security = control::ClientSecurity{*config_.curve, task.server_key};
    auto dealer = control::DealerChannel::connect(context_, task.url, security);
    if (!dealer) return settle(task.tickets, false, dealer.status().message());
    ep.dealer = std::move(*dealer);
    ep.acked = false;
    ep.ack_deadline = Clock::now() + config_.ack_timeout;
    if (Status st = ep.dealer->send(mf_meta_); !st) {
      const std::string url = task.url;
      ep.waiting.push_back(std::move(task));
      return fail_endpoint(url, ep, st.message());
    }
    count(&SenderStats::mf_meta_sent);
    waker_->wake();  // the sender thread watches for the ACK
  }
  if (!ep.acked) {
    ep.waiting.push_back(std::move(task));
    return;
  }
  transmit(ep, std::move(task));
}

void Sender::transmit(Endpoint& ep, Task task) {
  if (Status st = ep.dealer->send(task.payload); !st) {
    return settle(task.tickets, false, st.message());
  }
  ep.pending.push_back(
      {task.layer_idx, std::move(task.tickets), Clock::now() + config_.reply_timeout});
  trace::instant("readiness", "sender", task.layer_idx);
  count(&SenderStats::readiness_sent);
}

void Sender::receive(const std::string& url, Endpoint& ep) {
  for (;;) {
    auto payload = ep.dealer->try_receive();
    if (!payload || !payload->has_value()) return;
    const auto& bytes = **payload;
    if (!ep.acked) {
      if (protocol::is_ack(bytes)) {
        ep.acked = true;
        trace::instant("mf_meta ack", "sender");
        std::deque<Task> waiting;
        waiting.swap(ep.waiting);
        for (auto& t : waiting) transmit(ep, std::move(t));
        continue;
      }
      auto refusal = protocol::decode_message(bytes);
      const std::string why = refusal && std::holds_alternative<protocol::ReadFailed>(*refusal)
                                  ? std::get<protocol::ReadFailed>(*refusal).error
                                  : "Decode answered MF_META with something other than ACK";
      return fail_endpoint(url, ep, why);
    }
    auto message = protocol::decode_message(bytes);
    if (ep.pending.empty()) continue;  // nothing waits for it: a late answer
    Pending p = std::move(ep.pending.front());
    ep.pending.pop_front();
    bool ok = false;
    std::string reason;
    int64_t layer = -1;
    if (!message) {
      reason = "undecodable answer from " + url + ": " + message.status().message();
    } else if (auto* done = std::get_if<protocol::ReadDone>(&*message)) {
      ok = true;
      layer = done->layer_idx;
    } else if (auto* failed = std::get_if<protocol::ReadFailed>(&*message)) {
      reason = failed->error;
      layer = failed->layer_idx;
    } else {
      reason = "unexpected message from " + url;
    }
    if (message && layer != p.layer_idx) {
      // Answers come in request order; one out of order means the connection lost track.
      ep.pending.push_front(std::move(p));
      return fail_endpoint(url, ep,
                           "answer for layer " + std::to_string(layer) + " while layer " +
                               std::to_string(p.layer_idx) + " was expected from " + url);
    }
    trace::instant(ok ? "answer" : "read failed", "sender", p.layer_idx);
    settle(p.tickets, ok, reason, /*from_decode=*/true);
  }
}

bool Sender::drop_if_lost(const std::string& url, Endpoint& ep) {
  if (!ep.dealer || !ep.dealer->connection_lost()) return false;
  count(&SenderStats::connections_lost);
  fail_endpoint(url, ep,
                ep.dealer->refusal().empty()
                    ? "the connection to " + url + " closed (Decode restarted or died)"
                    : ep.dealer->refusal());
  return true;
}

void Sender::check_deadlines() {
  const auto now = Clock::now();
  for (auto& [url, ep] : endpoints_) {
    if (!ep.dealer) continue;
    if (!ep.acked && now >= ep.ack_deadline) {
      fail_endpoint(url, ep,
                    "no ACK for MF_META from " + url + " within " +
                        std::to_string(config_.ack_timeout.count()) + " ms");
    } else if (!ep.pending.empty() && now >= ep.pending.front().deadline) {
      fail_endpoint(url, ep,
                    "no answer from " + url + " for layer " +
                        std::to_string(ep.pending.front().layer_idx) + " within " +
                        std::to_string(config_.reply_timeout.count()) + " ms");
    }
  }
}

void Sender::fail_endpoint(const std::string& /*url*/, Endpoint& ep, const std::string& why) {
  for (auto& p : ep.pending) settle(p.tickets, false, why);
  for (auto& t : ep.waiting) settle(t.tickets, false, why);
  ep.pending.clear();
  ep.waiting.clear();
  ep.dealer.reset();  // the next readiness reconnects and sends MF_META again
  ep.acked = false;
}

}  // namespace rd2h::prefill
