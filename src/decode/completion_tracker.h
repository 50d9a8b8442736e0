// Every request's state on one Decode rank (spec "Request completion"): its destinations and
// deadline, the connections its KV came on, and its completion, reached once every Prefill
// contributor reported its final layer and every Decode TP rank is terminal. Not thread-safe.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "rd2h/common/status.h"
#include "rd2h/decode/all_gather.h"

namespace rd2h::decode {

struct Finished {
  std::vector<std::string> finished;  // internal ids ready to be scheduled
  std::vector<std::string> failed;    // internal ids whose blocks are invalid
  // The destination blocks of the failed requests (filled by the reader, which knows them):
  // what they hold must not be used.
  std::vector<int64_t> invalid_main_blocks;
  std::vector<int64_t> invalid_indexer_blocks;
  // The destination blocks of the finished requests (filled by the reader): what a host
  // that stages KV through host buffers copies to the device before it uses them.
  std::vector<int64_t> loaded_main_blocks;
  std::vector<int64_t> loaded_indexer_blocks;
  // The external ids of everything above (filled by the reader).
  std::vector<std::string> ended_ext_ids;
};

// Where a request's KV lands on this rank, and until when it may arrive.
struct Destinations {
  std::vector<int64_t> main;
  std::vector<int64_t> indexer;
  std::chrono::steady_clock::time_point arrival_deadline =
      std::chrono::steady_clock::time_point::max();
};

class CompletionTracker {
 public:
  // Signals for requests not yet known are kept, up to `max_early` requests, until the
  // request is added. How many contributors report a request comes with its signals (the
  // readiness's tp_ratio), so one Decode serves Prefill instances of different TP sizes.
  explicit CompletionTracker(size_t max_early = 4096);

  // Decode's scheduler expects `ext_id` from Prefill; `internal_id` is its own name for it.
  // The tracker is the one owner of the request's state on this rank: its completion, and
  // its destinations with their arrival deadline.
  Status add_request(const std::string& ext_id, const std::string& internal_id,
                     Destinations destinations = {});
  // Decode gave up on the request: its state is dropped and later signals are ignored. It is
  // reported finished by the first finish() after every read in flight now ended (its
  // blocks may be being written). Returns its internal id if it was tracked.
  std::optional<std::string> remove_request(const std::string& ext_id);
  // The destinations of a tracked request, or null.
  const Destinations* destinations(const std::string& ext_id) const;

  // A batched read into Decode's blocks starts (its number), or ends; read_into() names a
  // request whose blocks it writes. A request that fails while such a read is in flight is
  // reported (its blocks handed back) only once that read ended.
  uint64_t read_started();
  void read_ended(uint64_t read);
  void read_into(const std::string& ext_id, uint64_t read);
  // A layer of `ext_id` from contributor `group_member_idx` was read (or its final layer
  // signalled) on `connection`; with `owes`, the connection now owes the request's final
  // layer or commit. A contributor seen on a second connection fails the request (its
  // Prefill gave the first up, and may have reused what was read there): false then.
  bool read_on(const std::string& ext_id, const std::string& connection, int group_member_idx,
               bool owes);
  // The connection is gone: the requests it owed and that are not complete fail. Returns
  // how many did.
  size_t connection_lost(const std::string& connection);
  // Whether some connection owes a final layer or a commit.
  bool owes_any() const { return !owed_.empty(); }

  // Contributor `group_member_idx` of `tp_ratio` listed `ext_id` in a READ_READY_BATCH's
  // done_ext_ids (or committed it) on `connection`, which owes it no more. A second signal
  // from the same contributor does not advance the request; a signal whose tp_ratio differs
  // from an earlier one's fails it (one Prefill instance sends a request, and its
  // contributors agree on their number).
  Status on_final_layer(const std::string& ext_id, int group_member_idx, int tp_ratio,
                        const std::string& connection = {});
  // A read for the request failed on this rank: the request is terminal and failed.
  void on_failed(const std::string& ext_id);

  // Completion across the TP ranks, in two steps so that the caller gathers without
  // holding its lock: this rank's terminal requests (those past their arrival deadline by
  // `now` fail first), then, given every rank's, what they all ended (failed if any rank
  // failed) with their blocks, and the removed requests no read writes any more; their
  // state is freed.
  RankTerminal terminal(std::chrono::steady_clock::time_point now);
  Finished finish(const std::vector<RankTerminal>& ranks);

  size_t tracked() const { return requests_.size() + early_.size(); }
  bool known(const std::string& ext_id) const { return requests_.count(ext_id) != 0; }
  // Every contributor reported the request's final layer on this rank, and nothing failed.
  bool complete(const std::string& ext_id) const {
    auto it = requests_.find(ext_id);
    return it != requests_.end() && it->second.terminal && !it->second.signals.failed;
  }
  // Decode removed the request recently (its late readiness is answered, nothing read).
  bool aborted(const std::string& ext_id) const { return removed_.count(ext_id) != 0; }

 private:
  // What the final-layer signals of one request said so far.
  struct Signals {
    std::set<int> contributors_done;
    int contributors = 0;  // the tp_ratio they carry; 0 until the first
    bool failed = false;
  };
  struct Request {
    std::string internal_id;
    Destinations destinations;
    Signals signals;
    bool terminal = false;
    std::vector<uint64_t> reads;  // reads planned into its blocks that may be in flight
  };
  void update_terminal(Request& r);
  // Every tracked request whose arrival deadline passed by `now` fails.
  void expire(std::chrono::steady_clock::time_point now);
  // Records one signal; an error (and a failed request) if its tp_ratio disagrees.
  static Status record(const std::string& ext_id, Signals& s, int group_member_idx, int tp_ratio);

  size_t max_early_;
  std::map<std::string, Request> requests_;
  // By connection: the requests read there whose final layer (or commit) it has not sent.
  std::map<std::string, std::set<std::string>> owed_;
  // By external id, for each contributor: the connection its KV came on.
  std::map<std::string, std::map<int, std::string>> source_;
  // The reads begun, and those still in flight.
  uint64_t reads_begun_ = 0;
  std::set<uint64_t> reads_in_flight_;
  struct Removed {
    std::string ext_id, internal_id;
    uint64_t read = 0;  // the last read begun when it was removed, if one was in flight
  };
  std::vector<Removed> to_report_;  // removed requests, reported by finish()
  struct FailedLater {
    std::string ext_id, internal_id;
    Destinations destinations;
    std::vector<uint64_t> reads;  // some still writing its blocks when it ended
  };
  bool any_in_flight(const std::vector<uint64_t>& reads) const;
  std::vector<FailedLater> failed_later_;  // ended, reported once `read` ended
  std::map<std::string, Signals> early_;
  // Aborted ids whose late signals are ignored: the most recent max_early_ of them, so the
  // set does not grow with the life of the process.
  std::set<std::string> removed_;
  std::deque<std::string> removed_order_;
};

// What every rank's terminal states end, by external id.
struct Combined {
  std::vector<std::string> finished;  // terminal on every rank, failed on none
  std::vector<std::string> failed;    // terminal on every rank, failed on some
};
// Every rank runs the same gather: a request is done once it is terminal on every rank.
Combined combine(const std::vector<RankTerminal>& ranks);

}  // namespace rd2h::decode
