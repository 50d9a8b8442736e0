// How the rd2h servers stop: SIGINT and SIGTERM are blocked in every thread (call this
// before starting any), and the main thread waits for one of them.
#pragma once

#include <csignal>

namespace rd2h::tools {

class StopSignal {
 public:
  StopSignal() {
    sigemptyset(&set_);
    sigaddset(&set_, SIGINT);
    sigaddset(&set_, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set_, nullptr);
  }
  // Returns the signal that arrived.
  int wait() {
    int signal = 0;
    sigwait(&set_, &signal);
    return signal;
  }

 private:
  sigset_t set_;
};

}  // namespace rd2h::tools
