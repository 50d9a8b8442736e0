#include "util/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "rd2h/common/deadline.h"

extern char** environ;

namespace rd2h {

namespace {
constexpr const char* kDieWithParent = "RD2H_DIE_WITH_PARENT";
}  // namespace

bool die_with_parent_if_asked() {
  if (std::getenv(kDieWithParent) == nullptr) return true;
  ::unsetenv(kDieWithParent);  // for this process only, not its own children
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  return ::getppid() != 1;  // reparented: the parent died before the request was made
}

namespace {

// The pipes a child is started with: the child's ends, closed here once it started, and
// this process's.
struct ChildPipes {
  UniqueFd stdin_read;    // the child's stdin
  UniqueFd stdin_write;   // this process writes it
  UniqueFd stdout_read;   // this process reads the child's stdout (none when inherited)
  UniqueFd stdout_write;  // the child's stdout (none when inherited)
};

// A child's stdin pipe, and its stdout pipe if `pipe_stdout`.
Expected<ChildPipes> open_child_pipes(bool pipe_stdout) {
  ChildPipes pipes;
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return internal_error("pipe2 failed");
  pipes.stdin_read.reset(fds[0]);
  pipes.stdin_write.reset(fds[1]);
  if (pipe_stdout) {
    if (::pipe2(fds, O_CLOEXEC) != 0) return internal_error("pipe2 failed");
    pipes.stdout_read.reset(fds[0]);
    pipes.stdout_write.reset(fds[1]);
  }
  return pipes;
}

// `strings` as exec takes them: pointers into them, then a null.
std::vector<char*> c_strings(const std::vector<std::string>& strings) {
  std::vector<char*> out;
  out.reserve(strings.size() + 1);
  for (const auto& s : strings) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

// The variables the child gets besides this process's: the extra ones, and the request
// to die with its parent if asked.
std::vector<std::string> own_environment(const Subprocess::Options& options) {
  std::vector<std::string> own = options.extra_env;
  if (options.die_with_parent) own.push_back(std::string(kDieWithParent) + "=1");
  return own;
}

// The child's environment: `own`, then this process's variables that `own` does not
// override; pointers into both, then a null.
std::vector<char*> child_environment(const std::vector<std::string>& own) {
  std::vector<char*> env;
  for (const auto& e : own) env.push_back(const_cast<char*>(e.c_str()));
  for (char** e = environ; *e != nullptr; ++e) {
    std::string_view var(*e);
    auto name = var.substr(0, var.find('=') + 1);
    bool overridden = std::any_of(own.begin(), own.end(),
                                  [&](const std::string& x) { return x.rfind(name, 0) == 0; });
    if (!overridden) env.push_back(*e);
  }
  env.push_back(nullptr);
  return env;
}

// Starts argv[0] with the pipes' child ends as its stdin (and stdout, and stderr if
// merged) and no signal blocked; posix_spawn's error number, 0 once it started.
int start_child(const std::vector<std::string>& argv, char* const* env, const ChildPipes& pipes,
                bool merge_stderr, pid_t& pid) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipes.stdin_read.get(), STDIN_FILENO);
  if (pipes.stdout_write.valid()) {
    posix_spawn_file_actions_adddup2(&actions, pipes.stdout_write.get(), STDOUT_FILENO);
  }
  if (merge_stderr) posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  // The child starts with no signal blocked, whatever this thread blocks (a server blocks
  // SIGINT and SIGTERM to wait for them).
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
  const std::vector<char*> args = c_strings(argv);
  const int rc = ::posix_spawn(&pid, argv[0].c_str(), &actions, &attr, args.data(), env);
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&actions);
  return rc;
}

}  // namespace

Expected<Subprocess> Subprocess::spawn(const std::vector<std::string>& argv,
                                       const Options& options) {
  if (argv.empty()) return invalid_argument("spawn: empty argv");
  RD2H_TRY(pipes, open_child_pipes(!options.inherit_stdout));
  const std::vector<std::string> own_env = own_environment(options);
  const std::vector<char*> env = child_environment(own_env);
  pid_t pid = -1;
  const int rc = start_child(argv, env.data(), pipes, options.merge_stderr, pid);
  pipes.stdin_read.reset();  // the child's ends are the child's
  pipes.stdout_write.reset();
  if (rc != 0) return internal_error("cannot start " + argv[0] + ": " + std::strerror(rc));
  Subprocess p;
  p.pid_ = pid;
  p.stdin_fd_ = std::move(pipes.stdin_write);
  p.stdout_fd_ = std::move(pipes.stdout_read);
  // The child is not reaped before this, so its pid cannot name another process yet.
  p.pidfd_.reset(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
  if (!p.pidfd_.valid()) {
    return internal_error("cannot watch " + argv[0] + " (pidfd_open): " + std::strerror(errno));
  }
  return p;
}

Subprocess::Subprocess(Subprocess&& other) noexcept {
  *this = std::move(other);
}

Subprocess& Subprocess::operator=(Subprocess&& other) noexcept {
  if (this != &other) {
    reset();
    pid_ = std::exchange(other.pid_, -1);
    pidfd_ = std::move(other.pidfd_);
    stdin_fd_ = std::move(other.stdin_fd_);
    stdout_fd_ = std::move(other.stdout_fd_);
    buffered_ = std::move(other.buffered_);
    exit_status_ = std::exchange(other.exit_status_, std::nullopt);
  }
  return *this;
}

Subprocess::~Subprocess() {
  reset();
}

void Subprocess::reset() {
  if (pid_ > 0 && !exit_status_) {
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);  // SIGKILL cannot be ignored: this returns promptly
  }
  stdin_fd_.reset();
  stdout_fd_.reset();
  pid_ = -1;
  pidfd_.reset();
  exit_status_.reset();
}

