// The Decode TP group's all-gather when its ranks are threads of one process: every rank
// calls its function with its terminal set and gets every rank's, in rank order, once all
// ranks called (or a timeout error). Ranks in separate processes need a real collective.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <vector>

#include "rd2h/decode/all_gather.h"

namespace rd2h::decode {

class LocalAllGather {
 public:
  explicit LocalAllGather(int size, std::chrono::milliseconds timeout = std::chrono::seconds(30))
      : size_(size), timeout_(timeout), current_(static_cast<size_t>(size)) {}

  AllGather for_rank(int rank) {
    return [this, rank](const RankTerminal& mine) { return gather(rank, mine); };
  }

 private:
  Expected<std::vector<RankTerminal>> gather(int rank, const RankTerminal& mine) {
    std::unique_lock lock(mu_);
    current_[static_cast<size_t>(rank)] = mine;
    const uint64_t round = round_;
    if (++arrived_ == size_) {
      result_ = current_;
      arrived_ = 0;
      ++round_;
      cv_.notify_all();
      return result_;
    }
    if (!cv_.wait_for(lock, timeout_, [&] { return round_ != round; })) {
      --arrived_;
      return timeout_error("rank " + std::to_string(rank) + ": the other " +
                           std::to_string(size_ - 1) + " Decode ranks did not gather in time");
    }
    return result_;
  }

  int size_;
  std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t round_ = 0;
  int arrived_ = 0;
  std::vector<RankTerminal> current_, result_;
};

}  // namespace rd2h::decode
