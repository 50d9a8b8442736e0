// Starts tests/transfer/transfer_peer as a separate process and reads what it exports.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "transfer/hex.h"
#include "util/subprocess.h"

namespace rd2h::testing {

struct PeerProcess {
  Subprocess process;
  std::vector<std::byte> metadata;
  uintptr_t base = 0;
  size_t block = 0;
  size_t blocks = 0;
  uint64_t key = 0;
};

inline Expected<PeerProcess> start_peer(const std::string& transport, const std::string& memory,
                                        size_t block, size_t blocks, uint64_t key) {
  auto p = Subprocess::spawn({RD2H_TRANSFER_PEER, "--transport", transport, "--memory", memory,
                              "--block", std::to_string(block), "--blocks", std::to_string(blocks),
                              "--key", std::to_string(key)});
  if (!p) return p.status();
  PeerProcess peer{std::move(*p), {}, 0, block, blocks, key};
  // UCX may log to stdout too: lines other than the peer's own are skipped.
  while (peer.metadata.empty() || peer.base == 0) {
    auto line = peer.process.read_line(std::chrono::seconds(20));
    if (!line) return line.status().with_context("waiting for the peer's metadata");
    if (line->rfind("META ", 0) == 0) peer.metadata = from_hex(line->substr(5));
    if (line->rfind("BASE ", 0) == 0) peer.base = std::stoull(line->substr(5), nullptr, 16);
  }
  return peer;
}

}  // namespace rd2h::testing

namespace rd2h::testing {

// A reader process reading every block of `peer` in a loop; returns once it has verified
// its first batch (it printed READING).
inline Expected<Subprocess> start_reader(const std::string& transport, const PeerProcess& peer) {
  char base[32];
  std::snprintf(base, sizeof(base), "%llx", static_cast<unsigned long long>(peer.base));
  auto p = Subprocess::spawn({RD2H_TRANSFER_PEER, "--transport", transport, "--block",
                              std::to_string(peer.block), "--blocks", std::to_string(peer.blocks),
                              "--key", std::to_string(peer.key), "--read-from",
                              to_hex(peer.metadata), "--remote-base", base});
  if (!p) return p.status();
  for (;;) {
    auto line = p->read_line(std::chrono::seconds(20));
    if (!line) {
      auto status = p->wait(std::chrono::seconds(5));
      return line.status().with_context(
          "waiting for the reader's first batch (its wait status: " +
          (status ? std::to_string(*status) : status.status().to_string()) + ")");
    }
    if (*line == "READING") return std::move(*p);
  }
}

}  // namespace rd2h::testing
