// The UCX engine's exported metadata: how to reach a peer engine and what it exposes, as one
// msgpack map led by its version "v". Decoding bounds the bytes first and checks every field
// connect() relies on: bad bytes fail naming the field, never with an exception or a crash.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "rd2h/common/status.h"
#include "transfer/peer_liveness.h"

namespace rd2h::transfer {

// Version 3 is the map {"v": 3, "session_id", "hostname", "transport": str, "identity":
// {"boot_id": str, "pid_namespace", "pid", "start_time": int}, "worker_address": bin,
// "regions": [{"base", "length": int, "rkey": bin, "fd", "inode", "file_offset",
// "live_offset": int}]}, every field present and no other. Versions up to 2 were a
// little-endian format led by "RD2HUCXM", recognised only to be refused by name.
inline constexpr uint32_t kUcxMetadataVersion = 3;
inline constexpr size_t kMaxUcxMetadataBytes = 32u << 20;  // the whole blob, checked first
inline constexpr size_t kMaxMetadataString = 4096;
inline constexpr size_t kMaxWorkerAddress = 1 << 20;
inline constexpr size_t kMaxPackedRkey = 1 << 16;
inline constexpr size_t kMaxRegions = 1 << 16;

struct ExportedRegion {
  uint64_t base = 0;
  uint64_t length = 0;
  std::vector<std::byte> packed_rkey;
  // Caller memory the exporter moved into a memfd (shared_backing.h): the fd it holds it
  // open as, the file's inode, where `base` lies in it and its live word. fd -1: none.
  int32_t fd = -1;
  uint64_t inode = 0;
  uint64_t file_offset = 0;
  uint64_t live_offset = 0;  // where in the file the word saying "still registered" is
};

struct UcxMetadata {
  std::string session_id;
  std::string hostname;
  std::string transport;  // the exporter's configured transport, for error messages
  HostIdentity identity;
  std::vector<std::byte> worker_address;
  std::vector<ExportedRegion> regions;  // sorted by base, disjoint
};

std::vector<std::byte> encode_ucx_metadata(const UcxMetadata& meta);
Expected<UcxMetadata> decode_ucx_metadata(std::span<const std::byte> bytes);

}  // namespace rd2h::transfer
