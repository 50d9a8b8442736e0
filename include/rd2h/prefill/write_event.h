// Completion of a layer's KV write on Prefill (spec "Layer transfer"): the sender publishes a
// layer only once its event completed. On an accelerator it wraps a device event;
// HostWriteEvent serves hosts whose compute thread signals when its write is done.
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "rd2h/common/deadline.h"
#include "rd2h/common/status.h"

namespace rd2h::prefill {

class WriteEvent {
 public:
  virtual ~WriteEvent() = default;
  // Returns once the write is complete, or an error (the write failed, or the deadline).
  virtual Status wait(const Deadline& deadline) = 0;
  // Calls `done` once, when the write completed or failed (at once if it has; from any
  // thread; `done` must not block), and returns true; false if this event cannot tell,
  // and its waiter then blocks in wait(). The sender, told, serves Decode's answers while
  // the write runs.
  virtual bool notify(std::function<void()> done) {
    (void)done;
    return false;
  }
};

class HostWriteEvent final : public WriteEvent {
 public:
  // The write finished (ok) or failed with `status`; waiters wake.
  void complete(Status status = Status::ok()) {
    std::vector<std::function<void()>> done;
    {
      std::lock_guard lock(mu_);
      if (done_) return;  // completed once
      done_ = true;
      status_ = std::move(status);
      cv_.notify_all();
      done.swap(on_done_);
    }
    for (auto& f : done) f();
  }
  bool notify(std::function<void()> done) override {
    {
      std::lock_guard lock(mu_);
      if (!done_) {
        on_done_.push_back(std::move(done));
        return true;
      }
    }
    done();
    return true;
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
  std::vector<std::function<void()>> on_done_;
};

}  // namespace rd2h::prefill
