#include "prefill/slot_gate.h"

namespace rd2h::prefill {

uint64_t SlotGate::open(int64_t layer_idx, size_t endpoints, uint64_t tag) {
  std::lock_guard lock(mu_);
  ++generation_;
  layer_ = layer_idx;
  tag_ = tag;
  expected_ = endpoints;
  answered_ = 0;
  failure_ = Status::ok();
  failure_raised_ = false;
  changed_.notify_all();
  return generation_;
}

void SlotGate::answer(uint64_t generation, const Status& outcome) {
  std::lock_guard lock(mu_);
  if (generation != generation_ || answered_ >= expected_) return;  // late or extra
  ++answered_;
  if (!outcome && failure_.is_ok()) failure_ = outcome;
  changed_.notify_all();
}

void SlotGate::fail(const std::string& reason) {
  std::lock_guard lock(mu_);
  if (answered_ < expected_) {
    if (failure_.is_ok()) failure_ = transport_error(reason);
    answered_ = expected_;
  }
  changed_.notify_all();
}

Status SlotGate::wait_answers(std::unique_lock<std::mutex>& lock, const Deadline& deadline) {
  const bool done =
      changed_.wait_until(lock, deadline.time_point(), [this] { return answered_ >= expected_; });
  if (!done) {
    return timeout_error("layer " + std::to_string(layer_) + ": " +
                         std::to_string(expected_ - answered_) + " of " +
                         std::to_string(expected_) + " Decode endpoints have not answered");
  }
  return Status::ok();
}

Status SlotGate::settle(const Deadline& deadline) {
  std::unique_lock lock(mu_);
  RD2H_RETURN_IF_ERROR(wait_answers(lock, deadline));
  if (!failure_.is_ok() && !failure_raised_) {
    failure_raised_ = true;
    return Status(failure_.code(), "layer " + std::to_string(layer_) + ": " + failure_.message());
  }
  return Status::ok();
}

bool SlotGate::answered() const {
  std::lock_guard lock(mu_);
  return answered_ >= expected_;
}

uint64_t SlotGate::tag() const {
  std::lock_guard lock(mu_);
  return tag_;
}

}  // namespace rd2h::prefill
