#include "util/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <vector>

#include "support/http_server.h"

namespace rd2h {
namespace {

using namespace std::chrono_literals;

// A gate jobs block on until it opens; it counts the jobs waiting at it.
class Gate {
 public:
  void pass() {
    std::unique_lock lock(mu_);
    ++waiting_;
    cv_.notify_all();
    cv_.wait_for(lock, 20s, [this] { return open_; });
    --waiting_;
  }
  void open() {
    std::lock_guard lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  // Whether `n` jobs wait at the gate within the bound.
  bool reached(int n) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, 20s, [&] { return waiting_ >= n; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int waiting_ = 0;
  bool open_ = false;
};

TEST(ThreadPool, StartsThreadsOnlyWhenWorkComesAndReusesAnIdleOne) {
  ThreadPool pool(4);
  EXPECT_EQ(pool.threads(), 0u);
  Gate first;
  ASSERT_TRUE(pool.run([&] { first.pass(); }));
  ASSERT_TRUE(first.reached(1));
  EXPECT_EQ(pool.threads(), 1u) << "threads were started before work came";
  first.open();
  ASSERT_TRUE(testing::eventually([&] { return pool.idle() == 1; }));
  Gate second;
  std::function<void()> job = [&] { second.pass(); };
  ASSERT_TRUE(pool.try_run(job));
  ASSERT_TRUE(second.reached(1));
  EXPECT_EQ(pool.threads(), 1u) << "an idle thread was not reused";
  second.open();
}

TEST(ThreadPool, TryRunRefusesWorkBeyondTheBoundAndTakesItOnceAThreadIsFree) {
  ThreadPool pool(2);
  Gate gate;
  for (int i = 0; i < 2; ++i) {
    std::function<void()> job = [&] { gate.pass(); };
    ASSERT_TRUE(pool.try_run(job));
  }
  ASSERT_TRUE(gate.reached(2));
  std::atomic<int> ran = 0;
  std::function<void()> third = [&] { ++ran; };
  EXPECT_FALSE(pool.try_run(third)) << "a third job was taken by a pool of two busy threads";
  EXPECT_TRUE(third) << "a refused job was consumed";
  EXPECT_EQ(pool.threads(), 2u);
  gate.open();
  ASSERT_TRUE(testing::eventually([&] { return pool.idle() == 2; }));
  EXPECT_TRUE(pool.try_run(third)) << "a free thread refused the job";
  pool.stop();
  EXPECT_EQ(ran, 1) << "the refused job ran too, or the taken one did not";
}

TEST(ThreadPool, RunQueuesBeyondTheBoundAndStopRunsEveryQueuedJobInOrder) {
  ThreadPool pool(1);
  Gate gate;
  std::vector<int> order;
  std::mutex mu;
  ASSERT_TRUE(pool.run([&] { gate.pass(); }));
  ASSERT_TRUE(gate.reached(1));
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(pool.run([&, i] {
      std::lock_guard lock(mu);
      order.push_back(i);
    }));
  }
  EXPECT_EQ(pool.threads(), 1u);
  gate.open();
  pool.stop();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4}));
}

TEST(ThreadPool, AStoppedPoolTakesNoMoreWork) {
  ThreadPool pool(2);
  pool.stop();
  bool ran = false;
  EXPECT_FALSE(pool.run([&] { ran = true; }));
  std::function<void()> job = [&] { ran = true; };
  EXPECT_FALSE(pool.try_run(job));
  pool.stop();  // again: nothing to do
  EXPECT_FALSE(ran);
  EXPECT_EQ(pool.threads(), 0u);
}

}  // namespace
}  // namespace rd2h
