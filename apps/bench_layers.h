// rd2h bench layers: the connector's per-layer cost over shared memory in one process. A
// Prefill worker publishes layers one at a time to a Decode worker; each layer's round trip
// (save_kv_layer to every answer in) is split into the engine's read time, measured by the
// reader, and the control overhead around it. Run with 1 and with many requests per layer
// of the same total size, to show that batching requests into one read costs nothing.
#pragma once

#include <cstdint>
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
};

int run_bench_layers(const BenchLayersOptions& options);

}  // namespace rd2h::tools
