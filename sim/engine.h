// A small inference engine that drives the connector exactly as a host engine does, through its
// public headers: an HTTP front and an engine core in this process, one worker process per TP
// rank. Decode checks every byte of every block it received before it decodes.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "rd2h/common/status.h"
#include "rd2h/common/trace.h"
#include "rd2h/connector/config.h"

namespace rd2h::sim {

struct ModelLayout {
  int layers = 4;
  uint64_t block_size = 16;                          // tokens per block
  std::vector<uint64_t> bytes_per_token{64, 8, 16};  // K, V, indexer [, LIC8 scale]
  uint64_t num_blocks = 256;                         // per tensor, per rank
  int prefill_slots = 0;  // Prefill's physical layer buffers; 0: one per layer
};

struct EngineConfig {
  connector::ConnectorConfig connector;  // role, kv_port (Decode), timeouts
  int tp_size = 1;
  ModelLayout model;
  uint64_t token_budget = 64;  // tokens scheduled per step: longer prompts are chunked
  // Decode: tokens of every prompt it pretends to hold in a local prefix cache (whole
  // blocks); it writes them itself and asks Prefill only for the rest.
  uint64_t decode_cached_tokens = 0;
  // A Prefill step computes each layer for max(compute_min_layer_us, tokens in the step x
  // compute_ns_per_token): writing the layer's KV, then waiting out the rest of that time.
  uint64_t compute_ns_per_token = 1000;
  uint64_t compute_min_layer_us = 0;
  std::string host = "127.0.0.1";
  int port = 0;  // HTTP; 0 picks a free one
  // The model name the OpenAI API serves (GET /v1/models); a request naming another is a 404.
  std::string served_model_name = "rd2h-sim";
  size_t max_body_bytes = 16u << 20;  // any framing, chunked too: larger is a 413
  size_t max_prompts = 1024;          // prompts in one prompt list: more is a 400
  size_t max_prompt_tokens = 262144;  // tokens in one prompt (a text prompt: its bytes)
  // Bearer token the HTTP API requires (Authorization: Bearer <token>); empty: none.
  std::string token;
  std::chrono::milliseconds request_timeout{60000};
  // The rd2h executable the TP rank processes run (`rd2h worker`); required.
  std::string worker_executable;
  bool trace = false;  // record the timeline, served with the stats at GET /rd2h/report
  // Test only: Prefill flips one byte of the first request's KV in this layer (-1: never),
  // so that a verifying Decode must fail it.
  int test_corrupt_layer = -1;
  // Test only: Decode ends a single prompt's answer (streamed or whole) after this many
  // tokens with stop reason "recomputed" (0: never), as a Decode that lost the request's KV
  // does.
  uint64_t test_recompute_after = 0;
  // Test only: this TP rank overflows its stack at its first step (-1: none), as a rank
  // faulting on bad input would.
  int test_fault_rank = -1;
};

struct EngineStats {
  uint64_t requests = 0;
  uint64_t steps = 0;
  uint64_t prefill_chunks = 0;
  uint64_t verified_blocks = 0;  // Decode: blocks whose every byte matched
  uint64_t failed_requests = 0;
  uint64_t free_blocks = 0;         // after the last step
  uint64_t waiting_for_blocks = 0;  // requests queued until their blocks are free
  bool main_pool_locked = false;    // Decode: the shared pool is locked in memory
};

class Engine {
 public:
  static Expected<std::unique_ptr<Engine>> start(EngineConfig config);
  ~Engine();  // stops HTTP, the core and the workers; fails what is still pending
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Stops taking requests (they get 503, and so does /health) and waits up to `bound` for
  // those in flight to end; true if they all did. The destructor fails whatever is left.
  bool drain(std::chrono::milliseconds bound);

  std::string origin() const;  // http://host:port
  int kv_base_port() const;    // Decode: what it advertises
  EngineStats stats() const;

  struct Impl;

 private:
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// What an engine serves at GET /rd2h/report: its counters, and the timeline events (of
// its core and every TP rank) recorded since the last report.
struct Report {
  std::string role;  // "prefill" | "decode"
  int tp_size = 1;
  EngineStats stats;
  std::vector<trace::Event> events;
  uint64_t events_dropped = 0;
};
Expected<Report> parse_report(std::string_view body);

// The body of `rd2h worker`: one TP rank process of the engine core `core_pid`, which
// listens at `core_url`. Returns the process exit status.
int run_rank_worker(const std::string& core_url, int rank, pid_t core_pid);

}  // namespace rd2h::sim
