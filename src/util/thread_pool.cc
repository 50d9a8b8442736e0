#include "util/thread_pool.h"

#include <algorithm>

namespace rd2h {

ThreadPool::ThreadPool(size_t max_threads) : max_(std::max<size_t>(1, max_threads)) {}

ThreadPool::~ThreadPool() {
  stop();
}

bool ThreadPool::try_run(std::function<void()>& job) {
  std::lock_guard lock(mu_);
  if (stopping_ || (jobs_.size() >= idle_ && threads_.size() >= max_)) return false;
  jobs_.push_back(std::move(job));
  grow();
  return true;
}

bool ThreadPool::run(std::function<void()> job) {
  std::lock_guard lock(mu_);
  if (stopping_) return false;
  jobs_.push_back(std::move(job));
  grow();
  return true;
}

void ThreadPool::grow() {
  if (jobs_.size() <= idle_) {
    cv_.notify_one();
    return;
  }
  if (threads_.size() < max_) {
    threads_.emplace_back([this] { work(); });
  }
  // Else the job waits for the first thread that finishes one.
}

void ThreadPool::work() {
  std::unique_lock lock(mu_);
  for (;;) {
    ++idle_;
    cv_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
    --idle_;
    if (jobs_.empty()) return;  // stopping, and nothing left to run
    auto job = std::move(jobs_.front());
    jobs_.pop_front();
    lock.unlock();
    job();
    job = nullptr;  // what the job holds goes before the thread waits again
    lock.lock();
  }
}

void ThreadPool::stop() {
  std::vector<std::thread> threads;
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    threads.swap(threads_);
  }
  cv_.notify_all();
  for (auto& t : threads) t.join();
}

size_t ThreadPool::threads() const {
  std::lock_guard lock(mu_);
  return threads_.size();
}

size_t ThreadPool::idle() const {
  std::lock_guard lock(mu_);
  return idle_;
}

}  // namespace rd2h
