#include "util/subprocess.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

namespace rd2h {
namespace {

using namespace std::chrono_literals;

TEST(Subprocess, ReadsLinesAndExitStatus) {
  auto p = Subprocess::spawn({"/bin/sh", "-c", "echo one; echo two; exit 3"});
  ASSERT_TRUE(p) << p.status().to_string();
  EXPECT_EQ(*p->read_line(10s), "one");
  EXPECT_EQ(*p->read_line(10s), "two");
  auto status = p->wait(10s);
  ASSERT_TRUE(status);
  EXPECT_EQ(WEXITSTATUS(*status), 3);
}

TEST(Subprocess, ReadLineTimesOutOnASilentChild) {
  auto p = Subprocess::spawn({"/bin/cat"});
  ASSERT_TRUE(p);
  auto line = p->read_line(50ms);
  ASSERT_FALSE(line);
  EXPECT_EQ(line.status().code(), StatusCode::kTimeout);
  p->close_stdin();  // cat exits at end of input
  EXPECT_TRUE(p->wait(10s));
}

TEST(Subprocess, WritingToAnExitedChildIsAnErrorNotASignal) {
  auto p = Subprocess::spawn({"/bin/true"});
  ASSERT_TRUE(p);
  ASSERT_TRUE(p->wait(10s));
  Status st = p->write_line("anyone there?");
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
}

TEST(Subprocess, StopReturnsOnceTheChildIsStopped) {
  auto p = Subprocess::spawn({"/bin/cat"});
  ASSERT_TRUE(p);
  ASSERT_TRUE(p->stop(10s).is_ok());
  char state = 0;
  {
    FILE* f = std::fopen(("/proc/" + std::to_string(p->pid()) + "/stat").c_str(), "r");
    ASSERT_NE(f, nullptr);
    char comm[64];
    int pid = 0;
    ASSERT_EQ(std::fscanf(f, "%d %63s %c", &pid, comm, &state), 3);
    std::fclose(f);
  }
  EXPECT_EQ(state, 'T');
  p->kill(SIGCONT);
}

TEST(Subprocess, DestructorKillsAndReapsARunningChild) {
  pid_t pid = -1;
  {
    auto p = Subprocess::spawn({"/bin/cat"});
    ASSERT_TRUE(p);
    pid = p->pid();
  }
  EXPECT_NE(::kill(pid, 0), 0);  // gone, and reaped (no zombie keeps the pid)
}

}  // namespace
}  // namespace rd2h
