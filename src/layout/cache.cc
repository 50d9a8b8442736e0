#include "layout/cache.h"

#include <algorithm>
#include <charconv>

namespace rd2h::layout {

Expected<int64_t> layer_index_from_name(std::string_view name) {
  constexpr std::string_view kMarker = "layers.";
  for (size_t at = name.find(kMarker); at != std::string_view::npos;
       at = name.find(kMarker, at + 1)) {
    if (at != 0 && name[at - 1] != '.') continue;
    const char* first = name.data() + at + kMarker.size();
    const char* last = name.data() + name.size();
    int64_t index = 0;
    auto [end, ec] = std::from_chars(first, last, index);
    if (ec == std::errc() && end != first && (end == last || *end == '.') && index >= 0 &&
        index <= kMaxLayerIndex) {
      return index;
    }
  }
  return invalid_argument("layer name '" + std::string(name) +
                          "' has no 'layers.<n>' to take the layer index from");
}

Expected<LayerTensors> to_layer_tensors(const CacheLayer& layer) {
  const size_t count = layer.tensors.size();
  const size_t main = layer.main_tensor_count;
  const std::string where = "layer '" + layer.name + "'";
  if (main == 0 || main > count) {
    return invalid_argument(where + ": " + std::to_string(main) + " main tensors of " +
                            std::to_string(count));
  }
  const size_t extra = count - main;
  if ((!layer.has_indexer && extra != 0) || (layer.has_indexer && (extra < 1 || extra > 2))) {
    return invalid_argument(where + ": " + std::to_string(count) + " tensors with " +
                            std::to_string(main) + " main tensors and " +
                            (layer.has_indexer ? "an indexer" : "no indexer") +
                            " (expected the main tensors, then the indexer and an optional "
                            "LIC8 scale)");
  }
  LayerTensors t;
  t.main_tensor_count = main;
  t.has_indexer = layer.has_indexer;
  t.has_scale = extra == 2;
  for (size_t i = 0; i < count; ++i) {
    const CacheTensor& c = layer.tensors[i];
    const uint64_t per_block = c.bytes_per_block();
    uint64_t end = 0;
    if (c.block_len == 0 || c.block_size_scale == 0 || c.bytes == 0 ||
        per_block / c.block_size_scale != c.block_len || c.bytes % per_block != 0 ||
        __builtin_add_overflow(c.addr, c.bytes, &end)) {
      return invalid_argument(where + ", tensor " + std::to_string(i) + ": " +
                              std::to_string(c.bytes) + " bytes at " + std::to_string(c.addr) +
                              " are not whole blocks of " + std::to_string(c.block_len) + " x " +
                              std::to_string(c.block_size_scale) + " bytes");
    }
    const uint64_t blocks = c.bytes / per_block;
    if (i > 0 && blocks != t.num_blocks) {
      return invalid_argument(where + ", tensor " + std::to_string(i) + ": " +
                              std::to_string(blocks) + " blocks, tensor 0 has " +
                              std::to_string(t.num_blocks));
    }
    t.num_blocks = blocks;
    t.base_addrs.push_back(c.addr);
    t.bytes_per_block.push_back(per_block);
  }
  return t;
}

std::vector<Region> merged_regions(const std::vector<CacheLayer>& layers) {
  std::vector<Region> all;
  for (const auto& layer : layers) {
    for (const auto& c : layer.tensors) {
      if (c.bytes != 0) all.push_back({c.addr, c.bytes});
    }
  }
  std::sort(all.begin(), all.end(),
            [](const Region& a, const Region& b) { return a.addr < b.addr; });
  std::vector<Region> merged;
  for (const Region& r : all) {
    if (!merged.empty() && r.addr <= merged.back().addr + merged.back().length) {
      Region& last = merged.back();
      last.length = std::max(last.addr + last.length, r.addr + r.length) - last.addr;
    } else {
      merged.push_back(r);
    }
  }
  return merged;
}

Expected<Range> chunk_slice(const ChunkProgress& p, uint64_t block_size, size_t allocated) {
  if (block_size == 0) return invalid_argument("block size is 0");
  const uint64_t start = std::max(p.remote_cached_tokens, p.transferred_tokens) / block_size;
  uint64_t end = p.final_chunk ? (p.computed_tokens + block_size - 1) / block_size
                               : p.computed_tokens / block_size;
  if (end > allocated) {
    return out_of_range("chunk ends at block " + std::to_string(end) + " (" +
                        std::to_string(p.computed_tokens) + " tokens of " +
                        std::to_string(block_size) + ") but only " + std::to_string(allocated) +
                        " blocks are allocated");
  }
  end = std::max(end, start);  // nothing new: an empty slice
  return Range{static_cast<size_t>(start), static_cast<size_t>(end)};
}

}  // namespace rd2h::layout
