#include "topology/topology.h"

#include <gtest/gtest.h>

#include <set>

namespace rd2h::topology {
namespace {

TEST(Topology, SupportedTopologiesMapEveryPrefillRank) {
  struct Case {
    int p_tp, d_tp, ratio;
  };
  for (auto c : {Case{1, 1, 1}, Case{2, 2, 1}, Case{4, 2, 2}, Case{8, 2, 4}, Case{4, 1, 4},
                 Case{16, 4, 4}}) {
    auto tp = make_tp_mapping(c.p_tp, c.d_tp);
    ASSERT_TRUE(tp) << c.p_tp << ":" << c.d_tp;
    EXPECT_EQ(tp->ratio, c.ratio);
    // Every Decode rank gets exactly `ratio` contributors, members 0..ratio-1.
    std::vector<std::set<int>> members(c.d_tp);
    for (int p = 0; p < c.p_tp; ++p) {
      auto pos = contributor_of(*tp, p);
      ASSERT_TRUE(pos);
      EXPECT_EQ(pos->d_rank, p / c.ratio);
      EXPECT_EQ(pos->group_member_idx, p % c.ratio);
      members[pos->d_rank].insert(pos->group_member_idx);
    }
    for (int d = 0; d < c.d_tp; ++d) {
      EXPECT_EQ(members[d].size(), static_cast<size_t>(c.ratio));
      auto group = contributor_group(*tp, d);
      ASSERT_TRUE(group);
      ASSERT_EQ(group->size(), static_cast<size_t>(c.ratio));
      for (int m = 0; m < c.ratio; ++m) {
        EXPECT_EQ(contributor_of(*tp, (*group)[m])->group_member_idx, m);
        EXPECT_EQ(contributor_of(*tp, (*group)[m])->d_rank, d);
      }
    }
  }
}

TEST(Topology, UnsupportedTopologiesAreRejectedNamingTheValues) {
  struct Case {
    int p_tp, d_tp;
    const char* expect;
  };
  for (auto c : {Case{2, 4, "Prefill TP 2 is smaller than Decode TP 4"},
                 Case{6, 4, "Prefill TP 6 is not a multiple of Decode TP 4"},
                 Case{0, 1, "got Prefill 0 and Decode 1"}, Case{4, -2, "Decode -2"}}) {
    auto tp = make_tp_mapping(c.p_tp, c.d_tp);
    ASSERT_FALSE(tp) << c.expect;
    EXPECT_NE(tp.status().message().find(c.expect), std::string::npos) << tp.status().message();
  }
}

TEST(Topology, RanksOutsideTheTopologyAreRejected) {
  auto tp = *make_tp_mapping(4, 2);
  EXPECT_FALSE(contributor_of(tp, 4));
  EXPECT_FALSE(contributor_of(tp, -1));
  EXPECT_FALSE(contributor_group(tp, 2));
  EXPECT_NE(contributor_of(tp, 4).status().message().find("Prefill rank 4 is outside 0..3"),
            std::string::npos);
}

TEST(Ports, BaseAndRankPortsFollowTheSpec) {
  EXPECT_EQ(*base_port(20000, 0, 4), 20000);
  EXPECT_EQ(*base_port(20000, 3, 4), 20012);
  EXPECT_EQ(*rank_port(20012, 3, 4), 20015);
  // Prefill rank 5 of 8 with Decode TP 2 (ratio 4) talks to Decode rank 1.
  auto tp = *make_tp_mapping(8, 2);
  EXPECT_EQ(*remote_rank_port(30000, tp, 5), 30001);
}

TEST(Ports, ThePortRangeIsChecked) {
  auto high = base_port(65530, 1, 8);  // 65538..65545
  ASSERT_FALSE(high);
  EXPECT_NE(high.status().message().find("highest rank port at 65545"), std::string::npos)
      << high.status().message();
  EXPECT_TRUE(base_port(65528, 0, 8));  // 65528..65535 fits exactly
  EXPECT_FALSE(base_port(0, 0, 1));
  EXPECT_FALSE(base_port(70000, 0, 1));
  EXPECT_FALSE(rank_port(65535, 1, 2));
  EXPECT_FALSE(rank_port(20000, 2, 2));
  auto tp = *make_tp_mapping(2, 2);
  auto bad = remote_rank_port(65535, tp, 1);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.status().message().find("65536"), std::string::npos) << bad.status().message();
}

}  // namespace
}  // namespace rd2h::topology
