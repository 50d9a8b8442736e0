// rd2h pd-read: validates real two-endpoint registration and reads, independently of any
// scheduling. A source endpoint registers a KV-like pool filled with a known pattern; a
// destination endpoint pulls batches of random, non-contiguous blocks, checks every byte,
// and reports per-batch latency and throughput.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "util/subprocess.h"
#include "kv_pool.h"
#include "pd_read_channel.h"
#include "rd2h/transfer/transfer_engine.h"

namespace rd2h::tools {

struct PdReadOptions {
  std::string role = "local";  // local (spawn both) | source | dest
  std::string listen = "127.0.0.1:0";
  std::string connect;
  std::string transport = "auto";
  std::string read_path = "auto";  // the destination's: auto | rma | am
  std::string memory = "alloc";    // how the source holds its pool: alloc | register
  uint32_t layers = 61;
  uint32_t blocks = 32;
  std::vector<uint64_t> main_bytes{131072, 16384};
  uint64_t indexer_bytes = 16384;  // 0: no indexer tensor
  uint32_t batch_blocks = 16;
  uint32_t batches = 0;  // 0: one batch per layer
  uint64_t seed = 1;
  uint32_t timeout_ms = 5000;
  uint32_t serve_timeout_s = 600;
  // Source: threads that keep its cores busy while it serves (a Prefill computing), and
  // whether registered memory moves into shared memory co-located readers map.
  uint32_t busy_threads = 0;
  bool share = true;

  KvPoolLayout layout() const;
};

int run_pd_read(const PdReadOptions& options);

// A source endpoint in a child process of this executable, and where it listens.
struct SourceProcess {
  Subprocess process;
  std::string address;
};
Expected<SourceProcess> spawn_source(const PdReadOptions& options);

// A destination connected to a source: the handshake, the engine and its session.
struct SourceConnection {
  DestChannel channel;
  SourceHandshake handshake;
  std::unique_ptr<transfer::TransferEngine> engine;
  transfer::SessionHandle session;
};
// `config` is the destination engine's; its role is set to decode.
Expected<SourceConnection> connect_to_source(const std::string& address,
                                             transfer::EngineConfig config);
// Tells the source the reader is done (ok or not), so it exits.
void release_source(SourceConnection& connection, bool ok);

}  // namespace rd2h::tools
