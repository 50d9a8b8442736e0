// Starts tests/transfer/transfer_peer as a separate process and reads what it exports.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "rd2h/common/subprocess.h"

namespace rd2h::testing {

struct PeerProcess {
  Subprocess process;
  std::vector<std::byte> metadata;
  uintptr_t base = 0;
  size_t block = 0;
  size_t blocks = 0;
  uint64_t key = 0;
};

inline std::vector<std::byte> from_hex(const std::string& hex) {
  std::vector<std::byte> out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<std::byte>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

inline Expected<PeerProcess> start_peer(const std::string& transport, const std::string& memory,
                                        size_t block, size_t blocks, uint64_t key) {
  auto p = Subprocess::spawn({RD2H_TRANSFER_PEER, "--transport", transport, "--memory", memory,
                              "--block", std::to_string(block), "--blocks",
                              std::to_string(blocks), "--key", std::to_string(key)});
  if (!p) return p.status();
  PeerProcess peer{std::move(*p), {}, 0, block, blocks, key};
  auto meta = peer.process.read_line(std::chrono::seconds(20));
  if (!meta) return meta.status();
  if (meta->rfind("META ", 0) != 0) return internal_error("peer said: " + *meta);
  peer.metadata = from_hex(meta->substr(5));
  auto base = peer.process.read_line(std::chrono::seconds(20));
  if (!base) return base.status();
  if (base->rfind("BASE ", 0) != 0) return internal_error("peer said: " + *base);
  peer.base = std::stoull(base->substr(5), nullptr, 16);
  return peer;
}

}  // namespace rd2h::testing
