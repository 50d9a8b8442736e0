#include "transfer/fault_injecting_engine.h"

#include <thread>

namespace rd2h::transfer {

void FaultInjectingEngine::fail_next_reads(int count, Status status, FaultPoint point) {
  std::lock_guard lock(mu_);
  pending_failures_ = count;
  failure_status_ = status.is_ok() ? transport_error("injected read failure") : std::move(status);
  failure_point_ = point;
}

void FaultInjectingEngine::delay_reads(std::chrono::milliseconds delay) {
  std::lock_guard lock(mu_);
  delay_ = delay;
}

int FaultInjectingEngine::injected_failures() const {
  std::lock_guard lock(mu_);
  return injected_;
}

void FaultInjectingEngine::hold_reads(int after) {
  std::lock_guard lock(mu_);
  holding_ = true;
  hold_after_ = after;
}

void FaultInjectingEngine::release_reads() {
  std::lock_guard lock(mu_);
  holding_ = false;
  released_.notify_all();
}

int FaultInjectingEngine::held_reads() const {
  std::lock_guard lock(mu_);
  return held_;
}

void FaultInjectingEngine::hold_connects() {
  std::lock_guard lock(mu_);
  holding_connects_ = true;
}

void FaultInjectingEngine::release_connects() {
  std::lock_guard lock(mu_);
  holding_connects_ = false;
  released_.notify_all();
}

int FaultInjectingEngine::held_connects() const {
  std::lock_guard lock(mu_);
  return held_connects_;
}

Expected<SessionHandle> FaultInjectingEngine::connect(std::span<const std::byte> peer_metadata) {
  {
    std::unique_lock lock(mu_);
    if (holding_connects_) {
      ++held_connects_;
      released_.wait_for(lock, std::chrono::minutes(1), [this] { return !holding_connects_; });
      --held_connects_;
    }
  }
  return inner_->connect(peer_metadata);
}

namespace {

// Reads whose outcome is decided here: failed before reading, or the inner request's
// outcome flipped to a failure once it is done.
class FaultyRequest final : public ReadRequest {
 public:
  FaultyRequest(std::unique_ptr<ReadRequest> inner, Status failure)
      : inner_(std::move(inner)), failure_(std::move(failure)) {}
  std::optional<Status> test() override {
    if (!inner_) return failure_;
    auto st = inner_->test();
    if (!st) return std::nullopt;
    return failure_;
  }
  Status wait() override {
    if (inner_) (void)inner_->wait();
    return failure_;
  }

 private:
  std::unique_ptr<ReadRequest> inner_;  // null: nothing was read
  Status failure_;
};

// Reads in flight until the hold is released, then as the inner request says.
class HeldRequest final : public ReadRequest {
 public:
  HeldRequest(std::unique_ptr<ReadRequest> inner,
              std::shared_ptr<FaultInjectingEngine::CompletionHold> hold)
      : inner_(std::move(inner)), hold_(std::move(hold)) {}
  ~HeldRequest() override { done(); }
  std::optional<Status> test() override {
    {
      std::lock_guard lock(hold_->mu);
      if (hold_->holding) return std::nullopt;
    }
    auto st = inner_->test();
    if (st) done();
    return st;
  }
  Status wait() override {
    {
      std::unique_lock lock(hold_->mu);
      hold_->released.wait_for(lock, std::chrono::minutes(1), [this] { return !hold_->holding; });
    }
    Status st = inner_->wait();
    done();
    return st;
  }

 private:
  void done() {
    if (counted_) return;
    counted_ = true;
    std::lock_guard lock(hold_->mu);
    --hold_->in_flight;
  }
  std::unique_ptr<ReadRequest> inner_;
  std::shared_ptr<FaultInjectingEngine::CompletionHold> hold_;
  bool counted_ = false;
};

}  // namespace

void FaultInjectingEngine::hold_completions() {
  std::lock_guard lock(completions_->mu);
  completions_->holding = true;
}

void FaultInjectingEngine::release_completions() {
  {
    std::lock_guard lock(completions_->mu);
    completions_->holding = false;
  }
  completions_->released.notify_all();
}

int FaultInjectingEngine::completions_held() const {
  std::lock_guard lock(completions_->mu);
  return completions_->in_flight;
}

Expected<std::unique_ptr<ReadRequest>> FaultInjectingEngine::post_reads(
    const SessionHandle& session, std::span<const ReadOp> ops) {
  bool fail = false;
  Status failure;
  FaultPoint point = FaultPoint::kBeforeRead;
  std::chrono::milliseconds delay{0};
  {
    std::unique_lock lock(mu_);
    if (holding_ && hold_after_ > 0) {
      --hold_after_;
    } else if (holding_) {
      ++held_;
      released_.wait_for(lock, std::chrono::minutes(1), [this] { return !holding_; });
      --held_;
    }
    if (pending_failures_ > 0) {
      --pending_failures_;
      ++injected_;
      fail = true;
      failure = failure_status_;
      point = failure_point_;
    }
    delay = delay_;
  }
  // Simulates a slow link, so a sleep is the behaviour itself rather than a synchronisation.
  if (delay.count() > 0) std::this_thread::sleep_for(delay);
  if (fail && point == FaultPoint::kBeforeRead) {
    return std::unique_ptr<ReadRequest>(std::make_unique<FaultyRequest>(nullptr, failure));
  }
  auto request = inner_->post_reads(session, ops);
  if (request) {
    std::lock_guard lock(completions_->mu);
    if (completions_->holding) {
      ++completions_->in_flight;
      *request = std::make_unique<HeldRequest>(std::move(*request), completions_);
    }
  }
  if (!fail || !request) return request;
  return std::unique_ptr<ReadRequest>(
      std::make_unique<FaultyRequest>(std::move(*request), std::move(failure)));
}

}  // namespace rd2h::transfer
