#include "rd2h/prefill/sender.h"

#include <sys/eventfd.h>
#include <unistd.h>

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
      wake_fd_(wake_fd) {}

Sender::~Sender() {
  stopping_.store(true);
  uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(wake_fd_, &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  ::close(wake_fd_);
}

void Sender::send(const std::string& url, protocol::ReadReadyBatch ready, SlotGate* gate,
                  uint64_t generation) {
  {
    std::lock_guard lock(mu_);
    tasks_.push_back({url, std::move(ready), gate, generation});
  }
  uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(wake_fd_, &one, sizeof(one));
}

SenderStats Sender::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

void Sender::count_failure() {
  std::lock_guard lock(mu_);
  ++stats_.failures;
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
    if (ready) {
      for (size_t i = 0; i < urls.size(); ++i) {
        if (!(*ready)[i]) continue;
        auto it = endpoints_.find(urls[i]);
        if (it != endpoints_.end() && it->second.dealer) receive(it->first, it->second);
      }
    }
    check_deadlines();
  }
  const std::string stopped = "the Prefill sender stopped";
  for (auto& [url, ep] : endpoints_) fail_endpoint(url, ep, stopped);
  std::lock_guard lock(mu_);
  for (auto& t : tasks_) {  // queued last: never sent, failed all the same
    ++stats_.failures;
    t.gate->answer(t.generation, false, stopped);
  }
  tasks_.clear();
}

void Sender::take_tasks() {
  std::deque<Task> tasks;
  {
    std::lock_guard lock(mu_);
    tasks.swap(tasks_);
  }
  for (auto& t : tasks) dispatch(std::move(t));
}

void Sender::dispatch(Task task) {
  Endpoint& ep = endpoints_[task.url];
  if (!ep.dealer) {
    // A new connection, or one rebuilt after a failure: it starts with MF_META, since the
    // Decode side keys its metadata by connection.
    auto dealer = control::DealerChannel::connect(context_, task.url);
    if (!dealer) {
      count_failure();
      task.gate->answer(task.generation, false, dealer.status().message());
      return;
    }
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
  if (Status st = ep.dealer->send(protocol::encode(task.ready)); !st) {
    count_failure();
    task.gate->answer(task.generation, false, st.message());
    return;
  }
  ep.pending.push_back(
      {task.ready.layer_idx, task.gate, task.generation, Clock::now() + config_.reply_timeout});
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
    Pending p = ep.pending.front();
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
      ep.pending.push_front(p);
      return fail_endpoint(url, ep,
                           "answer for layer " + std::to_string(layer) + " while layer " +
                               std::to_string(p.layer_idx) + " was expected from " + url);
    }
    {
      // Counted before the gate opens, so whoever the gate wakes sees the count.
      std::lock_guard lock(mu_);
      ++stats_.answers;
    }
    p.gate->answer(p.generation, ok, reason);
  }
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
  for (auto& p : ep.pending) {
    count_failure();
    p.gate->answer(p.generation, false, why);
  }
  for (auto& t : ep.waiting) {
    count_failure();
    t.gate->answer(t.generation, false, why);
  }
  ep.pending.clear();
  ep.waiting.clear();
  ep.dealer.reset();  // the next readiness reconnects and sends MF_META again
  ep.acked = false;
}

}  // namespace rd2h::prefill
