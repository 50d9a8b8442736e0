// The simulator's inter-process pieces: the Decode ranks' all-gather over ZeroMQ and the
// shared main pool.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <future>
#include <thread>

#include "sim/rank_gather.h"
#include "sim/rank_set.h"
#include "sim/shared_pool.h"
#include "sim/sim_message.h"

namespace rd2h::sim {
namespace {

using namespace std::chrono_literals;

TEST(RankGather, EveryRankGetsEveryRanksSetInRankOrderRoundAfterRound) {
  constexpr int kSize = 3;
  auto root = RankGather::bind(kSize, "127.0.0.1", 10s);
  ASSERT_TRUE(root) << root.status().to_string();
  std::vector<std::unique_ptr<RankGather>> ranks;
  ranks.push_back(std::move(*root));
  for (int k = 1; k < kSize; ++k) {
    auto g = RankGather::connect(k, kSize, ranks[0]->url(), 10s);
    ASSERT_TRUE(g) << g.status().to_string();
    ranks.push_back(std::move(*g));
  }
  for (int round = 0; round < 3; ++round) {
    std::vector<std::future<Expected<std::vector<decode::RankTerminal>>>> results;
    for (int k = 0; k < kSize; ++k) {
      results.push_back(std::async(std::launch::async, [&, k] {
        decode::RankTerminal mine{
            {"req-" + std::to_string(round) + "-" + std::to_string(k), k == 1}};
        return ranks[static_cast<size_t>(k)]->function()(mine);
      }));
    }
    for (int k = 0; k < kSize; ++k) {
      auto got = results[static_cast<size_t>(k)].get();
      ASSERT_TRUE(got) << got.status().to_string();
      ASSERT_EQ(got->size(), static_cast<size_t>(kSize));
      for (int j = 0; j < kSize; ++j) {
        const auto& set = (*got)[static_cast<size_t>(j)];
        ASSERT_EQ(set.size(), 1u);
        EXPECT_EQ(set.begin()->first, "req-" + std::to_string(round) + "-" + std::to_string(j));
        EXPECT_EQ(set.begin()->second, j == 1);
      }
    }
  }
}

TEST(RankGather, ARankThatNeverComesTimesOutNamingTheMissing) {
  auto root = RankGather::bind(3, "127.0.0.1", 200ms);
  ASSERT_TRUE(root) << root.status().to_string();
  auto one = RankGather::connect(1, 3, (*root)->url(), 200ms);
  ASSERT_TRUE(one);
  auto late = std::async(std::launch::async, [&] { return (*one)->function()({}); });
  auto got = (*root)->function()({});
  ASSERT_FALSE(got);
  EXPECT_NE(got.status().message().find("1 of the other ranks did not gather in time"),
            std::string::npos)
      << got.status().to_string();
  EXPECT_FALSE(late.get()) << "rank 1 is not answered either";
}

TEST(SharedPool, RanksThatOpenItByNameShareItsBytesAndAnUnlinkedNameIsGone) {
  auto pool = SharedPool::create(1 << 20);
  ASSERT_TRUE(pool) << pool.status().to_string();
  auto other = SharedPool::open(pool->name(), 1 << 20);
  ASSERT_TRUE(other) << other.status().to_string();
  std::memset(pool->data() + 4096, 0x5a, 100);
  EXPECT_EQ(other->data()[4096 + 99], std::byte{0x5a});
  EXPECT_FALSE(SharedPool::open(pool->name(), 2 << 20)) << "smaller than asked";
  pool->unlink();
  auto gone = SharedPool::open(pool->name(), 1 << 20);
  ASSERT_FALSE(gone);
  EXPECT_NE(gone.status().message().find(pool->name()), std::string::npos);
  other->data()[0] = std::byte{1};  // still mapped after the unlink
  EXPECT_EQ(pool->data()[0], std::byte{1});
}

TEST(RankSet, TheCoreAndItsRanksTalkOverUnixSocketsInAPrivateDirectoryRemovedAtTheEnd) {
  std::string dir;
  {
    auto set = RankSet::start(RD2H_BINARY, 2, 30s);
    ASSERT_TRUE(set) << set.status().to_string();
    dir = (*set)->ipc_dir();
    struct stat st {};
    ASSERT_EQ(::stat(dir.c_str(), &st), 0) << dir;
    EXPECT_EQ(st.st_mode & 0777, 0700u) << dir;
    EXPECT_TRUE(std::filesystem::is_socket(dir + "/core"));
    // Rank 0's all-gather listens there too, and the others reach it.
    auto root = RankGather::bind_ipc(2, dir + "/gather", 10s);
    ASSERT_TRUE(root) << root.status().to_string();
    EXPECT_EQ((*root)->url(), "ipc://" + dir + "/gather");
    auto other = RankGather::connect(1, 2, (*root)->url(), 10s);
    ASSERT_TRUE(other);
    auto far = std::async(std::launch::async, [&] { return (*other)->function()({}); });
    auto near = (*root)->function()({});
    ASSERT_TRUE(near) << near.status().to_string();
    ASSERT_TRUE(far.get());
    EXPECT_EQ(near->size(), 2u);
  }
  EXPECT_FALSE(std::filesystem::exists(dir)) << dir << " outlived its engine";
}

TEST(SimMessage, DeepNestingIsRefusedNotACrash) {
  std::vector<std::byte> nested(60 << 10, std::byte{0x91});
  nested.push_back(std::byte{0xc0});
  EXPECT_TRUE(unpack(nested).is_discarded());
  EXPECT_EQ(unpack(pack({{"op", "step"}, {"seq", 3}})).value("seq", 0), 3);
}

TEST(SimMessage, NestingUpToTheLimitIsReadAndOneLevelMoreIsRefused) {
  auto nested = [](size_t levels) {
    std::vector<std::byte> m(levels, std::byte{0x91});  // an array of one item, `levels` deep
    m.push_back(std::byte{0x01});
    return m;
  };
  const nlohmann::json at_limit = unpack(nested(kMaxMessageDepth));
  ASSERT_FALSE(at_limit.is_discarded());
  const nlohmann::json* inner = &at_limit;
  for (size_t i = 0; i < kMaxMessageDepth; ++i) inner = &(*inner)[0];
  EXPECT_EQ(*inner, 1);
  EXPECT_TRUE(unpack(nested(kMaxMessageDepth + 1)).is_discarded());
  // A declared item count far beyond the bytes is refused without reading on.
  EXPECT_TRUE(unpack({std::byte{0xdd}, std::byte{0x7f}, std::byte{0xff}, std::byte{0xff},
                      std::byte{0xff}, std::byte{0x01}})
                  .is_discarded());
}

}  // namespace
}  // namespace rd2h::sim
