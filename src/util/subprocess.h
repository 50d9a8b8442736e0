// Subprocess: a child process with pipes to its stdin and stdout, owned by RAII. The
// destructor kills and reaps a child that is still running, so no process outlives its owner.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "rd2h/common/deadline.h"
#include "rd2h/common/status.h"
#include "util/unique_fd.h"

namespace rd2h {

class Subprocess {
 public:
  struct Options {
    bool inherit_stdout = false;         // otherwise stdout is piped back to this process
    bool merge_stderr = false;           // stderr goes where stdout goes
    std::vector<std::string> extra_env;  // "NAME=value", overriding this process's environment
    // The child (an rd2h binary: see die_with_parent_if_asked) gets SIGTERM when the
    // thread that spawned it ends, so it cannot outlive this process. Spawn from a thread
    // that lives as long as the child should.
    bool die_with_parent = false;
  };
  // Starts argv[0] (a path) with `argv`.
  static Expected<Subprocess> spawn(const std::vector<std::string>& argv, const Options& options);
  static Expected<Subprocess> spawn(const std::vector<std::string>& argv) {
    return spawn(argv, Options{});
  }

  Subprocess(Subprocess&& other) noexcept;
  Subprocess& operator=(Subprocess&& other) noexcept;
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;
  ~Subprocess();

  pid_t pid() const { return pid_; }
  // The next line of the child's stdout, without the newline; an error on EOF or timeout.
  Expected<std::string> read_line(std::chrono::milliseconds timeout);
  // Everything the child writes to stdout until it closes it, bounded by `timeout`.
  Expected<std::string> read_all(std::chrono::milliseconds timeout);
  // Writes `line` and a newline to the child's stdin.
  Status write_line(const std::string& line);
  // Closes the child's stdin (the conventional "you may exit now").
  void close_stdin();
  void kill(int signal);
  // Sends SIGSTOP and returns once the child is stopped (signals are delivered
  // asynchronously, so kill() alone does not mean it has stopped yet).
  Status stop(std::chrono::milliseconds timeout);
  // The exit status (as from waitpid) once the child exits, or a timeout error.
  Expected<int> wait(std::chrono::milliseconds timeout);

 private:
  Subprocess() = default;
  void reset();
  // Appends what the child wrote next to buffered_; false at end of output.
  Expected<bool> read_more(const Deadline& deadline);

  pid_t pid_ = -1;
  UniqueFd pidfd_;      // readable once the child exits
  UniqueFd stdin_fd_;   // this process's end of the child's stdin
  UniqueFd stdout_fd_;  // this process's end of the child's stdout, if piped
  std::string buffered_;
  std::optional<int> exit_status_;
};

// In a child's environment: UCX installs no handler of error signals (SIGSEGV, SIGBUS, ...),
// so a fault ends the process instead of leaving it hung in UCX's handler. UCX reads it
// when its library loads, before main().
inline constexpr const char* kUcxErrorSignalsOff = "UCX_ERROR_SIGNALS=";

// In an rd2h process spawned with Options::die_with_parent: asks the kernel for SIGTERM
// when the parent dies, and returns false if it already has (the process should exit).
// The request is not passed on to this process's own children.
bool die_with_parent_if_asked();

// The path of the running executable.
std::string self_executable();

// The processes whose parent is `pid` now (from /proc).
std::vector<pid_t> children_of(pid_t pid);

}  // namespace rd2h
