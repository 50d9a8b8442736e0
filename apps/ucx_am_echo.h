// A floor for a control path on the data plane's own transport: round trips of a
// readiness-sized UCX active message between two UCX contexts of this process, an echo
// thread answering each. Both ends sleep on their worker's event fd between messages (as a
// reader or a waiting compute thread would), so each hop costs a wake-up, as ZeroMQ's do.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "rd2h/common/status.h"

namespace rd2h::tools {

class UcxAmEcho {
 public:
  // `tls` is the UCX transport list (UCX_TLS), e.g. "shm" or "tcp".
  static Expected<std::unique_ptr<UcxAmEcho>> start(const std::string& tls);
  ~UcxAmEcho();
  UcxAmEcho(const UcxAmEcho&) = delete;
  UcxAmEcho& operator=(const UcxAmEcho&) = delete;

  // Appends `count` round trips in microseconds to `out`; an error if one does not come
  // back within a second.
  Status measure(uint32_t count, std::vector<double>& out);

  struct Side;

 private:
  UcxAmEcho();
  void echo_loop();
  std::unique_ptr<Side> client_, echo_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace rd2h::tools
