// What the UCX engine's tests against a peer process share: a Decode engine with a short read
// timeout, and local destination memory registered with it (caller-owned or engine-allocated).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "rd2h/transfer/transfer_engine.h"

namespace rd2h::testing {

using namespace std::chrono_literals;

inline constexpr auto kReadTimeout = 2000ms;

inline std::unique_ptr<transfer::TransferEngine> make_engine(
    transfer::Transport transport, transfer::ReadPath read_path = transfer::ReadPath::kAuto) {
  transfer::EngineConfig cfg;
  cfg.role = transfer::Role::kDecode;
  cfg.transport = transport;
  cfg.read_path = read_path;
  cfg.read_timeout = kReadTimeout;
  cfg.connect_timeout = 5000ms;
  auto e = transfer::create_ucx_engine(cfg);
  EXPECT_TRUE(e) << e.status().to_string();
  return e ? std::move(*e) : nullptr;
}

// The reads local[i] <- remote[i], len[i] bytes each.
inline std::vector<transfer::ReadOp> reads(std::span<const uintptr_t> local,
                                           std::span<const uintptr_t> remote,
                                           std::span<const size_t> len) {
  EXPECT_TRUE(local.size() == remote.size() && local.size() == len.size());
  std::vector<transfer::ReadOp> out;
  for (size_t i = 0; i < local.size() && i < remote.size() && i < len.size(); ++i) {
    out.push_back({local[i], remote[i], len[i]});
  }
  return out;
}

// Local destination memory, registered with the engine (caller-owned or engine-allocated).
struct Destination {
  transfer::TransferEngine* engine = nullptr;
  std::byte* base = nullptr;
  size_t size = 0;
  void* owned = nullptr;

  Destination(transfer::TransferEngine& e, size_t bytes, bool allocate) : engine(&e), size(bytes) {
    if (allocate) {
      auto r = e.allocate_memory(bytes);
      EXPECT_TRUE(r) << r.status().to_string();
      base = static_cast<std::byte*>(r->addr);
    } else {
      owned = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
      base = static_cast<std::byte*>(owned);
      EXPECT_TRUE(e.register_memory(base, bytes).is_ok());
    }
    std::memset(base, 0xab, bytes);
  }
  ~Destination() {
    EXPECT_TRUE(engine->unregister_memory(base).is_ok());
    std::free(owned);
  }
  bool untouched() const {
    return std::all_of(base, base + size, [](std::byte b) { return b == std::byte{0xab}; });
  }
};

}  // namespace rd2h::testing
