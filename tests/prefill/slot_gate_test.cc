#include "prefill/slot_gate.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

namespace rd2h::prefill {
namespace {

using namespace std::chrono_literals;

TEST(SlotGate, SettleReturnsOnceEveryEndpointAnswered) {
  SlotGate gate;
  const uint64_t g = gate.open(3, 2);
  gate.answer(g, true);
  EXPECT_FALSE(gate.answered());
  EXPECT_EQ(gate.settle(Deadline(0ms)).code(), StatusCode::kTimeout);
  std::thread answerer([&] { gate.answer(g, true); });
  EXPECT_TRUE(gate.settle(Deadline(10s)).is_ok());
  answerer.join();
  EXPECT_TRUE(gate.answered());
}

TEST(SlotGate, AGateWithNoEndpointsIsOpen) {
  SlotGate gate;
  gate.open(0, 0);
  EXPECT_TRUE(gate.answered());
  EXPECT_TRUE(gate.settle(Deadline(0ms)).is_ok());
}

TEST(SlotGate, TimeoutNamesTheLayerAndTheMissingAnswers) {
  SlotGate gate;
  const uint64_t g = gate.open(12, 3);
  gate.answer(g, true);
  Status st = gate.settle(Deadline(20ms));
  EXPECT_EQ(st.code(), StatusCode::kTimeout);
  EXPECT_NE(st.message().find("layer 12: 2 of 3 Decode endpoints"), std::string::npos)
      << st.message();
}

TEST(SlotGate, AFailedReadReleasesTheGateWithItsReason) {
  SlotGate gate;
  const uint64_t g = gate.open(5, 2);
  gate.answer(g, false, "decode rank 1: indexer block bytes 64 != 32");
  gate.answer(g, true);
  Status st = gate.settle(Deadline(10s));
  EXPECT_EQ(st.code(), StatusCode::kTransport);
  EXPECT_NE(st.message().find("layer 5: decode rank 1: indexer block bytes"), std::string::npos)
      << st.message();
  // The slot can be reused: the next owner starts clean.
  const uint64_t next = gate.open(8, 1);
  gate.answer(next, true);
  EXPECT_TRUE(gate.settle(Deadline(10s)).is_ok());
}

TEST(SlotGate, ALateAnswerForAnOlderOwnerCannotReleaseANewerOne) {
  SlotGate gate;
  const uint64_t old_gen = gate.open(1, 1);
  gate.fail("sender restarted");  // layer 1's answer never came in time
  EXPECT_FALSE(gate.settle(Deadline(10s)).is_ok());
  const uint64_t new_gen = gate.open(4, 1);  // layer 4 reuses the slot
  gate.answer(old_gen, true);                // layer 1's READ_DONE arrives late
  EXPECT_EQ(gate.settle(Deadline(20ms)).code(), StatusCode::kTimeout)
      << "the late answer released layer 4";
  gate.answer(new_gen, true);
  EXPECT_TRUE(gate.settle(Deadline(10s)).is_ok());
}

TEST(SlotGate, ExtraAnswersAreIgnored) {
  SlotGate gate;
  const uint64_t g = gate.open(2, 1);
  gate.answer(g, true);
  gate.answer(g, false, "duplicate");
  EXPECT_TRUE(gate.settle(Deadline(10s)).is_ok()) << "the extra answer's failure was taken";
}

TEST(SlotGate, FailWakesEveryWaiterAndOneRaisesIt) {
  SlotGate gate;
  gate.open(9, 4);
  std::atomic<int> failed{0}, returned{0};
  std::vector<std::thread> waiters;
  for (int i = 0; i < 3; ++i) {
    waiters.emplace_back([&] {
      const Status st = gate.settle(Deadline(30s));
      if (st.code() == StatusCode::kTransport) ++failed;
      if (st.code() != StatusCode::kTimeout) ++returned;
    });
  }
  gate.fail("the sender thread died");
  for (auto& w : waiters) w.join();
  EXPECT_EQ(returned.load(), 3) << "a waiter waited out its deadline";
  EXPECT_EQ(failed.load(), 1) << "the failure is raised once";
}

TEST(SlotGate, SettleRaisesEachFailureOnce) {
  SlotGate gate;
  uint64_t g = gate.open(3, 1);
  EXPECT_EQ(gate.settle(Deadline(10ms)).code(), StatusCode::kTimeout) << "the slot is still read";
  gate.answer(g, false, "boom");
  Status st = gate.settle(Deadline(10s));
  EXPECT_EQ(st.code(), StatusCode::kTransport) << "an unseen failure must reach the compute path";
  EXPECT_NE(st.message().find("layer 3: boom"), std::string::npos) << st.message();
  EXPECT_TRUE(gate.settle(Deadline(10s)).is_ok()) << "raised once, the slot is free";

  g = gate.open(6, 1);
  gate.answer(g, false, "again");
  EXPECT_EQ(gate.settle(Deadline(10s)).code(), StatusCode::kTransport) << "a new generation's";
}

}  // namespace
}  // namespace rd2h::prefill
