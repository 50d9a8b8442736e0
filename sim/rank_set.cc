#include "sim/rank_set.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "rd2h/common/deadline.h"
#include "rd2h/common/trace.h"
#include "sim/sim_message.h"

namespace rd2h::sim {
namespace {

using nlohmann::json;
constexpr std::chrono::milliseconds kPollSlice{100};

std::chrono::milliseconds slice(const Deadline& d) {
  return std::min(kPollSlice, std::chrono::milliseconds(d.remaining_ms()));
}

// Each engine core holds an exclusive lock on this file in its private directory for as
// long as it lives; the kernel drops it when the core dies, however it dies.
constexpr const char* kOwnerFile = "owner";
constexpr const char* kDirPrefix = "rd2h-sim-";
// A directory whose lock is free is left alone this long after it last changed: its
// engine may be starting (between creating the directory and locking it).
constexpr std::chrono::seconds kAbandonedAfter{10};

// Removes the private directories that engine cores of this user left behind when they
// were killed (SIGKILL leaves no chance to clean up): those whose owner lock is free.
void remove_abandoned_dirs(const std::filesystem::path& parent) {
  namespace fs = std::filesystem;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(parent, ec)) {
    const std::string name = entry.path().filename();
    if (name.rfind(kDirPrefix, 0) != 0) continue;
    struct stat st {};
    if (::lstat(entry.path().c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != getuid()) {
      continue;
    }
    const auto changed = std::chrono::system_clock::from_time_t(st.st_mtime);
    if (std::chrono::system_clock::now() - changed < kAbandonedAfter) continue;
    const UniqueFd lock(::open((entry.path() / kOwnerFile).c_str(), O_RDONLY | O_CLOEXEC));
    if (lock.valid() && ::flock(lock.get(), LOCK_EX | LOCK_NB) != 0) continue;  // its core lives
    std::error_code ignored;
    fs::remove_all(entry.path(), ignored);
  }
}

}  // namespace

Expected<std::unique_ptr<RankSet>> RankSet::start(const std::string& executable, int size,
                                                  std::chrono::milliseconds timeout) {
  std::unique_ptr<RankSet> set(new RankSet());
  // The core and its ranks talk over Unix sockets in a directory only this user can enter
  // (mkdtemp makes it 0700), not over TCP where any local process could connect.
  remove_abandoned_dirs("/tmp");
  std::string dir = std::string("/tmp/") + kDirPrefix + "XXXXXX";
  if (::mkdtemp(dir.data()) == nullptr) {
    return internal_error("engine core: cannot create a private directory under /tmp: " +
                          std::string(std::strerror(errno)));
  }
  set->ipc_dir_ = dir;
  set->owner_lock_.reset(
      ::open((dir + "/" + kOwnerFile).c_str(), O_CREAT | O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!set->owner_lock_.valid() || ::flock(set->owner_lock_.get(), LOCK_EX | LOCK_NB) != 0) {
    return internal_error("engine core: cannot lock " + dir + "/" + kOwnerFile + ": " +
                          std::strerror(errno));
  }
  auto router = IpcRouter::bind("ipc://" + dir + "/core");
  if (!router) return router.status().with_context("engine core");
  set->router_ = std::move(*router);
  Subprocess::Options options;
  options.inherit_stdout = true;
  // A rank that faults must die, so that this core sees it gone: UCX's own handlers of
  // SIGSEGV and the like (installed when its library loads) can leave the process hung.
  options.extra_env = {std::string(kUcxErrorSignalsOff)};
  for (int k = 0; k < size; ++k) {
    auto p = Subprocess::spawn({executable, "worker", "--core", set->router_->url(), "--rank",
                                std::to_string(k), "--core-pid", std::to_string(getpid())},
                               options);
    if (!p) return p.status().with_context("starting TP rank " + std::to_string(k));
    set->ranks_.push_back({std::move(*p), {}});
  }
  const Deadline deadline(timeout);
  size_t joined = 0;
  while (joined < set->ranks_.size()) {
    for (size_t k = 0; k < set->ranks_.size(); ++k) {
      if (auto why = set->exited(k)) return internal_error(*why);
    }
    if (deadline.expired()) {
      return timeout_error(std::to_string(set->ranks_.size() - joined) + " of " +
                           std::to_string(size) + " TP rank processes did not start in time");
    }
    RD2H_TRY(in, set->router_->receive(slice(deadline)));
    if (!in.has_value()) continue;
    const json hello = unpack(in->payload);
    const int k = hello.is_object() ? hello.value("hello", -1) : -1;
    if (k < 0 || k >= size || !set->ranks_[static_cast<size_t>(k)].identity.empty()) continue;
    set->ranks_[static_cast<size_t>(k)].identity = in->identity;
    ++joined;
  }
  return set;
}

RankSet::~RankSet() {
  stop(std::chrono::seconds(10));
  router_.reset();
  if (!ipc_dir_.empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(ipc_dir_, ignored);
  }
}

std::optional<std::string> RankSet::exited(size_t k, std::chrono::milliseconds wait) {
  auto status = ranks_[k].process.wait(wait);
  if (!status) return std::nullopt;
  const int s = *status;
  return "TP rank " + std::to_string(k) + " (pid " + std::to_string(ranks_[k].process.pid()) +
         ") " +
         (WIFSIGNALED(s) ? "was killed by signal " + std::to_string(WTERMSIG(s))
                         : "exited with status " + std::to_string(WEXITSTATUS(s)));
}

std::optional<std::string> RankSet::any_exited() {
  for (size_t k = 0; k < ranks_.size(); ++k) {
    if (auto why = exited(k)) return why;
  }
  return std::nullopt;
}

Expected<std::vector<json>> RankSet::call(const std::vector<json>& jobs,
                                          std::chrono::milliseconds timeout) {
  if (stopped_) return failed_precondition("the TP rank processes are stopped");
  std::vector<json> replies(ranks_.size());
  std::vector<bool> answered(ranks_.size(), true);
  size_t missing = 0;
  const uint64_t seq = ++seq_;
  for (size_t k = 0; k < ranks_.size(); ++k) {
    if (jobs[k].is_null()) continue;
    json job = jobs[k];
    job["seq"] = seq;
    if (Status st = router_->send(ranks_[k].identity, pack(job)); !st) {
      // A rank that is gone is named with how it ended, as when it dies mid-job.
      if (auto why = exited(k, std::chrono::milliseconds(500))) return internal_error(*why);
      return st.with_context("sending a job to TP rank " + std::to_string(k));
    }
    answered[k] = false;
    ++missing;
  }
  const Deadline deadline(timeout);
  while (missing > 0) {
    if (deadline.expired()) {
      for (size_t k = 0; k < ranks_.size(); ++k) {
        if (!answered[k]) {
          return timeout_error("TP rank " + std::to_string(k) + " did not answer its '" +
                               jobs[k].value("op", "") + "' job in time");
        }
      }
    }
    RD2H_TRY(in, router_->receive(slice(deadline)));
    if (!in.has_value()) {
      for (size_t k = 0; k < ranks_.size(); ++k) {
        if (auto why = exited(k); why && !answered[k]) return internal_error(*why);
      }
      continue;
    }
    for (size_t k = 0; k < ranks_.size(); ++k) {
      if (answered[k] || ranks_[k].identity != in->identity) continue;
      json reply = unpack(in->payload);
      if (!reply.is_object()) {
        return internal_error("TP rank " + std::to_string(k) + " answered with a malformed reply");
      }
      if (trace::enabled()) {
        for (auto& e : events_from_json(reply["events"])) trace::record(std::move(e));
      }
      reply.erase("events");
      // An answer to a job this core gave up on (a timeout): its news is taken, the rank
      // is still owed an answer to this one.
      if (reply.value("seq", uint64_t{0}) != seq) {
        late_.push_back(std::move(reply));
        continue;
      }
      replies[k] = std::move(reply);
      answered[k] = true;
      --missing;
    }
  }
  return replies;
}

void RankSet::stop(std::chrono::milliseconds timeout) {
  if (stopped_) return;
  stopped_ = true;
  for (auto& r : ranks_) {
    if (!r.identity.empty()) (void)router_->send(r.identity, pack({{"op", "stop"}}));
  }
  const Deadline deadline(timeout);
  for (auto& r : ranks_) {
    if (!r.process.wait(std::chrono::milliseconds(deadline.remaining_ms()))) {
      r.process.kill(SIGKILL);
      (void)r.process.wait(std::chrono::seconds(5));
    }
  }
}

}  // namespace rd2h::sim