Expected<bool> Subprocess::read_more(const Deadline& deadline) {
  if (!stdout_fd_.valid()) return failed_precondition("child stdout is not piped");
  for (;;) {
    pollfd p{stdout_fd_.get(), POLLIN, 0};
    int r = ::poll(&p, 1, deadline.remaining_ms());
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) return timeout_error("child " + std::to_string(pid_) + " wrote nothing in time");
    char buf[4096];
    ssize_t n = ::read(stdout_fd_.get(), buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    buffered_.append(buf, static_cast<size_t>(n));
    return true;
  }
}

Expected<std::string> Subprocess::read_line(std::chrono::milliseconds timeout) {
  Deadline deadline(timeout);
  for (;;) {
    auto nl = buffered_.find('\n');
    if (nl != std::string::npos) {
      std::string line = buffered_.substr(0, nl);
      buffered_.erase(0, nl + 1);
      return line;
    }
    RD2H_TRY(more, read_more(deadline));
    if (!more) return failed_precondition("child " + std::to_string(pid_) + " closed its output");
  }
}

Expected<std::string> Subprocess::read_all(std::chrono::milliseconds timeout) {
  Deadline deadline(timeout);
  for (;;) {
    RD2H_TRY(more, read_more(deadline));
    if (!more) return std::exchange(buffered_, {});
  }
}

Status Subprocess::write_line(const std::string& line) {
  if (!stdin_fd_.valid()) return failed_precondition("child stdin is closed");
  // A child that exited makes the write raise SIGPIPE, which would end this process: block
  // it for this thread and consume it if it came, so the write fails with EPIPE instead.
  sigset_t pipe_set, old_set;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_set, &old_set);
  std::string data = line + "\n";
  size_t done = 0;
  bool closed = false;
  while (done < data.size()) {
    ssize_t n = ::write(stdin_fd_.get(), data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      closed = true;
      break;
    }
    done += static_cast<size_t>(n);
  }
  if (closed) {
    const timespec none{0, 0};
    while (sigtimedwait(&pipe_set, nullptr, &none) == SIGPIPE) {
    }
  }
  pthread_sigmask(SIG_SETMASK, &old_set, nullptr);
  if (closed) return failed_precondition("child " + std::to_string(pid_) + " closed its input");
  return Status::ok();
}

void Subprocess::close_stdin() {
  stdin_fd_.reset();
}

void Subprocess::kill(int signal) {
  if (pid_ > 0 && !exit_status_) ::kill(pid_, signal);
}

Status Subprocess::stop(std::chrono::milliseconds timeout) {
  if (pid_ <= 0 || exit_status_) return failed_precondition("no running child");
  ::kill(pid_, SIGSTOP);
  Deadline deadline(timeout);
  // No fd reports that a process stopped (its pidfd only reports its exit): a short
  // back-off, bounded by the deadline.
  auto pause = std::chrono::microseconds(50);
  for (;;) {
    int status = 0;
    pid_t r = ::waitpid(pid_, &status, WUNTRACED | WNOHANG);
    if (r == pid_ && WIFSTOPPED(status)) return Status::ok();
    if (r == pid_) {
      exit_status_ = status;
      return failed_precondition("child " + std::to_string(pid_) + " exited instead of stopping");
    }
    if (deadline.expired()) {
      return timeout_error("child " + std::to_string(pid_) + " did not stop within " +
                           std::to_string(timeout.count()) + " ms");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(5000));
  }
}

Expected<int> Subprocess::wait(std::chrono::milliseconds timeout) {
  if (exit_status_) return *exit_status_;
  if (pid_ <= 0) return failed_precondition("no child");
  const Deadline deadline(timeout);
  for (;;) {
    int status = 0;
    pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      exit_status_ = status;
      return status;
    }
    if (r < 0 && errno != EINTR) return internal_error("waitpid failed");
    if (deadline.expired()) {
      return timeout_error("child " + std::to_string(pid_) + " did not exit within " +
                           std::to_string(timeout.count()) + " ms");
    }
    pollfd p{pidfd_.get(), POLLIN, 0};  // readable once it exited
    ::poll(&p, 1, deadline.remaining_ms());
  }
}

std::vector<pid_t> children_of(pid_t pid) {
  std::vector<pid_t> out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(entry.path() / "stat");
    std::string line;
    std::getline(stat, line);
    const size_t close = line.rfind(')');  // the command may hold spaces
    if (close == std::string::npos || close + 4 >= line.size()) continue;
    // ") S ppid ...": the state, then the parent
    if (std::strtol(line.c_str() + close + 4, nullptr, 10) == pid) out.push_back(std::stoi(name));
  }
  return out;
}

std::string self_executable() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return {};
  return std::string(buf, static_cast<size_t>(n));
}

}  // namespace rd2h
