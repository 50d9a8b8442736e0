// Prefill's sender: its thread, which alone touches the connections, the queue of readiness
// waiting for their layer's write, and the waiter for write events that cannot notify (the
// connections themselves: sender_connection.cc).
#include "prefill/sender.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <condition_variable>

namespace rd2h::prefill {

namespace {
using Clock = std::chrono::steady_clock;
// Longest sleep of the sender thread: a bound on a missed wake-up, not a poll.
constexpr std::chrono::milliseconds kPollSlice{50};
// How often the waiter looks up from an event it waits on to see whether the sender stops.
constexpr std::chrono::milliseconds kWaitSlice{50};

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

// Waits, in order, on the write events that cannot notify, so that the sender thread never
// blocks on one; marks each done and wakes the sender thread.
class Sender::EventWaiter {
 public:
  explicit EventWaiter(std::shared_ptr<Waker> waker)
      : waker_(std::move(waker)), thread_([this] { run(); }) {}
  ~EventWaiter() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    changed_.notify_all();
    thread_.join();  // within kWaitSlice of an event's wait
  }
  EventWaiter(const EventWaiter&) = delete;
  EventWaiter& operator=(const EventWaiter&) = delete;

  // Bounded by the slots, as the tasks are.
  void wait_for(std::shared_ptr<WriteEvent> event, std::shared_ptr<Written> written,
                Clock::time_point deadline) {
    {
      std::lock_guard lock(mu_);
      events_.push_back({std::move(event), std::move(written), deadline});
    }
    changed_.notify_all();
  }

 private:
  struct Entry {
    std::shared_ptr<WriteEvent> event;
    std::shared_ptr<Written> written;
    Clock::time_point deadline;
  };
  void run() {
    std::unique_lock lock(mu_);
    for (;;) {
      changed_.wait(lock, [this] { return stopping_ || !events_.empty(); });
      if (stopping_) return;
      Entry e = std::move(events_.front());
      events_.pop_front();
      lock.unlock();
      Status st = timeout_error("the layer's KV write did not complete in time");
      for (;;) {
        const auto until = std::min(e.deadline, Clock::now() + kWaitSlice);
        st = e.event->wait(Deadline::at(until));
        if (st.code() != StatusCode::kTimeout || Clock::now() >= e.deadline) break;
        std::lock_guard stop(mu_);
        if (stopping_) return;  // the sender fails the task itself
      }
      e.written->status = std::move(st);
      e.written->done.store(true);
      waker_->wake();
      lock.lock();
    }
  }

  std::shared_ptr<Waker> waker_;
  std::mutex mu_;
  std::condition_variable changed_;
  std::deque<Entry> events_;
  bool stopping_ = false;
  std::thread thread_;
};

Expected<std::unique_ptr<Sender>> Sender::start(SenderConfig config,
                                                std::shared_ptr<control::Context> context,
                                                protocol::MfMeta meta,
                                                std::shared_ptr<transfer::TransferEngine> engine) {
  UniqueFd fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!fd.valid()) return internal_error("cannot create the sender's wakeup fd");
  auto sender = std::unique_ptr<Sender>(
      new Sender(config, std::move(context), std::move(meta), std::move(engine), std::move(fd)));
  sender->thread_ = std::thread([s = sender.get()] { s->run(); });
  return sender;
}

Sender::Sender(SenderConfig config, std::shared_ptr<control::Context> context,
               protocol::MfMeta meta, std::shared_ptr<transfer::TransferEngine> engine,
               UniqueFd wake_fd)
    : config_(config),
      context_(std::move(context)),
      meta_(std::move(meta)),
      mf_meta_(protocol::encode(meta_)),
      links_(config_.control_link ? std::move(engine) : nullptr),
      wake_fd_(std::move(wake_fd)),
      waker_(std::make_shared<Waker>()) {
  waker_->fd = wake_fd_.get();
}

void Sender::Waker::wake() {
  std::lock_guard lock(mu);
  if (fd >= 0) signal_fd(fd);  // else the sender is gone: nobody to wake
}

Sender::~Sender() {
  {
    std::lock_guard lock(submit_mu_);
    stopping_ = true;
  }
  waker_->wake();
  if (thread_.joinable()) thread_.join();
  // An event completing later (its host may keep it) finds no fd to write: the fd itself
  // closes with this.
  std::lock_guard lock(waker_->mu);
  waker_->fd = -1;
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
  {
    std::unique_lock lock(submit_mu_);
    if (stopping_) {
      lock.unlock();
      return answer_tickets(t.tickets, failed_precondition("the Prefill sender stopped"));
    }
    submitted_.push_back(std::move(t));
  }
  waker_->wake();
}

