// A process-wide timeline recorder: spans and instants on the monotonic clock, kept in memory
// until drained; any thread may record. Off by default (recording then costs one relaxed
// load); past `kMaxEvents` events are counted and dropped.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace rd2h::trace {

struct Event {
  std::string name;     // "read", "readiness", "answer", "compute", "slot wait", ...
  std::string lane;     // the thread it happened on: "reader", "sender", "compute", "core"
  int64_t ts_us = 0;    // start, microseconds of the monotonic clock
  int64_t dur_us = -1;  // -1: an instant
  int rank = -1;        // TP rank; -1: the engine core
  int64_t layer = -1;
  uint64_t bytes = 0;
  std::string request;  // external request ids the event is about, comma-separated
};

constexpr size_t kMaxEvents = 4'000'000;
// An Event's rank to be filled in by record() with the one set_rank() gave.
constexpr int kThisProcessRank = -2;

int64_t now_us();
void set_enabled(bool on);
bool enabled();
// The rank stamped on events recorded without one (a TP rank's process sets it once).
void set_rank(int rank);

void record(Event event);
inline void span(std::string name, std::string lane, int64_t start_us, int64_t end_us,
                 int64_t layer = -1, uint64_t bytes = 0, std::string request = {}) {
  if (!enabled()) return;
  record({std::move(name), std::move(lane), start_us, end_us - start_us, kThisProcessRank, layer,
          bytes, std::move(request)});
}
inline void instant(std::string name, std::string lane, int64_t layer = -1,
                    std::string request = {}) {
  if (!enabled()) return;
  record({std::move(name), std::move(lane), now_us(), -1, kThisProcessRank, layer, 0,
          std::move(request)});
}

// Everything recorded since the last drain, in recording order.
std::vector<Event> drain();
// Events dropped since the start because the buffer was full.
uint64_t dropped();

}  // namespace rd2h::trace
