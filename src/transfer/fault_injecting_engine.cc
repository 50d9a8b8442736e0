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

Expected<std::string> FaultInjectingEngine::connect(std::span<const std::byte> peer_metadata) {
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

Status FaultInjectingEngine::batch_read_sync(std::string_view session,
                                             std::span<const uintptr_t> local,
                                             std::span<const uintptr_t> remote,
                                             std::span<const size_t> length) {
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
  if (fail && point == FaultPoint::kBeforeRead) return failure;
  Status st = inner_->batch_read_sync(session, local, remote, length);
  if (fail) return failure;
  return st;
}

}  // namespace rd2h::transfer
