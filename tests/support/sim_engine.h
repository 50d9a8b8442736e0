// Simulated engines for the tests that run a whole stack in one process.
#pragma once

#include <memory>
#include <random>

#include "sim/engine.h"

namespace rd2h::testing {

// A small model over shared memory at TP 1: 4 layers, blocks of 16 tokens of 64 + 8 + 16
// bytes, `blocks` of them, ranks running the rd2h binary.
inline sim::EngineConfig small_engine(connector::KvRole role, uint64_t blocks,
                                      int prefill_tp = 1) {
  sim::EngineConfig c;
  c.connector.role = role;
  c.connector.engine_id = role == connector::KvRole::kConsumer ? "decode-0" : "prefill-0";
  c.connector.kv_port = 1;  // Decode: see start_decode
  c.connector.transport = transfer::Transport::kShm;
  c.connector.prefill_tp_size = prefill_tp;
  c.tp_size = 1;
  c.model.layers = 4;
  c.model.block_size = 16;
  c.model.num_blocks = blocks;
  c.model.bytes_per_token = {64, 8, 16};
  c.worker_executable = RD2H_BINARY;
  return c;
}

// Decode with `c` on kv ports picked at random, tried again (up to 20 times) if taken.
inline std::unique_ptr<sim::Engine> start_decode(sim::EngineConfig c) {
  std::mt19937 rng(std::random_device{}());
  for (int attempt = 0; attempt < 20; ++attempt) {
    c.connector.kv_port = std::uniform_int_distribution<int>(20000, 60000)(rng);
    if (auto e = sim::Engine::start(c)) return std::move(*e);
  }
  return nullptr;
}

}  // namespace rd2h::testing
