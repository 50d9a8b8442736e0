#include "sim/stop_on_signal.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <ctime>

#include "util/subprocess.h"

namespace rd2h::sim {

StopOnSignal::StopOnSignal(std::chrono::seconds bound) : bound_(bound) {
  sigemptyset(&set_);
  sigaddset(&set_, SIGINT);
  sigaddset(&set_, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set_, &previous_);
  thread_ = std::thread([this] { run(); });
}

StopOnSignal::~StopOnSignal() {
  {
    std::lock_guard lock(mu_);
    done_ = true;
  }
  cv_.notify_all();
  thread_.join();
  pthread_sigmask(SIG_SETMASK, &previous_, nullptr);
}

void StopOnSignal::run() {
  const timespec look{0, 200 * 1000 * 1000};
  int s = -1;
  for (;;) {
    {
      std::lock_guard lock(mu_);
      if (done_) return;
    }
    s = sigtimedwait(&set_, nullptr, &look);  // bounded, so the destructor is seen
    if (s > 0) break;
  }
  signal_.store(s);
  std::fprintf(stderr, "rd2h demo: signal %d: stopping every process of the run\n", s);
  for (pid_t child : children_of(::getpid())) ::kill(child, SIGTERM);
  std::unique_lock lock(mu_);
  if (cv_.wait_for(lock, bound_, [this] { return done_; })) return;
  std::fprintf(stderr, "rd2h demo: the run did not stop within %lld s of signal %d; killing it\n",
               static_cast<long long>(bound_.count()), s);
  for (pid_t child : children_of(::getpid())) ::kill(child, SIGKILL);
  std::_Exit(128 + s);
}

}  // namespace rd2h::sim
