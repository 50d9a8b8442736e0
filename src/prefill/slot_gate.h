// Physical-storage completion on Prefill (spec "Correctness Invariants"): one gate per physical
// main or indexer slot, which may be overwritten only once every Decode told about its owner
// answered; an older owner's late answer never releases it. Waits are bounded. Thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>

#include "rd2h/common/deadline.h"
#include "rd2h/common/status.h"

namespace rd2h::prefill {

class SlotGate {
 public:
  // `layer_idx` now owns the slot and told `endpoints` Decode endpoints it is ready.
  // Returns the generation its answers must carry. Zero endpoints: the gate stays open.
  // `tag` travels with the generation (the worker's step), for whoever settles it.
  uint64_t open(int64_t layer_idx, size_t endpoints, uint64_t tag = 0);

  // One endpoint's answer: ok (READ_DONE), or the failure with its kind (a READ_FAILED is
  // kTransport; a dead Decode kPeerDead; no answer in time kTimeout). Answers for a
  // generation other than the current one, or beyond the expected count, are ignored.
  void answer(uint64_t generation, const Status& outcome);
  void answer(uint64_t generation, bool ok, const std::string& reason = {}) {
    answer(generation, ok ? Status::ok() : transport_error(reason.empty() ? "read failed" : reason));
  }

  // Every pending generation fails with `reason` (the sender thread died, the peer is gone).
  void fail(const std::string& reason);

  // The reuse gate, before a new owner opens the slot: returns once the current generation
  // has all its answers, or a timeout error naming the layer and the missing answers. A
  // failure among the answers (with its layer and reason) is returned once, to the first
  // caller after it came, so the compute path raises each failure once and the slot is
  // free afterwards.
  Status settle(const Deadline& deadline);

  // Whether the current generation has all its answers (settle() returns at once).
  bool answered() const;

  uint64_t tag() const;  // of the current generation

 private:
  Status wait_answers(std::unique_lock<std::mutex>& lock, const Deadline& deadline);

  mutable std::mutex mu_;
  std::condition_variable changed_;
  uint64_t generation_ = 0;
  int64_t layer_ = -1;
  uint64_t tag_ = 0;
  size_t expected_ = 0;
  size_t answered_ = 0;
  Status failure_;  // first failure of the current generation
  bool failure_raised_ = false;
};

// An answer owed to one generation of one gate.
struct GateTicket {
  SlotGate* gate = nullptr;
  uint64_t generation = 0;
};

}  // namespace rd2h::prefill
