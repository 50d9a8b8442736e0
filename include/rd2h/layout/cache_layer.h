// The KV caches a host engine hands the connector (spec "Data Ownership"): one attention
// layer's tensors as the engine allocated them. Plain structs; what they become on the wire
// and in the read arithmetic is the library's business.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace rd2h::layout {

// One cache tensor: `bytes` at `addr`, split into blocks of block_len * block_size_scale.
struct CacheTensor {
  uint64_t addr = 0;
  uint64_t bytes = 0;
  uint64_t block_len = 0;         // bytes per kernel block
  uint64_t block_size_scale = 1;  // kernel blocks per block
  uint64_t group_idx = 0;         // KV-cache group

  uint64_t bytes_per_block() const { return block_len * block_size_scale; }
};

// One attention layer's caches: K and V (the main tensors), then the indexer, then the
// optional LIC8 scale.
struct CacheLayer {
  std::string name;  // e.g. "model.layers.7.self_attn"
  std::vector<CacheTensor> tensors;
  uint64_t main_tensor_count = 2;
  bool has_indexer = false;
};

}  // namespace rd2h::layout
