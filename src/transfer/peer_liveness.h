// Host identity and process liveness for co-located peers. UCX's shared-memory transports
// cannot report a dead peer (they do not support peer error handling), so a session with a
// peer on this host watches the peer's process through a pidfd instead.
#pragma once

#include <cstdint>
#include <string>

#include "rd2h/common/status.h"
#include "util/unique_fd.h"

namespace rd2h::transfer {

// What makes two processes co-located: same kernel boot and same pid namespace.
struct HostIdentity {
  std::string boot_id;
  uint64_t pid_namespace = 0;
  int32_t pid = 0;
  uint64_t start_time = 0;  // the process start time in clock ticks since boot (pid reuse guard)

  static HostIdentity of_this_process();
  bool same_host_as(const HostIdentity& other) const {
    return !boot_id.empty() && boot_id == other.boot_id && pid_namespace == other.pid_namespace;
  }
};

// Start time of `pid` from /proc, or 0 when the process does not exist.
uint64_t process_start_time(int32_t pid);

// Watches one process. Owns its pidfd.
class ProcessWatch {
 public:
  ProcessWatch() = default;
  // Fails when the process is gone or its pid now names another process.
  static Expected<ProcessWatch> open(int32_t pid, uint64_t start_time);

  bool valid() const { return fd_.valid(); }
  // True once the watched process has exited. Never blocks.
  bool exited() const;

 private:
  explicit ProcessWatch(int fd) : fd_(fd) {}
  UniqueFd fd_;
};

}  // namespace rd2h::transfer
