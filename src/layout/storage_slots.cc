#include "layout/storage_slots.h"

#include <algorithm>

namespace rd2h::layout {

namespace {

size_t slot_for(std::vector<std::vector<uint64_t>>& keys, std::vector<uint64_t> key) {
  auto it = std::find(keys.begin(), keys.end(), key);
  if (it != keys.end()) return static_cast<size_t>(it - keys.begin());
  keys.push_back(std::move(key));
  return keys.size() - 1;
}

}  // namespace

StorageSlots StorageSlots::infer(const std::vector<LayerTensors>& layers) {
  StorageSlots s;
  for (const auto& t : layers) {
    const auto split = t.base_addrs.begin() + static_cast<long>(t.main_tensor_count);
    LayerSlots slots;
    slots.main = slot_for(s.main_keys_, {t.base_addrs.begin(), split});
    if (t.has_indexer) slots.indexer = slot_for(s.indexer_keys_, {split, t.base_addrs.end()});
    s.layers_.push_back(slots);
  }
  return s;
}

}  // namespace rd2h::layout
