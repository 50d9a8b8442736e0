#include "prefill/layer_meta.h"

#include "layout/cache.h"

namespace rd2h::prefill {

static_assert(layout::kMaxLayerIndex == protocol::kMaxLayerIndex,
              "a layer index taken from a name must fit the wire");

protocol::LayerMeta to_layer_meta(const layout::CacheLayer& layer) {
  protocol::LayerMeta m;
  for (const auto& c : layer.tensors) {
    m.base_addrs.push_back(c.addr);
    m.block_len.push_back(c.block_len);
    m.block_size_scale.push_back(c.block_size_scale);
    m.tensor_group_idx.push_back(c.group_idx);
  }
  m.main_tensor_count = layer.main_tensor_count;
  m.has_indexer = layer.has_indexer;
  return m;
}

}  // namespace rd2h::prefill
