// The engine core's side of its TP rank processes: spawns one `rd2h worker` per rank,
// connected to a ROUTER the core binds, and sends each rank one job at a time. A rank that
// dies or does not answer in time is an error naming it; stop() ends them all.
#pragma once

#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "sim/ipc.h"
#include "util/subprocess.h"
#include "util/unique_fd.h"

namespace rd2h::sim {

class RankSet {
 public:
  static Expected<std::unique_ptr<RankSet>> start(const std::string& executable, int size,
                                                  std::chrono::milliseconds timeout);
  ~RankSet();  // stop() with a short bound

  // Sends jobs[k] to rank k (none when it is null) and returns the answers in rank order.
  // Timeline events in the answers go to this process's recorder.
  Expected<std::vector<nlohmann::json>> call(const std::vector<nlohmann::json>& jobs,
                                             std::chrono::milliseconds timeout);
  Expected<std::vector<nlohmann::json>> call_all(const nlohmann::json& job,
                                                 std::chrono::milliseconds timeout) {
    return call(std::vector<nlohmann::json>(ranks_.size(), job), timeout);
  }
  // Asks every rank to shut its worker down and exit; kills what is left at the deadline.
  void stop(std::chrono::milliseconds timeout);

  size_t size() const { return ranks_.size(); }
  // Why a rank process is gone (the lowest such rank), if one is; never waits.
  std::optional<std::string> any_exited();
  // The private directory (mode 0700) holding the set's Unix sockets; removed with the set,
  // or (the core killed) by the next engine core that starts.
  const std::string& ipc_dir() const { return ipc_dir_; }
  // Answers that came after their job's deadline, since the last call (their verification
  // results still count).
  std::vector<nlohmann::json> take_late() { return std::exchange(late_, {}); }

 private:
  struct RankProcess {
    Subprocess process;
    std::string identity;
  };
  RankSet() = default;
  // Why rank k is gone, if it is (or is within `wait`).
  std::optional<std::string> exited(size_t k,
                                    std::chrono::milliseconds wait = std::chrono::milliseconds(0));

  std::string ipc_dir_;
  UniqueFd owner_lock_;  // held while this core lives: its directory is not abandoned
  std::optional<IpcRouter> router_;
  std::vector<RankProcess> ranks_;
  bool stopped_ = false;
  uint64_t seq_ = 0;  // jobs sent; every answer names the job it answers
  std::vector<nlohmann::json> late_;
};

}  // namespace rd2h::sim