SenderStats Sender::stats() const {
  std::lock_guard lock(stats_mu_);
  return stats_;
}

void Sender::count(uint64_t SenderStats::*field) {
  std::lock_guard lock(stats_mu_);
  ++(stats_.*field);
}

void Sender::set_waiting_for_write() {
  std::lock_guard lock(stats_mu_);
  stats_.waiting_for_write = queued_.size();
}

void Sender::answer_tickets(const std::vector<GateTicket>& tickets, const Status& outcome,
                            bool from_decode) {
  // Counted before the gates open, so whoever a gate wakes sees the count.
  count(from_decode ? &SenderStats::answers : &SenderStats::failures);
  for (const auto& t : tickets) t.gate->answer(t.generation, outcome);
}

bool Sender::take_submitted() {
  std::lock_guard lock(submit_mu_);
  if (stopping_) return false;
  for (auto& t : submitted_) queued_.push_back(std::move(t));
  submitted_.clear();
  return true;
}

void Sender::serve() {
  pump();
  set_waiting_for_write();
  for (auto& [url, ep] : endpoints_) {
    if (ep.zmq) receive(url, ep);
  }
  for (auto& [url, ep] : endpoints_) drop_if_lost(url, ep);
  check_deadlines();
}

Clock::time_point Sender::next_deadline(Clock::time_point cap) const {
  Clock::time_point next = cap;
  for (const auto& [url, ep] : endpoints_) {
    if (!ep.zmq) continue;
    if (!ep.acked) next = std::min(next, ep.ack_deadline);
    if (!ep.pending.empty()) next = std::min(next, ep.pending.front().deadline);
  }
  if (!queued_.empty()) next = std::min(next, queued_.front().event_deadline);
  return next;
}

void Sender::run() {
  std::vector<pollfd> fds;
  while (take_submitted()) {
    bool on_links = false, offered = false;
    for (const auto& [url, ep] : endpoints_) {
      on_links = on_links || ep.on_link;
      offered = offered || ep.link;
    }
    // This thread takes what the links carry off the engine itself, as it does off the
    // sockets, and serves it before it sleeps. A link offered but not in use yet is only
    // looked at (its opening is seen before this thread sends anything, which follows a
    // wake-up): sleeping on the engine would wake this thread for every read it serves.
    bool armed = true;
    if (on_links) {
      armed = links_.poll();
    } else if (offered) {
      links_.poll(/*arm=*/false);
    }
    serve();
    // Asleep until something changes: a submission, a write completing or stop (the
    // wake-up fd), something on a connection, or on a link.
    fds.clear();
    fds.push_back({wake_fd_.get(), POLLIN, 0});
    for (const auto& [url, ep] : endpoints_) {
      if (ep.zmq) fds.push_back({ep.zmq->notify_fd(), POLLIN, 0});
    }
    if (on_links) fds.push_back({links_.fd(), POLLIN, 0});
    const int timeout = armed ? poll_ms(next_deadline(Clock::now() + kPollSlice)) : 0;
    ::poll(fds.data(), fds.size(), timeout);
    drain_fd(wake_fd_.get());
  }
  waiter_.reset();
  const Status stopped = failed_precondition("the Prefill sender stopped");
  for (auto& [url, ep] : endpoints_) fail_endpoint(url, ep, stopped);
  std::deque<Task> unsent;
  unsent.swap(queued_);
  {
    std::lock_guard lock(submit_mu_);
    for (auto& t : submitted_) unsent.push_back(std::move(t));
    submitted_.clear();
  }
  for (auto& t : unsent) answer_tickets(t.tickets, stopped);  // queued last: failed all the same
  set_waiting_for_write();
}

std::optional<Status> Sender::write_outcome(Task& t) {
  if (t.written && t.written->done.load()) {
    // Complete: its outcome (the waiter's wait holds it for an event that cannot notify).
    return t.notifies ? t.event->wait(Deadline(std::chrono::milliseconds(0))) : t.written->status;
  }
  if (!t.written) {
    Status st = t.event->wait(Deadline(std::chrono::milliseconds(0)));
    if (st.code() != StatusCode::kTimeout) return st;  // complete, or failed
  }
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
    if (!waiter_) waiter_ = std::make_unique<EventWaiter>(waker_);
    waiter_->wait_for(t.event, t.written, t.event_deadline);
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
