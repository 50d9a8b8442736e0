#include "layout/storage_slots.h"

#include <gtest/gtest.h>

namespace rd2h::layout {
namespace {

LayerTensors layer(uint64_t main_base, std::optional<uint64_t> indexer_base) {
  LayerTensors t;
  t.base_addrs = {main_base, main_base + 0x1000};
  t.bytes_per_block = {1024, 128};
  if (indexer_base) {
    t.has_indexer = true;
    t.base_addrs.push_back(*indexer_base);
    t.bytes_per_block.push_back(64);
  }
  return t;
}

TEST(StorageSlots, LayersSharingBuffersShareSlots) {
  // 61 layers over 3 physical main buffers and 2 indexer buffers.
  std::vector<LayerTensors> layers;
  for (uint64_t l = 0; l < 61; ++l)
    layers.push_back(layer(0x100000 * (l % 3), 0x900000 + 0x10000 * (l % 2)));
  auto slots = StorageSlots::infer(layers);
  EXPECT_EQ(slots.layer_count(), 61u);
  EXPECT_EQ(slots.main_slot_count(), 3u);
  EXPECT_EQ(slots.indexer_slot_count(), 2u);
  for (size_t l = 0; l + 3 < 61; ++l) {
    EXPECT_EQ(slots.of(l).main, slots.of(l + 3).main) << "layer " << l;
    EXPECT_NE(slots.of(l).main, slots.of(l + 1).main) << "layer " << l;
  }
  for (size_t l = 0; l + 2 < 61; ++l) EXPECT_EQ(slots.of(l).indexer, slots.of(l + 2).indexer);
  EXPECT_NE(slots.of(0).indexer, slots.of(1).indexer);
}

TEST(StorageSlots, MainAndIndexerAreTrackedIndependently) {
  // Same main buffer, different indexer buffers; and a layer without an indexer.
  auto slots = StorageSlots::infer(
      {layer(0x1000000, 0x9000000), layer(0x1000000, 0xa000000), layer(0x2000000, std::nullopt)});
  EXPECT_EQ(slots.of(0).main, slots.of(1).main);
  EXPECT_NE(slots.of(0).indexer, slots.of(1).indexer);
  EXPECT_FALSE(slots.of(2).indexer.has_value());
  EXPECT_EQ(slots.main_slot_count(), 2u);
}

TEST(StorageSlots, EveryLayerGetsItsOwnSlotWithoutReuse) {
  std::vector<LayerTensors> layers;
  for (uint64_t l = 0; l < 61; ++l) layers.push_back(layer(0x100000 * l, 0x90000000 + 0x10000 * l));
  auto slots = StorageSlots::infer(layers);
  EXPECT_EQ(slots.main_slot_count(), 61u);
  EXPECT_EQ(slots.indexer_slot_count(), 61u);
}

}  // namespace
}  // namespace rd2h::layout
