// Completion of a layer's KV write on Prefill (spec "Layer transfer": Prefill records an
// event after the layer's KV scatter and the sender waits for it before publishing the
// layer). On an accelerator this wraps a device event; HostWriteEvent serves host engines
// whose compute thread signals when its write is done.
#pragma once

#include <condition_variable>
#include <mutex>
#include <string>

#include "rd2h/common/deadline.h"
#include "rd2h/common/status.h"

namespace rd2h::prefill {

class WriteEvent {
 public:
  virtual ~WriteEvent() = default;
  // Returns once the write is complete, or an error (the write failed, or the deadline).
  virtual Status wait(const Deadline& deadline) = 0;
};

class HostWriteEvent final : public WriteEvent {
 public:
  // The write finished (ok) or failed with `status`; waiters wake.
  void complete(Status status = Status::ok()) {
    std::lock_guard lock(mu_);
    done_ = true;
    status_ = std::move(status);
    cv_.notify_all();
  }
  Status wait(const Deadline& deadline) override {
    std::unique_lock lock(mu_);
    if (!cv_.wait_until(lock, deadline.time_point(), [this] { return done_; })) {
      return timeout_error("the layer's KV write did not complete in time");
    }
    return status_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  Status status_;
};

}  // namespace rd2h::prefill
