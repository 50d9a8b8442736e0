#include "transfer/ucx_lanes.h"

#include <gtest/gtest.h>

namespace rd2h::transfer {
namespace {

using Set = std::set<std::string>;

TEST(UcxLanes, ParsesWhatUcxPrints) {
  struct Case {
    const char* name;
    const char* info;
    Set am, rma;
  };
  const Case cases[] = {
      {"shared memory",
       "#                 lane[0]:  0:sysv/memory.0 md[0]           -> md[0]/sysv/sysdev[255] am "
       "am_bw#0\n"
       "#                 lane[1]:  1:posix/memory.0 md[1]          -> md[1]/posix/sysdev[255]\n"
       "#                 lane[2]:  2:cma/memory.0 md[2]            -> md[2]/cma/sysdev[255] "
       "rma_bw#0\n"
       "#                 am_send: 0..<egr/short>..93..<egr/bcopy>..8256..<rndv>..(inf)\n",
       {"sysv"},
       {"cma"}},
      {"tcp",
       "#                 lane[0]:  0:tcp/lo.0 md[0]                -> md[0]/tcp/sysdev[255] "
       "rma_bw#0 am am_bw#0\n"
       "#                 lane[1]:  1:tcp/eth0.0 md[0]              -> md[0]/tcp/sysdev[255] "
       "rma_bw#1 wireup\n",
       {"tcp"},
       {"tcp"}},
      {"rdma",
       "#   lane[0]:  8:rc_mlx5/mlx5_0:1.0 md[4]  -> md[4]/ib/sysdev[255] rma_bw#0 am am_bw#0\n",
       {"rc_mlx5"},
       {"rc_mlx5"}},
      {"no lanes", "# UCP endpoint\n#  peer: <no debug data>\n", {}, {}},
  };
  for (const auto& c : cases) {
    auto lanes = parse_lane_transports(c.info);
    EXPECT_EQ(lanes.am, c.am) << c.name;
    EXPECT_EQ(lanes.rma, c.rma) << c.name;
  }
}

TEST(UcxLanes, RmaIsOneSidedOnlyWhenEveryLaneIs) {
  EXPECT_TRUE(rma_is_one_sided({"rc_mlx5"}));
  EXPECT_FALSE(rma_is_one_sided({"cma"}));
  EXPECT_TRUE(rma_is_one_sided({"rc_verbs", "dc_mlx5"}));
  EXPECT_FALSE(rma_is_one_sided({"tcp", "dc_mlx5"}));
  EXPECT_FALSE(rma_is_one_sided({"tcp"}));
  EXPECT_FALSE(rma_is_one_sided({"posix", "sysv"}));
  EXPECT_FALSE(rma_is_one_sided({}));
}

TEST(UcxLanes, JoinsNamesOrSaysUnknown) {
  EXPECT_EQ(join_transports({"sysv", "posix"}), "posix,sysv");
  EXPECT_EQ(join_transports({}), "unknown");
}

}  // namespace
}  // namespace rd2h::transfer
