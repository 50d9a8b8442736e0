// ThreadPool: threads started on demand up to a bound, reused once idle, all joined at stop().
// The project's one pool. try_run refuses work when every thread is busy; run queues it.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace rd2h {

class ThreadPool {
 public:
  explicit ThreadPool(size_t max_threads);
  ~ThreadPool();  // stop()
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Runs `job` on an idle thread, or on a new one while fewer than the bound run. False,
  // and `job` untouched, when every thread is busy or the pool stopped.
  bool try_run(std::function<void()>& job);
  // Runs `job` as soon as a thread is free (queued meanwhile, in order). False once the pool
  // stopped.
  bool run(std::function<void()> job);
  // Takes no more jobs, lets every queued one run, and joins every thread. A job must end
  // on its own (its owner stops what it waits on first). Idempotent.
  void stop();

  size_t threads() const;  // started, not yet joined
  size_t idle() const;     // of those, the ones waiting for a job

 private:
  // Starts a thread if none is idle for the queue's jobs and the bound allows. mu_ held.
  void grow();
  void work();

  const size_t max_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  // Unbounded here: each user bounds what it submits (the proxy's dispatches by its
  // max_concurrent client requests, the metaserver client's posts by the requests it
  // registered, each cancelled with its request).
  std::deque<std::function<void()>> jobs_;
  size_t idle_ = 0;  // threads waiting for a job
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace rd2h
