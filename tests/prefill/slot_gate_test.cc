#include "prefill/slot_gate.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

namespace rd2h::prefill {
namespace {

using namespace std::chrono_literals;

TEST(SlotGate, WaitReturnsOnceEveryEndpointAnswered) {
  SlotGate gate;
  const uint64_t g = gate.open(3, 2);
  gate.answer(g, true);
  EXPECT_EQ(gate.wait(Deadline(0ms)).code(), StatusCode::kTimeout);
  std::thread answerer([&] { gate.answer(g, true); });
  EXPECT_TRUE(gate.wait(Deadline(10s)).is_ok());
  answerer.join();
}

TEST(SlotGate, AGateWithNoEndpointsIsOpen) {
  SlotGate gate;
  gate.open(0, 0);
  EXPECT_TRUE(gate.wait(Deadline(0ms)).is_ok());
}

TEST(SlotGate, TimeoutNamesTheLayerAndTheMissingAnswers) {
  SlotGate gate;
  const uint64_t g = gate.open(12, 3);
  gate.answer(g, true);
  Status st = gate.wait(Deadline(20ms));
  EXPECT_EQ(st.code(), StatusCode::kTimeout);
  EXPECT_NE(st.message().find("layer 12: 2 of 3 Decode endpoints"), std::string::npos)
      << st.message();
}

TEST(SlotGate, AFailedReadReleasesTheGateWithItsReason) {
  SlotGate gate;
  const uint64_t g = gate.open(5, 2);
  gate.answer(g, false, "decode rank 1: indexer block bytes 64 != 32");
  gate.answer(g, true);
  Status st = gate.wait(Deadline(10s));
  EXPECT_EQ(st.code(), StatusCode::kTransport);
  EXPECT_NE(st.message().find("layer 5: decode rank 1: indexer block bytes"), std::string::npos)
      << st.message();
  // The slot can be reused: the next owner starts clean.
  const uint64_t next = gate.open(8, 1);
  gate.answer(next, true);
  EXPECT_TRUE(gate.wait(Deadline(10s)).is_ok());
}

TEST(SlotGate, ALateAnswerForAnOlderOwnerCannotReleaseANewerOne) {
  SlotGate gate;
  const uint64_t old_gen = gate.open(1, 1);
  gate.fail("sender restarted");  // layer 1's answer never came in time
  EXPECT_FALSE(gate.wait(Deadline(10s)).is_ok());
  const uint64_t new_gen = gate.open(4, 1);  // layer 4 reuses the slot
  gate.answer(old_gen, true);                // layer 1's READ_DONE arrives late
  EXPECT_EQ(gate.wait(Deadline(20ms)).code(), StatusCode::kTimeout)
      << "the late answer released layer 4";
  EXPECT_EQ(gate.ignored_answers(), 1u);
  gate.answer(new_gen, true);
  EXPECT_TRUE(gate.wait(Deadline(10s)).is_ok());
}

TEST(SlotGate, ExtraAnswersAreIgnored) {
  SlotGate gate;
  const uint64_t g = gate.open(2, 1);
  gate.answer(g, true);
  gate.answer(g, false, "duplicate");
  EXPECT_TRUE(gate.wait(Deadline(10s)).is_ok());
  EXPECT_EQ(gate.ignored_answers(), 1u);
}

TEST(SlotGate, FailWakesEveryWaiter) {
  SlotGate gate;
  gate.open(9, 4);
  std::atomic<int> failed{0};
  std::vector<std::thread> waiters;
  for (int i = 0; i < 3; ++i) {
    waiters.emplace_back([&] {
      if (gate.wait(Deadline(30s)).code() == StatusCode::kTransport) ++failed;
    });
  }
  gate.fail("the sender thread died");
  for (auto& w : waiters) w.join();
  EXPECT_EQ(failed.load(), 3);
}

}  // namespace
}  // namespace rd2h::prefill

namespace rd2h::prefill {
namespace {

TEST(SlotGate, SettleRaisesAFailureOnlyIfNoWaitRaisedItYet) {
  using namespace std::chrono_literals;
  SlotGate gate;
  uint64_t g = gate.open(3, 1);
  EXPECT_EQ(gate.settle(Deadline(10ms)).code(), StatusCode::kTimeout) << "the slot is still read";
  gate.answer(g, false, "boom");
  Status st = gate.settle(Deadline(10s));
  EXPECT_EQ(st.code(), StatusCode::kTransport) << "an unseen failure must reach the compute path";
  EXPECT_NE(st.message().find("layer 3: boom"), std::string::npos) << st.message();
  EXPECT_TRUE(gate.settle(Deadline(10s)).is_ok()) << "raised once, the slot is free";
  EXPECT_FALSE(gate.wait(Deadline(10s)).is_ok()) << "wait still reports the generation's result";

  g = gate.open(6, 1);
  gate.answer(g, false, "again");
  EXPECT_FALSE(gate.wait(Deadline(10s)).is_ok());
  EXPECT_TRUE(gate.settle(Deadline(10s)).is_ok()) << "wait already raised it";
}

}  // namespace
}  // namespace rd2h::prefill
