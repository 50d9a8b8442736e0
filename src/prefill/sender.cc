#include "prefill/sender.h"

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
  auto sender =
      std::unique_ptr<Sender>(new Sender(config, std::move(context), std::move(meta), fd));
  sender->thread_ = std::thread([s = sender.get()] { s->run(); });
  return sender;
}

Sender::Sender(SenderConfig config, std::shared_ptr<control::Context> context,
               protocol::MfMeta meta, int wake_fd)
    : config_(config),
      context_(std::move(context)),
      mf_meta_(protocol::encode(meta)),
      wake_fd_(wake_fd),
      waker_(std::make_shared<Waker>()) {
  waker_->fd = wake_fd;
}

void Sender::Waker::wake() {
  std::lock_guard lock(mu);
  if (fd < 0) return;  // the sender is gone: nobody to wake
  uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(fd, &one, sizeof(one));
}

Sender::~Sender() {
  stopping_.store(true);
  waker_->wake();
  if (thread_.joinable()) thread_.join();
  {
    // An event completing later (its host may keep it) finds no fd to write.
    std::lock_guard lock(waker_->mu);
    waker_->fd = -1;
  }
  ::close(wake_fd_);
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
  {
    std::lock_guard lock(mu_);
    Task t;
    t.url = url;
    t.layer_idx = layer_idx;
    t.payload = std::move(payload);
    t.tickets = std::move(tickets);
    t.event = std::move(event);
    t.server_key = std::move(server_key);
    tasks_.push_back(std::move(t));
  }
  waker_->wake();
}

SenderStats Sender::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

void Sender::settle(const std::vector<GateTicket>& tickets, bool ok, const std::string& why,
                    bool from_decode) {
  {
    // Counted before the gates open, so whoever a gate wakes sees the count.
    std::lock_guard lock(mu_);
    ++(from_decode ? stats_.answers : stats_.failures);
  }
  for (const auto& t : tickets) t.gate->answer(t.generation, ok, why);
}

void Sender::run() {
  while (!stopping_.load()) {
    std::vector<control::DealerChannel*> dealers;
    std::vector<std::string> urls;
    for (auto& [url, ep] : endpoints_) {
      if (!ep.dealer) continue;
      dealers.push_back(ep.dealer.get());
      urls.push_back(url);
    }
    auto ready = control::wait_readable(dealers, wake_fd_, kPollSlice);
    if (ready && (*ready)[dealers.size()]) {
      uint64_t drained;
      [[maybe_unused]] auto n = ::read(wake_fd_, &drained, sizeof(drained));
    }
    take_tasks();
    pump();
    if (ready) {
      for (size_t i = 0; i < urls.size(); ++i) {
        if (!(*ready)[i]) continue;
        auto it = endpoints_.find(urls[i]);
        if (it != endpoints_.end() && it->second.dealer) receive(it->first, it->second);
      }
    }
    for (auto& [url, ep] : endpoints_) drop_if_lost(url, ep);
    check_deadlines();
  }
  const std::string stopped = "the Prefill sender stopped";
  for (auto& [url, ep] : endpoints_) fail_endpoint(url, ep, stopped);
  std::deque<Task> unsent;
  unsent.swap(queued_);
  {
    std::lock_guard lock(mu_);
    for (auto& t : tasks_) unsent.push_back(std::move(t));
    tasks_.clear();
  }
  for (auto& t : unsent) settle(t.tickets, false, stopped);  // queued last: failed all the same
}

void Sender::take_tasks() {
  std::deque<Task> tasks;
  {
    std::lock_guard lock(mu_);
    tasks.swap(tasks_);
  }
  const auto deadline = Clock::now() + config_.event_timeout;
  for (auto& t : tasks) {
    t.event_deadline = deadline;
    queued_.push_back(std::move(t));
  }
}

void Sender::pump() {
  while (!queued_.empty()) {
    Task& t = queued_.front();
    if (t.event) {
      if (!t.asked) {
        t.asked = true;
        t.written = std::make_shared<std::atomic<bool>>(false);
        t.notifies = t.event->notify([written = t.written, waker = waker_] {
          written->store(true);
          waker->wake();
        });
      }
      Status st;
      if (!t.notifies) {
        // An event that cannot call back is waited on here, as long as it takes.
        st = t.event->wait(Deadline(t.event_deadline - Clock::now()));
      } else if (t.written->load()) {
        st = t.event->wait(Deadline(std::chrono::milliseconds(0)));  // complete: its outcome
      } else if (Clock::now() >= t.event_deadline) {
        st = timeout_error("the layer's KV write did not complete in time");
      } else {
        return;  // still being written; its notification wakes the thread
      }
      if (!st) {
        Task failed = std::move(t);
        queued_.pop_front();
        settle(failed.tickets, false,
               "layer " + std::to_string(failed.layer_idx) + " was not published: " +
                   st.message());
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
  drop_if_lost(task.url, ep);  // never send on a connection the peer no longer knows
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
    std::lock_guard lock(mu_);
    ++stats_.mf_meta_sent;
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
  std::lock_guard lock(mu_);
  ++stats_.readiness_sent;
}

void Sender::receive(const std::string& url, Endpoint& ep) {
  for (;;) {
    auto payload = ep.dealer->receive(std::chrono::milliseconds(0));
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
  {
    std::lock_guard lock(mu_);
    ++stats_.connections_lost;
  }
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
