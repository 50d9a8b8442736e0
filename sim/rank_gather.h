// The Decode TP group's all-gather when its ranks are separate processes: rank 0 binds, the
// others connect, and each round every rank gets every rank's terminal set in rank order.
// Rounds are numbered: a late message of a round a rank gave up on is dropped.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "rd2h/decode/all_gather.h"
#include "sim/ipc.h"

namespace rd2h::sim {

class RankGather {
 public:
  // Rank 0: binds on `host`, any free port (see url()).
  static Expected<std::unique_ptr<RankGather>> bind(int size, const std::string& host,
                                                    std::chrono::milliseconds timeout);
  // Rank 0: binds a Unix socket at `path` (in a private directory).
  static Expected<std::unique_ptr<RankGather>> bind_ipc(int size, const std::string& path,
                                                        std::chrono::milliseconds timeout);
  // Ranks 1..size-1: connect to rank 0's url.
  static Expected<std::unique_ptr<RankGather>> connect(int rank, int size, const std::string& url,
                                                       std::chrono::milliseconds timeout);

  decode::AllGather function() {
    return [this](const decode::RankTerminal& mine) { return gather(mine); };
  }
  const std::string& url() const { return url_; }

 private:
  RankGather(int rank, int size, std::chrono::milliseconds timeout)
      : rank_(rank), size_(size), timeout_(timeout) {}
  Expected<std::vector<decode::RankTerminal>> gather(const decode::RankTerminal& mine);

  int rank_, size_;
  std::chrono::milliseconds timeout_;
  uint64_t round_ = 0;
  std::string url_;
  std::optional<IpcRouter> router_;  // rank 0
  std::optional<IpcDealer> dealer_;  // the others
};

}  // namespace rd2h::sim
