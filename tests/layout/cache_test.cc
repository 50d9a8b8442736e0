#include "layout/cache.h"

#include <gtest/gtest.h>

namespace rd2h::layout {
namespace {

CacheLayer layer(std::string name, uint64_t base, size_t tensors, bool indexer) {
  CacheLayer l;
  l.name = std::move(name);
  l.has_indexer = indexer;
  for (size_t i = 0; i < tensors; ++i) {
    l.tensors.push_back({base + i * 0x10000, 16 * 512, 256, 2, i < 2 ? 0u : 1u});
  }
  return l;
}

TEST(LayerIndex, TakenFromLayersN) {
  EXPECT_EQ(*layer_index_from_name("model.layers.0.self_attn"), 0);
  EXPECT_EQ(*layer_index_from_name("model.layers.60.self_attn"), 60);
  EXPECT_EQ(*layer_index_from_name("layers.7"), 7);
  EXPECT_EQ(*layer_index_from_name("model.mtp.layers.61.attn"), 61);
  for (const char* bad : {"model.self_attn", "model.layers.x.attn", "model.layers.-1.attn",
                          "model.sublayers.3.attn", "model.layers.3x.attn"}) {
    auto r = layer_index_from_name(bad);
    ASSERT_FALSE(r) << bad;
    EXPECT_NE(r.status().message().find(bad), std::string::npos) << r.status().message();
  }
}

TEST(CacheLayer, BecomesLayerTensors) {
  auto l = layer("model.layers.1.self_attn", 0x100000, 4, true);
  auto t = to_layer_tensors(l);
  ASSERT_TRUE(t) << t.status().to_string();
  EXPECT_EQ(t->num_blocks, 16u);
  EXPECT_EQ(t->bytes_per_block, (std::vector<uint64_t>{512, 512, 512, 512}));
  EXPECT_TRUE(t->has_indexer);
  EXPECT_TRUE(t->has_scale);
}

TEST(CacheLayer, MalformedShapesAreRefusedByName) {
  struct Case {
    const char* what;
    CacheLayer l;
  };
  std::vector<Case> cases;
  cases.push_back({"indexer missing", layer("model.layers.2.a", 0x1000, 2, true)});
  cases.push_back({"extra tensor without indexer", layer("model.layers.2.a", 0x1000, 3, false)});
  cases.push_back({"five tensors", layer("model.layers.2.a", 0x1000, 5, true)});
  auto partial = layer("model.layers.2.a", 0x1000, 3, true);
  partial.tensors[1].bytes += 100;
  cases.push_back({"partial block", partial});
  auto fewer = layer("model.layers.2.a", 0x1000, 3, true);
  fewer.tensors[2].bytes /= 2;
  cases.push_back({"block counts differ", fewer});
  auto zero = layer("model.layers.2.a", 0x1000, 3, true);
  zero.tensors[0].block_len = 0;
  cases.push_back({"zero block length", zero});
  auto wrap = layer("model.layers.2.a", ~uint64_t{0} - 100, 3, true);
  cases.push_back({"address overflow", wrap});
  for (const auto& c : cases) {
    auto t = to_layer_tensors(c.l);
    ASSERT_FALSE(t) << c.what;
    EXPECT_NE(t.status().message().find("model.layers.2.a"), std::string::npos)
        << c.what << ": " << t.status().message();
  }
}

TEST(MergedRegions, SharedSlotsAndNeighboursBecomeOneRegion) {
  std::vector<CacheLayer> layers;
  // Layers 0 and 2 share a slot; layer 1's tensors follow slot 0's directly.
  CacheLayer a{"model.layers.0.a", {{0x1000, 0x100, 0x10}, {0x1100, 0x100, 0x10}}, 2, false};
  CacheLayer b{"model.layers.1.a", {{0x1200, 0x100, 0x10}, {0x1300, 0x100, 0x10}}, 2, false};
  CacheLayer c = a;
  c.name = "model.layers.2.a";
  CacheLayer far{"model.layers.3.a", {{0x9000, 0x100, 0x10}, {0x8000, 0x100, 0x10}}, 2, false};
  auto regions = merged_regions({a, b, c, far});
  EXPECT_EQ(regions, (std::vector<Region>{{0x1000, 0x400}, {0x8000, 0x100}, {0x9000, 0x100}}));
}

TEST(ChunkSlice, FollowsTheWireArithmetic) {
  struct Case {
    ChunkProgress p;
    size_t allocated;
    size_t begin, end;
  };
  const uint64_t bs = 16;
  const std::vector<Case> cases = {
      {{0, 0, 100, true}, 7, 0, 7},   // one chunk: 6 full blocks and the partial 7th
      {{0, 0, 64, false}, 7, 0, 4},   // a first chunk: only its complete blocks
      {{0, 64, 100, true}, 7, 4, 7},  // the final chunk: the rest and the partial block
      {{0, 40, 70, false}, 7, 2, 4},  // a chunk that began mid-block re-sends that block
      {{32, 0, 100, true}, 7, 2, 7},  // Decode already caches 2 blocks
      {{48, 0, 40, false}, 7, 3, 3},  // nothing new: empty
      {{0, 0, 96, true}, 6, 0, 6},    // exact blocks: no partial
      {{0, 0, 0, true}, 0, 0, 0},
  };
  for (const auto& c : cases) {
    auto r = chunk_slice(c.p, bs, c.allocated);
    ASSERT_TRUE(r) << r.status().to_string();
    EXPECT_EQ(r->begin, c.begin) << c.p.computed_tokens;
    EXPECT_EQ(r->end, c.end) << c.p.computed_tokens;
  }
  auto over = chunk_slice({0, 0, 100, true}, bs, 6);
  ASSERT_FALSE(over);
  EXPECT_NE(over.status().message().find("block 7"), std::string::npos) << over.status().message();
  EXPECT_FALSE(chunk_slice({0, 0, 100, true}, 0, 6));
}

}  // namespace
}  // namespace rd2h::layout
