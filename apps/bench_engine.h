// rd2h bench engine: batched-read throughput of the transfer engine against a source
// process on this host, next to single-thread memcpy of the same blocks and, where
// ucx_perftest is installed, ucx_perftest's ucp_get at the same size, and the peer engines
// asked for (NIXL, Mooncake) reading the same batches, all in one run.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace rd2h::tools {

struct BenchEngineOptions {
  std::vector<std::string> transports{"shm", "tcp"};
  std::vector<uint64_t> block_bytes{16 << 10, 128 << 10, 1 << 20, 4 << 20};
  uint64_t batch_bytes = 64 << 20;
  std::string memory = "alloc";    // how the source holds its pool: alloc | register
  std::string read_path = "auto";  // the reader engine's: auto | rma | am
  double min_seconds = 2.0;        // per measurement, split over alternating rounds
  uint32_t min_batches = 5;
  bool perftest = true;
  uint32_t timeout_ms = 5000;
  // What the source process does while it is read: none (idle), busy (a spinning thread per
  // core, as a Prefill computing) or stopped (SIGSTOP).
  std::string source_load = "none";
  bool share = true;  // the source's registered memory moves into shared memory
  // Peer engines measured on the same blocks (nixl, mooncake), each through its own Python
  // API by apps/peers/bench_peers.py in the interpreter `peers_python` (empty: the one of
  // scripts/bench-venv); a peer that is not installed is reported and skipped.
  std::vector<std::string> peers;
  std::string peers_python;
};

int run_bench_engine(const BenchEngineOptions& options);

}  // namespace rd2h::tools
