#include "decode/layer_meta.h"

namespace rd2h::decode {

Expected<layout::LayerTensors> from_layer_meta(const protocol::LayerMeta& meta) {
  layout::LayerTensors t;
  t.base_addrs = meta.base_addrs;
  t.main_tensor_count = meta.main_tensor_count;
  t.has_indexer = meta.has_indexer;
  t.has_scale = meta.has_indexer && meta.base_addrs.size() == meta.main_tensor_count + 2;
  for (size_t i = 0; i < meta.base_addrs.size(); ++i) {
    t.bytes_per_block.push_back(meta.bytes_per_block(i));
  }
  RD2H_RETURN_IF_ERROR(layout::check_shape(t, "MF_META layer"));
  return t;
}

}  // namespace rd2h::decode
