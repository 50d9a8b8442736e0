#include "transfer/peer_liveness.h"

#include <poll.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

namespace rd2h::transfer {

namespace {

std::string read_boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

uint64_t read_pid_namespace() {
  struct stat st {};
  if (::stat("/proc/self/ns/pid", &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_ino);
}

}  // namespace

uint64_t process_start_time(int32_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return 0;
  // The command name (field 2) may hold spaces and parentheses: fields resume after the last ')'.
  auto close = line.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream rest(line.substr(close + 1));
  std::string field;
  // Field 3 is the state; the start time is field 22.
  for (int i = 3; i <= 22; ++i) {
    if (!(rest >> field)) return 0;
  }
  return std::stoull(field);
}

HostIdentity HostIdentity::of_this_process() {
  HostIdentity id;
  id.boot_id = read_boot_id();
  id.pid_namespace = read_pid_namespace();
  id.pid = static_cast<int32_t>(::getpid());
  id.start_time = process_start_time(id.pid);
  return id;
}

Expected<ProcessWatch> ProcessWatch::open(int32_t pid, uint64_t start_time) {
  int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (fd < 0) {
    return peer_dead("peer process " + std::to_string(pid) + " is not running");
  }
  ProcessWatch watch(fd);
  // Checked after the pidfd is open, so the pid cannot be recycled between check and open.
  if (process_start_time(pid) != start_time) {
    return peer_dead("peer process " + std::to_string(pid) +
                     " has exited (its pid now names another process)");
  }
  return watch;
}

bool ProcessWatch::exited() const {
  if (!fd_.valid()) return false;
  pollfd p{fd_.get(), POLLIN, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR)) != 0;
}

}  // namespace rd2h::transfer
