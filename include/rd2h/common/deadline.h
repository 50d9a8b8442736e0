// Deadline: the one way rd2h bounds a wait. Built from a timeout, queried for what is left.
#pragma once

#include <chrono>

namespace rd2h {

class Deadline {
 public:
  using Clock = std::chrono::steady_clock;

  explicit Deadline(std::chrono::nanoseconds timeout) : at_(Clock::now() + timeout) {}
  static Deadline at(Clock::time_point t) {
    Deadline d(std::chrono::nanoseconds(0));
    d.at_ = t;
    return d;
  }

  bool expired() const { return Clock::now() >= at_; }
  std::chrono::nanoseconds remaining() const {
    auto left = at_ - Clock::now();
    return left.count() > 0 ? std::chrono::duration_cast<std::chrono::nanoseconds>(left)
                            : std::chrono::nanoseconds(0);
  }
  // Remaining time in whole milliseconds, rounded up so a poll never spins at 0 too early.
  int remaining_ms() const {
    auto ns = remaining().count();
    return static_cast<int>((ns + 999'999) / 1'000'000);
  }
  Clock::time_point time_point() const { return at_; }

 private:
  Clock::time_point at_;
};

}  // namespace rd2h
