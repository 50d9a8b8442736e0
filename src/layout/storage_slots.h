// Physical storage slots (spec "Physical-storage completion"). Layerwise Prefill may reuse
// one physical buffer for several logical layers; a slot is identified by where a layer's
// tensors live, not by the layer's name. Main and indexer slots are tracked independently.
#pragma once

#include <cstddef>
#include <optional>
#include <vector>

#include "layout/layout.h"

namespace rd2h::layout {

struct LayerSlots {
  size_t main = 0;
  std::optional<size_t> indexer;  // absent for a layer without an indexer
};

class StorageSlots {
 public:
  // Slots are numbered in order of first use, layer by layer.
  static StorageSlots infer(const std::vector<LayerTensors>& layers);

  const LayerSlots& of(size_t layer) const { return layers_.at(layer); }
  size_t layer_count() const { return layers_.size(); }
  size_t main_slot_count() const { return main_keys_.size(); }
  size_t indexer_slot_count() const { return indexer_keys_.size(); }

 private:
  std::vector<LayerSlots> layers_;
  std::vector<std::vector<uint64_t>> main_keys_;     // base addresses of each main slot
  std::vector<std::vector<uint64_t>> indexer_keys_;  // of each indexer (and scale) slot
};

}  // namespace rd2h::layout
