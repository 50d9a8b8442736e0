// rd2h prefill / rd2h decode: a simulated inference engine (sim/engine.h) as
// an HTTP server, driving the connector as a host engine would, until SIGINT or SIGTERM;
// then it drains (new requests and /health get 503 while those in flight finish).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "rd2h/connector/config.h"

namespace rd2h::tools {

struct EngineCommandOptions {
  std::string kv_transfer_config;  // vLLM-style JSON; empty: rd2h defaults for the role
  std::string host = "127.0.0.1";
  int port = 0;
  std::string served_model_name = "rd2h-sim";
  int tp = 1;
  int layers = 61;
  uint64_t block_size = 128;
  uint64_t num_blocks = 256;
  int slots = 3;  // Prefill's physical layer buffers
  // Per token: MLA K (512 bf16) and V (64 bf16), indexer (128 int8), LIC8 scale (fp32).
  std::vector<uint64_t> bytes_per_token{1024, 128, 128, 4};
  uint64_t token_budget = 2048;
  uint64_t decode_cached_tokens = 0;
  uint64_t test_recompute_after = 0;
  uint64_t compute_ns_per_token = 1000;  // per layer: a Prefill step's layer time
  uint64_t compute_min_layer_us = 0;
  bool trace = false;
  int test_corrupt_layer = -1;
  std::string token_file;  // the bearer token of the HTTP API (empty: $RD2H_TOKEN, if set)
  size_t max_prompts = 1024;
  size_t max_prompt_tokens = 262144;
  int64_t drain_timeout_s = 30;  // after SIGTERM: how long requests in flight may take
};

int run_engine(const EngineCommandOptions& options, connector::KvRole role);

}  // namespace rd2h::tools
