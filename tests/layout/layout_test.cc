#include "layout/layout.h"

#include <gtest/gtest.h>

#include <map>
#include <set>

namespace rd2h::layout {
namespace {

// A request's blocks as a readiness carries them, owned; view() is what the arithmetic reads.
struct Req {
  std::string ext_id;
  std::vector<int64_t> main_block_ids;
  std::vector<int64_t> indexer_block_ids;
  int64_t main_start = 0;
  int64_t indexer_start = 0;
  SourceBlocks view() const {
    return {ext_id, main_block_ids, indexer_block_ids, main_start, indexer_start};
  }
};

// K, V, indexer, LIC8 scale, with sizes that make every address distinct.
LayerTensors side(uint64_t base) {
  LayerTensors t;
  t.base_addrs = {base, base + 0x100000, base + 0x200000, base + 0x300000};
  t.bytes_per_block = {1024, 128, 64, 8};
  t.main_tensor_count = 2;
  t.has_indexer = true;
  t.has_scale = true;
  t.num_blocks = 256;
  return t;
}

TEST(Share, RangesAreDisjointAndCoverEveryItem) {
  for (size_t size = 1; size <= 8; ++size) {
    for (int64_t start = -3; start <= 10; ++start) {
      for (size_t n = 0; n <= 40; ++n) {
        std::vector<int> owner(n, -1);
        size_t smallest = n, largest = 0;
        for (size_t i = 0; i < size; ++i) {
          Range r = share(i, size, start, n);
          ASSERT_LE(r.begin, r.end);
          ASSERT_LE(r.end, n);
          smallest = std::min(smallest, r.size());
          largest = std::max(largest, r.size());
          for (size_t k = r.begin; k < r.end; ++k) {
            ASSERT_EQ(owner[k], -1) << "item " << k << " owned twice (size " << size << ", start "
                                    << start << ", n " << n << ")";
            owner[k] = static_cast<int>(i);
          }
        }
        for (size_t k = 0; k < n; ++k) ASSERT_NE(owner[k], -1) << "item " << k << " unowned";
        EXPECT_LE(largest - smallest, 1u);
      }
    }
  }
}

TEST(Share, ASingleBlockRotatesWithTheStartOffset) {
  // With one block, the owner is start mod size: consecutive chunks land on different ranks.
  for (int64_t start = 0; start < 8; ++start) {
    std::set<size_t> owners;
    for (size_t i = 0; i < 4; ++i) {
      if (share(i, 4, start, 1).size() == 1) owners.insert(i);
    }
    ASSERT_EQ(owners.size(), 1u);
    EXPECT_EQ(*owners.begin(), static_cast<size_t>(start % 4));
  }
}

TEST(Validate, MatchingLayoutsPass) {
  EXPECT_TRUE(validate_layer(3, side(0x10000000), side(0x90000000)).is_ok());
}

TEST(Validate, EachMismatchFailsTheLayerNamingBothValues) {
  struct Case {
    const char* name;
    void (*change)(LayerTensors&);
    const char* expect;
  };
  const Case cases[] = {
      {"main bytes", [](LayerTensors& d) { d.bytes_per_block[0] = 2048; },
       "layer 7: main tensor 0 block bytes 1024 on Prefill != 2048 on Decode"},
      {"indexer bytes", [](LayerTensors& d) { d.bytes_per_block[2] = 32; },
       "layer 7: indexer block bytes 64 on Prefill != 32 on Decode"},
      {"scale bytes", [](LayerTensors& d) { d.bytes_per_block[3] = 4; },
       "layer 7: LIC8 scale block bytes 8 on Prefill != 4 on Decode"},
      {"scale presence",
       [](LayerTensors& d) {
         d.has_scale = false;
         d.base_addrs.pop_back();
         d.bytes_per_block.pop_back();
       },
       "LIC8 scale present on Prefill but absent on Decode"},
      {"indexer presence",
       [](LayerTensors& d) {
         d.has_indexer = d.has_scale = false;
         d.base_addrs.resize(2);
         d.bytes_per_block.resize(2);
       },
       "indexer present on Prefill but absent on Decode"},
      {"main count",
       [](LayerTensors& d) {
         d.main_tensor_count = 1;
         d.base_addrs.pop_back();
         d.bytes_per_block.pop_back();
       },
       "main tensor count 2 on Prefill != 1 on Decode"},
      {"shape", [](LayerTensors& d) { d.bytes_per_block.pop_back(); }, "expected 4"},
  };
  for (const auto& c : cases) {
    LayerTensors d = side(0x90000000);
    c.change(d);
    Status st = validate_layer(7, side(0x10000000), d);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << c.name;
    EXPECT_NE(st.message().find(c.expect), std::string::npos) << c.name << ": " << st.message();
  }
}

// Expands descriptors back into (tensor, source block) -> destination block, using the
// block size of the tensor each address falls in.
std::map<std::pair<size_t, int64_t>, int64_t> expand(const std::vector<ReadOp>& ds,
                                                     const LayerTensors& p, const LayerTensors& d) {
  std::map<std::pair<size_t, int64_t>, int64_t> blocks;
  for (const auto& x : ds) {
    size_t t = 0;
    while (t + 1 < p.base_addrs.size() && x.remote >= p.base_addrs[t + 1]) ++t;
    const uint64_t bytes = p.bytes_per_block[t];
    EXPECT_EQ(x.length % bytes, 0u);
    for (uint64_t off = 0; off < x.length; off += bytes) {
      auto src = static_cast<int64_t>((x.remote + off - p.base_addrs[t]) / bytes);
      auto dst = static_cast<int64_t>((x.local + off - d.base_addrs[t]) / bytes);
      EXPECT_TRUE(blocks.emplace(std::pair{t, src}, dst).second)
          << "tensor " << t << " source block " << src << " read twice";
    }
  }
  return blocks;
}

TEST(Descriptors, EveryTopologyReadsEachBlockExactlyOnceIntoItsDestination) {
  const LayerTensors p = side(0x10000000), d = side(0x90000000);
  struct Tp {
    int p_tp, d_tp;
  };
  for (Tp tp : {Tp{1, 1}, Tp{2, 2}, Tp{4, 2}, Tp{8, 2}, Tp{4, 1}, Tp{8, 4}}) {
    const int ratio = tp.p_tp / tp.d_tp;
    for (size_t n : {0u, 1u, 2u, 5u, 13u}) {
      for (int64_t start : {0, 1, 3}) {
        // Source blocks: runs of contiguous ids with gaps; destinations: a shuffled-looking list.
        Req req;
        req.ext_id = "r";
        for (size_t i = 0; i < n; ++i)
          req.main_block_ids.push_back(static_cast<int64_t>(i + i / 3));
        req.indexer_block_ids = req.main_block_ids;
        req.main_start = req.indexer_start = start;
        std::vector<int64_t> dest(static_cast<size_t>(start) + n);
        for (size_t i = 0; i < dest.size(); ++i) dest[i] = static_cast<int64_t>((i * 7) % 200);

        std::vector<ReadOp> main_all;
        for (int dr = 0; dr < tp.d_tp; ++dr) {
          std::vector<ReadOp> rank_indexer;
          for (int m = 0; m < ratio; ++m) {
            std::vector<ReadOp> out;
            ReadRole role{dr, tp.d_tp, m, ratio};
            ASSERT_TRUE(append_request_reads(p, d, {req.view(), dest, dest}, role, out).is_ok());
            for (const auto& x : out) {
              (x.remote < p.base_addrs[2] ? main_all : rank_indexer).push_back(x);
            }
          }
          // Each Decode rank ends up with the whole indexer and scale, each block once.
          auto idx = expand(rank_indexer, p, d);
          ASSERT_EQ(idx.size(), 2 * n) << tp.p_tp << ":" << tp.d_tp << " rank " << dr;
          for (size_t i = 0; i < n; ++i) {
            for (size_t t : {2u, 3u}) {
              EXPECT_EQ(idx.at({t, req.indexer_block_ids[i]}),
                        dest[static_cast<size_t>(start) + i]);
            }
          }
        }
        // Main KV: the Decode ranks' shares together read every block exactly once.
        auto main = expand(main_all, p, d);
        ASSERT_EQ(main.size(), 2 * n) << tp.p_tp << ":" << tp.d_tp << " n " << n;
        for (size_t i = 0; i < n; ++i) {
          for (size_t t : {0u, 1u}) {
            EXPECT_EQ(main.at({t, req.main_block_ids[i]}), dest[static_cast<size_t>(start) + i]);
          }
        }
      }
    }
  }
}

TEST(Descriptors, OnlyMemberZeroPullsMainKv) {
  const LayerTensors p = side(0x10000000), d = side(0x90000000);
  Req req{"r", {1, 2, 3, 4}, {1, 2, 3, 4}, 0, 0};
  std::vector<int64_t> dest{10, 11, 12, 13};
  std::vector<ReadOp> out;
  ASSERT_TRUE(append_request_reads(p, d, {req.view(), dest, dest}, {0, 1, 1, 2}, out).is_ok());
  for (const auto& x : out) EXPECT_GE(x.remote, p.base_addrs[2]) << "member 1 read main KV";
}

TEST(Descriptors, ContiguousRunsOnBothSidesCoalesce) {
  const LayerTensors p = side(0x10000000), d = side(0x90000000);
  Req req{"r", {4, 5, 6, 9}, {}, 0, 0};
  std::vector<int64_t> dest{20, 21, 30, 31}, none;
  LayerTensors p_main = p, d_main = d;
  p_main.has_indexer = d_main.has_indexer = p_main.has_scale = d_main.has_scale = false;
  p_main.base_addrs.resize(2);
  p_main.bytes_per_block.resize(2);
  d_main.base_addrs.resize(2);
  d_main.bytes_per_block.resize(2);
  std::vector<ReadOp> out;
  ASSERT_TRUE(
      append_request_reads(p_main, d_main, {req.view(), dest, none}, {0, 1, 0, 1}, out).is_ok());
  // Per tensor: 4,5 -> 20,21 merge; 6 -> 30 breaks (destination jumps); 9 -> 31 breaks
  // (source jumps). Tensors never merge with each other.
  ASSERT_EQ(out.size(), 6u);
  EXPECT_EQ(out[0].length, 2 * 1024u);
  EXPECT_EQ(out[0].remote, p.base_addrs[0] + 4 * 1024);
  EXPECT_EQ(out[0].local, d.base_addrs[0] + 20 * 1024);
  EXPECT_EQ(out[1].length, 1024u);
  EXPECT_EQ(out[3].length, 2 * 128u);
}

TEST(Descriptors, DestinationOutsideTheRequestOrAllocationAddsNothing) {
  const LayerTensors p = side(0x10000000), d = side(0x90000000);
  Req req{"r7", {1, 2, 3}, {1, 2, 3}, 2, 2};
  std::vector<int64_t> short_dest{0, 1, 2, 3};  // start 2 + 3 blocks needs 5
  std::vector<ReadOp> out{{1, 2, 3}};
  Status st = append_request_reads(p, d, {req.view(), short_dest, short_dest}, {0, 1, 0, 1}, out);
  EXPECT_EQ(st.code(), StatusCode::kOutOfRange);
  EXPECT_NE(st.message().find("request r7"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("destination index 4"), std::string::npos) << st.message();
  EXPECT_EQ(out.size(), 1u);

  std::vector<int64_t> beyond{0, 0, 5, 256, 7};  // block 256 of 256 allocated
  st = append_request_reads(p, d, {req.view(), beyond, beyond}, {0, 1, 0, 1}, out);
  EXPECT_EQ(st.code(), StatusCode::kOutOfRange);
  EXPECT_NE(st.message().find("destination block 256 is outside the 256 allocated"),
            std::string::npos)
      << st.message();
  EXPECT_EQ(out.size(), 1u);
}

TEST(Descriptors, AddressOverflowIsAnError) {
  LayerTensors p = side(0xffffffffffff0000ull), d = side(0x90000000);
  Req req{"r", {1000}, {}, 0, 0};
  std::vector<int64_t> dest{1};
  std::vector<ReadOp> out;
  Status st = append_request_reads(p, d, {req.view(), dest, dest}, {0, 1, 0, 1}, out);
  EXPECT_EQ(st.code(), StatusCode::kOutOfRange) << st.to_string();
  EXPECT_TRUE(out.empty());
}

}  // namespace
}  // namespace rd2h::layout
