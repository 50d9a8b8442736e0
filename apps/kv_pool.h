// The KV-like region the tools move: layers x tensors x blocks, each tensor of a layer a
// contiguous run of blocks. Every (layer, tensor, block) carries its own byte pattern, so a
// reader verifies each block it receives without a copy of the source.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "rd2h/common/status.h"

namespace rd2h::tools {

struct KvPoolLayout {
  uint32_t layers = 0;
  uint32_t blocks = 0;                 // blocks per tensor
  std::vector<uint64_t> tensor_bytes;  // bytes per block of each tensor of a layer

  // A layout with a zero count, no tensors, or more than `max_total` bytes is an error.
  Status validate(uint64_t max_total) const;
  uint64_t bytes_per_block() const;  // all tensors of one layer
  uint64_t layer_bytes() const { return bytes_per_block() * blocks; }
  uint64_t total_bytes() const { return layer_bytes() * layers; }
  uint64_t offset(uint32_t layer, uint32_t tensor, uint32_t block) const;
};

uint64_t block_pattern_key(uint64_t seed, uint32_t layer, uint32_t tensor, uint32_t block);
void fill_pool(std::byte* base, const KvPoolLayout& layout, uint64_t seed);

// What a source tells its reader: the layout, the pattern seed, where the pool starts, and
// the transfer engine metadata to connect with.
struct SourceHandshake {
  KvPoolLayout layout;
  uint64_t seed = 0;
  uint64_t base = 0;
  std::vector<std::byte> engine_metadata;
};

// The largest encoded handshake a reader accepts, and the largest engine metadata in one.
inline constexpr size_t kMaxHandshakeBytes = 32u << 20;
inline constexpr size_t kMaxEngineMetadataBytes = 16u << 20;

// A msgpack map: format, layers, blocks, tensor_bytes, seed, base, engine_metadata.
std::vector<std::byte> encode_handshake(const SourceHandshake& h);
// Checks the size before parsing and every field after; an error names the field. The
// layout's own rules are its validate()'s, left to the caller who knows the size limit.
Expected<SourceHandshake> decode_handshake(std::span<const std::byte> bytes);

}  // namespace rd2h::tools
