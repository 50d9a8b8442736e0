// Prefill's sender: its thread, the queue of readiness waiting for their layer's write, and
// the waits of whoever serves the connections (the connections themselves: sender_connection.cc).
#include "prefill/sender.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

namespace rd2h::prefill {

namespace {
using Clock = std::chrono::steady_clock;
constexpr std::chrono::milliseconds kPollSlice{50};
}  // namespace

Expected<std::unique_ptr<Sender>> Sender::start(SenderConfig config,
                                                std::shared_ptr<control::Context> context,
                                                protocol::MfMeta meta,
                                                std::shared_ptr<transfer::TransferEngine> engine) {
  UniqueFd fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  UniqueFd driver_fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!fd.valid() || !driver_fd.valid()) {
    return internal_error("cannot create the sender's wakeup fd");
  }
  auto sender =
      std::unique_ptr<Sender>(new Sender(config, std::move(context), std::move(meta),
                                         std::move(engine), std::move(fd), std::move(driver_fd)));
  sender->thread_ = std::thread([s = sender.get()] { s->run(); });
  return sender;
}

Sender::Sender(SenderConfig config, std::shared_ptr<control::Context> context,
               protocol::MfMeta meta, std::shared_ptr<transfer::TransferEngine> engine,
               UniqueFd wake_fd, UniqueFd driver_fd)
    : config_(config),
      context_(std::move(context)),
      meta_(std::move(meta)),
      mf_meta_(protocol::encode(meta_)),
      engine_(std::move(engine)),
      wake_fd_(std::move(wake_fd)),
      driver_fd_(std::move(driver_fd)),
      waker_(std::make_shared<Waker>()) {
  waker_->fd = wake_fd_.get();
  waker_->driver_fd = driver_fd_.get();
  waker_->sender = this;
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

void Sender::Waker::write_done() {
  // A notification that comes while this thread pumps (an event it asked that was done
  // already) is seen by that pump.
  thread_local bool pumping = false;
  if (pumping) return;
  {
    std::lock_guard lock(sender_mu);
    pumping = true;
    const bool sent = sender != nullptr && sender->try_pump();
    pumping = false;
    if (sent) return;
  }
  wake();
}

bool Sender::try_pump() {
  if (notifying_.load() == std::this_thread::get_id()) return false;
  std::unique_lock lock(mu_, std::try_to_lock);
  if (!lock.owns_lock() || stopping_.load()) return false;
  on_completion_ = true;
  pump();
  on_completion_ = false;
  return true;
}

void Sender::Waker::wake_driver() {
  std::lock_guard lock(mu);
  if (fd < 0) return;
  signal_fd(drivers.load() > 0 ? driver_fd : fd);
}

Sender::~Sender() {
  {
    std::lock_guard lock(waker_->sender_mu);  // a write completing now finishes first
    waker_->sender = nullptr;
  }
  stopping_.store(true);
  waker_->wake();
  if (thread_.joinable()) thread_.join();
  {
    // An event completing later (its host may keep it) finds no fd to write: the fds
    // themselves close with this.
    std::lock_guard lock(waker_->mu);
    waker_->fd = waker_->driver_fd = -1;
  }
}

void Sender::send(const std::string& url, int64_t layer_idx, std::vector<std::byte> payload,
                  std::vector<GateTicket> tickets, std::shared_ptr<WriteEvent> event,
                  std::string server_key, std::vector<std::string> final_ids) {
  Task t;
  t.url = url;
  t.layer_idx = layer_idx;
  t.payload = std::move(payload);
  t.tickets = std::move(tickets);
  t.event = std::move(event);
  t.server_key = std::move(server_key);
  t.final_ids = std::move(final_ids);
  t.event_deadline = Clock::now() + config_.event_timeout;
  std::lock_guard lock(mu_);
  if (stopping_.load()) {
    return answer_tickets(t.tickets, failed_precondition("the Prefill sender stopped"));
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

void Sender::answer_tickets(const std::vector<GateTicket>& tickets, const Status& outcome,
                            bool from_decode) {
  // Counted before the gates open, so whoever a gate wakes sees the count.
  count(from_decode ? &SenderStats::answers : &SenderStats::failures);
  for (const auto& t : tickets) t.gate->answer(t.generation, outcome);
}

bool Sender::serve_until(const std::function<bool()>& done, const Deadline& deadline) {
  std::vector<pollfd> fds;
  std::unique_lock lock(mu_);
  ++waker_->drivers;
  bool reached = false;
  for (;;) {
    serve();
    if ((reached = done()) || deadline.expired() || stopping_.load()) break;
    fds.clear();
    fds.push_back({driver_fd_.get(), POLLIN, 0});
    bool links = false;
    for (const auto& [url, ep] : endpoints_) {
      if (ep.dealer) fds.push_back({ep.dealer->notify_fd(), POLLIN, 0});
      links = links || ep.on_link;
    }
    // Answers on a link: this thread takes them off the engine itself, as it does off the
    // sockets, rather than wait for the engine's thread to hand them over.
    const int link_fd = links ? engine_->link_fd() : -1;
    if (link_fd >= 0) fds.push_back({link_fd, POLLIN, 0});
    int timeout =
        poll_ms(next_deadline(std::min(deadline.time_point(), Clock::now() + kPollSlice)));
    lock.unlock();
    if (link_fd >= 0 && !engine_->progress_links()) timeout = 0;
    ::poll(fds.data(), fds.size(), timeout);
    lock.lock();
    drain_fd(driver_fd_.get());
  }
  --waker_->drivers;
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
    if (waker_->drivers.load() > 0) signal_fd(driver_fd_.get());
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
    fds.push_back({wake_fd_.get(), POLLIN, 0});
    for (const auto& [url, ep] : endpoints_) {
      if (ep.dealer && !ep.acked) fds.push_back({ep.dealer->notify_fd(), POLLIN, 0});
    }
    const int timeout = poll_ms(next_deadline(Clock::now() + kPollSlice));
    lock.unlock();
    ::poll(fds.data(), fds.size(), timeout);
    lock.lock();
    drain_fd(wake_fd_.get());
  }
  const Status stopped = failed_precondition("the Prefill sender stopped");
  for (auto& [url, ep] : endpoints_) fail_endpoint(url, ep, stopped);
  std::deque<Task> unsent;
  unsent.swap(queued_);
  for (auto& t : unsent) answer_tickets(t.tickets, stopped);  // queued last: failed all the same
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
  notifying_.store(std::this_thread::get_id());
  t.notifies = t.event->notify([written = t.written, waker = waker_] {
    written->done.store(true);
    waker->write_done();
  });
  notifying_.store(std::thread::id{});
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
        answer_tickets(failed.tickets,
                       Status(st->code(), "layer " + std::to_string(failed.layer_idx) +
                                              " was not published: " + st->message()));
        continue;
      }
    }
    Task ready = std::move(t);
    queued_.pop_front();
    dispatch(std::move(ready));
  }
}

}  // namespace rd2h::prefill
