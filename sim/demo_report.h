// What `rd2h demo` reports: figures computed from the engines' timeline events and the
// client's own records (pure functions), and the Chrome trace-event JSON of the run.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "rd2h/common/trace.h"
#include "util/metrics.h"

namespace rd2h::sim {

struct EngineTrace {
  std::string role;  // "prefill" | "decode"
  int instance = 0;
  int tp = 1;
  std::vector<trace::Event> events;
};

struct ClientRecord {
  std::string id;
  int64_t start_us = 0;  // the monotonic clock the engines use
  int64_t first_byte_us = 0;
  int64_t end_us = 0;
  uint64_t prompts = 0;
  uint64_t tokens = 0;
  bool ok = false;
  std::string error;
};

struct Interval {
  int64_t begin = 0, end = 0;
};

// The share of the reads' time that ran while Prefill was computing (any layer, any rank):
// the transfer hidden behind compute. 0 when there are no reads.
double hidden_fraction(const std::vector<Interval>& reads, std::vector<Interval> compute);

using metrics::quantile;

struct DemoSummary {
  uint64_t requests = 0, prompts = 0, tokens = 0, failed = 0;
  uint64_t reads = 0, bytes = 0;
  double read_p50_us = 0, read_p99_us = 0;
  double link_gbps = 0;       // bytes over the time reads were in flight, summed per read
  double aggregate_gbps = 0;  // bytes over first read start .. last read end
  double hidden = 0;          // hidden_fraction of every read
  // Per prompt, from Prefill's last layer computed to: every Decode rank holding all of its
  // KV ("kv complete", the connector's part), and Decode's engine core seeing it ready
  // ("kv ready", which adds the engine's step loop).
  size_t ready_matched = 0;
  double ready_delay_p50_us = 0, ready_delay_p99_us = 0;
  double pickup_delay_p50_us = 0, pickup_delay_p99_us = 0;
  // Per request: the read of its last layer (its final chunk's, the slowest Decode rank),
  // and the Decode-ready delay over it.
  double last_layer_read_p50_us = 0;
  double ready_ratio_p50 = 0, ready_ratio_p99 = 0;
  double ttft_p50_ms = 0, ttft_p99_ms = 0;
  double wall_s = 0;
  double compute_p50_us = 0;  // one Prefill layer's compute, on one rank
  uint64_t slot_waits = 0;
  double slot_wait_us = 0;
};

DemoSummary summarize(const std::vector<EngineTrace>& engines,
                      const std::vector<ClientRecord>& client);
// The goals the demo's figures are held to (docs/benchmarks.md): at least this share of the
// read time hidden behind Prefill's compute, and a Decode-ready delay at p50 of at most this
// many times the prompt's last-layer read.
inline constexpr double kHiddenGoal = 0.9;
inline constexpr double kReadyRatioGoal = 1.5;
// The summary as printed, each figure with a goal beside it.
std::string format_summary(const DemoSummary& s);
std::string chrome_trace(const std::vector<EngineTrace>& engines,
                         const std::vector<ClientRecord>& client);

}  // namespace rd2h::sim
