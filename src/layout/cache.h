// The KV caches a host engine hands the connector (spec "Data Ownership", docs/wire-format.md
// "Arithmetic both sides share"): a layer's tensors as allocated and as read, the regions to
// register, the block slice a Prefill chunk publishes. Pure functions over plain structs.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "layout/layout.h"
#include "rd2h/common/status.h"
#include "rd2h/layout/cache_layer.h"

namespace rd2h::layout {

// The largest layer index (the wire's bound, protocol::kMaxLayerIndex, which the connector
// checks equal).
inline constexpr int64_t kMaxLayerIndex = 1 << 20;

// The layer index the wire carries: the n of "layers.<n>" in the layer's name.
Expected<int64_t> layer_index_from_name(std::string_view name);

// Checks a layer's shape (tensor count against main/indexer/scale, non-zero sizes, whole
// blocks, no address overflow) and returns it as the read arithmetic sees it.
Expected<LayerTensors> to_layer_tensors(const CacheLayer& layer);

struct Region {
  uint64_t addr = 0;
  uint64_t length = 0;
  bool operator==(const Region&) const = default;
};
// The memory to register for these layers: every tensor, with overlapping and adjacent
// ranges merged (layers sharing a physical slot share its tensors), in address order.
std::vector<Region> merged_regions(const std::vector<CacheLayer>& layers);

// The blocks one chunk of Prefill publishes for a cache group of `block_size` tokens:
// [start, end) of the request's allocated block ids, where start = max(remote_cached,
// transferred) / block_size and end = ceil(computed / block_size) on the final chunk (its
// partial block included), else computed / block_size; end is raised to start when below
// it. An end past the `allocated` ids is an error naming both.
struct ChunkProgress {
  uint64_t remote_cached_tokens = 0;  // tokens Decode already holds
  uint64_t transferred_tokens = 0;    // tokens earlier chunks published
  uint64_t computed_tokens = 0;       // tokens whose KV is written after this chunk
  bool final_chunk = false;
};
Expected<Range> chunk_slice(const ChunkProgress& progress, uint64_t block_size, size_t allocated);

}  // namespace rd2h::layout
