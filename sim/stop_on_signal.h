// How `rd2h demo` stops on SIGINT or SIGTERM: every process it started gets SIGTERM, so the
// run fails at once and the demo cleans up and returns; past a bound, those processes are
// killed and the demo exits.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <mutex>
#include <thread>

namespace rd2h::sim {

class StopOnSignal {
 public:
  // Blocks SIGINT and SIGTERM in this thread and the threads it starts from now on: make
  // it before any other thread.
  explicit StopOnSignal(std::chrono::seconds bound);
  ~StopOnSignal();
  StopOnSignal(const StopOnSignal&) = delete;
  StopOnSignal& operator=(const StopOnSignal&) = delete;

  int signal() const { return signal_.load(); }  // 0 until one arrived

 private:
  void run();

  const std::chrono::seconds bound_;
  sigset_t set_;
  sigset_t previous_;
  std::atomic<int> signal_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace rd2h::sim
