// The layer benchmark's workers (bench_layers_workers.cc): one Prefill and one Decode worker
// per configuration, the layers they run and what each took; bench_layers.cc measures and reports.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "bench_layers.h"
#include "decode/worker.h"
#include "prefill/worker.h"
#include "rd2h/common/status.h"

namespace rd2h::tools::bench_layers {

// The layers of the model each configuration registers (DeepSeek-V3.2 has 61).
inline constexpr uint32_t kModelLayers = 61;

struct Sample {
  double round_trip_us = 0;
  double read_us = 0;
  int64_t start_us = 0, end_us = 0;  // on the trace clock
};

// Where one layer's round trip goes, from the trace: the hops in order.
inline constexpr const char* kStages[] = {
    "save_kv_layer -> readiness sent (Prefill: reuse gate, encode, send)",
    "-> readiness at the reader (one way, reader wake-up, decode)",
    "-> read starts (the reader's checks and descriptors)",
    "-> read ends (the engine)",
    "-> answer sent (the reader's bookkeeping, reply)",
    "-> answer read (one way, the waiting thread wakes)",
    "-> wait_for_layer_send returns (gate)"};
inline constexpr size_t kStageCount = sizeof(kStages) / sizeof(kStages[0]);

// One Prefill and one Decode worker, and the step they run: `requests` requests sharing
// the layer's blocks evenly.
struct Setup {
  uint32_t requests = 0;
  bool link = false;  // readiness and answers on the transfer engine's link, not ZeroMQ
  uint64_t layer_bytes = 0;
  std::unique_ptr<decode::Worker> decode;
  std::unique_ptr<prefill::Worker> prefill;
  uint64_t next_layer = 0;
  std::vector<Sample> samples;
};

// One configuration per request count and control path (ZeroMQ, then the link).
Expected<std::vector<std::unique_ptr<Setup>>> make_setups(const BenchLayersOptions& o);

// The warm-up layers; a connection moves to the link at its first readiness sent with none
// outstanding, once Prefill heard the link open: warmed up until then too (within bounds).
Status warm_up(std::vector<std::unique_ptr<Setup>>& setups, const BenchLayersOptions& o);

// Publishes `count` layers one at a time, each waited for; records them unless warming up.
Status run_layers(Setup& s, uint32_t count, bool record);

// Runs `count` more layers with the timeline on and returns, per stage, the time of each
// layer whose every hop the trace shows.
std::vector<std::vector<double>> stage_times(Setup& s, uint32_t count);

}  // namespace rd2h::tools::bench_layers
