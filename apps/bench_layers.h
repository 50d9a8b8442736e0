// rd2h bench layers: the connector's per-layer cost over shared memory in one process. A
// Prefill worker publishes layers one at a time to a Decode worker; each layer's round trip
// (save_kv_layer to every answer in) is split into the engine's read time, measured by the
// reader, and the control overhead around it. Run with 1 and with many requests per layer
// of the same total size, to show that batching requests into one read costs nothing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace rd2h::tools {

struct BenchLayersOptions {
  uint32_t layers = 1000;  // measured layers per configuration
  uint32_t warmup = 50;    // layers run first and not measured
  std::vector<uint32_t> requests{1, 32};
  uint32_t blocks = 64;  // blocks per layer, split evenly over the requests
  std::vector<uint64_t> main_bytes{131072, 16384};  // per block, DeepSeek-V3.2 MLA K and V
  uint64_t indexer_bytes = 16384;                   // per block
  uint32_t timeout_ms = 10000;
  // Each of the model's 61 layers in memory of its own (otherwise all alias one slot).
  bool distinct_layers = false;
  // Peer engines whose completion path is measured beside rd2h's on the same layers (nixl:
  // its notifications), through apps/peers/bench_peers.py in `peers_python` (empty: the
  // interpreter of scripts/bench-venv). Implies distinct_layers.
  std::vector<std::string> peers;
  std::string peers_python;
};

int run_bench_layers(BenchLayersOptions options);

}  // namespace rd2h::tools
