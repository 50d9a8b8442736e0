// Where the wire meets the read arithmetic: a Prefill layer as MF_META carries it, read
// back on Decode.
#include "decode/layer_meta.h"

#include <gtest/gtest.h>

#include "layout/cache.h"
#include "prefill/layer_meta.h"

namespace rd2h::decode {
namespace {

TEST(LayerMeta, APrefillLayerReadsBackOnDecodeAsTheSameTensors) {
  layout::CacheLayer l;
  l.name = "model.layers.1.self_attn";
  l.has_indexer = true;
  for (size_t i = 0; i < 4; ++i) {
    l.tensors.push_back({0x100000 + i * 0x10000, 16 * 512, 256, 2, i < 2 ? 0u : 1u});
  }
  auto t = layout::to_layer_tensors(l);
  ASSERT_TRUE(t) << t.status().to_string();
  auto m = prefill::to_layer_meta(l);
  EXPECT_EQ(m.block_len, (std::vector<uint64_t>{256, 256, 256, 256}));
  EXPECT_EQ(m.block_size_scale, (std::vector<uint64_t>{2, 2, 2, 2}));
  EXPECT_EQ(m.tensor_group_idx, (std::vector<uint64_t>{0, 0, 1, 1}));
  auto back = from_layer_meta(m);
  ASSERT_TRUE(back) << back.status().to_string();
  EXPECT_EQ(back->base_addrs, t->base_addrs);
  EXPECT_EQ(back->bytes_per_block, t->bytes_per_block);
  EXPECT_EQ(back->has_scale, t->has_scale);
}

TEST(LayerMeta, ScaleIsTheTensorAfterTheIndexer) {
  protocol::LayerMeta m;
  m.base_addrs = {1, 2, 3, 4};
  m.block_len = {16, 16, 4, 1};
  m.block_size_scale = {8, 8, 8, 8};
  m.tensor_group_idx = {0, 0, 1, 1};
  m.main_tensor_count = 2;
  m.has_indexer = true;
  auto t = from_layer_meta(m);
  ASSERT_TRUE(t) << t.status().to_string();
  EXPECT_TRUE(t->has_scale);
  EXPECT_EQ(t->bytes_per_block, (std::vector<uint64_t>{128, 128, 32, 8}));
  m.base_addrs.pop_back();
  m.block_len.pop_back();
  m.block_size_scale.pop_back();
  m.tensor_group_idx.pop_back();
  EXPECT_FALSE(from_layer_meta(m)->has_scale);
}

TEST(LayerMeta, ALayerWithTensorsBeyondIndexerAndScaleIsRefusedNamingMfMeta) {
  protocol::LayerMeta m;
  m.base_addrs = {1, 2, 3, 4, 5};
  m.block_len = {16, 16, 4, 1, 1};
  m.block_size_scale = {8, 8, 8, 8, 8};
  m.tensor_group_idx = {0, 0, 1, 1, 1};
  m.main_tensor_count = 2;
  m.has_indexer = true;
  auto t = from_layer_meta(m);
  ASSERT_FALSE(t);
  EXPECT_NE(t.status().message().find("MF_META layer describes 5 tensors, expected 3"),
            std::string::npos)
      << t.status().message();
}

TEST(LayerMeta, SourceBlocksViewTheReadinessRequest) {
  const protocol::ReadReq req{"r7", {1, 2, 3}, {4, 5}, 2, 1};
  const layout::SourceBlocks b = source_blocks(req);
  EXPECT_EQ(b.ext_id, "r7");
  EXPECT_EQ(b.main_block_ids.data(), req.main_block_ids.data());
  EXPECT_EQ(b.indexer_block_ids.size(), 2u);
  EXPECT_EQ(b.main_start, 2);
  EXPECT_EQ(b.indexer_start, 1);
}

}  // namespace
}  // namespace rd2h::decode
