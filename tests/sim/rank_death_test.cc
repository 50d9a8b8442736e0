// A crash is a death, and a death is noticed: a TP rank process that faults dies (UCX's
// handlers of error signals, which can leave a faulted process hung, are off in rd2h's
// processes), and its engine fails what it was running, naming the rank and how it ended,
// long before its step deadline; from then on its /health is 503 naming the rank. An engine
// killed outright leaves nothing the next one keeps.
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "sim/engine.h"
#include "support/http_server.h"
#include "support/processes.h"
#include "util/subprocess.h"

namespace rd2h::sim {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;  // the sanitizer handles SIGSEGV itself, then exits
#else
constexpr bool kSanitized = false;
#endif

// The signals a process catches, from /proc/<pid>/status.
uint64_t caught_signals(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("SigCgt:", 0) == 0) return std::stoull(line.substr(7), nullptr, 16);
  }
  ADD_FAILURE() << "no SigCgt for pid " << pid;
  return 0;
}

bool catches(uint64_t set, int signal) {
  return (set >> (signal - 1)) & 1;
}

// This process's children running `rd2h worker`.
std::vector<pid_t> rank_processes() {
  return rd2h::testing::workers_of(getpid());
}

EngineConfig two_rank_prefill();

TEST(RankDeath, ARankThatOverflowsItsStackDiesAndItsEngineSaysSoAtOnce) {
  EngineConfig c = two_rank_prefill();
  c.request_timeout = 20s;  // the step deadline is longer still
  c.test_fault_rank = 1;
  auto engine = Engine::start(c);
  ASSERT_TRUE(engine) << engine.status().to_string();
  // UCX's handler may print a backtrace and die, or hang (a lock the fault interrupted):
  // the ranks have none, and leave the fault to the kernel.
  const auto ranks = rank_processes();
  EXPECT_EQ(ranks.size(), 2u);
  for (pid_t rank : ranks) {
    if (kSanitized) break;  // the sanitizer catches SIGSEGV itself
    const uint64_t set = caught_signals(rank);
    for (int s : {SIGSEGV, SIGBUS, SIGILL, SIGFPE}) {
      EXPECT_FALSE(catches(set, s)) << "rank pid " << rank << " catches signal " << s;
    }
  }

  httplib::Client client((*engine)->origin());
  client.set_read_timeout(60, 0);
  auto r = client.Post("/v1/completions", json{{"prompt", "a prompt"}, {"max_tokens", 1}}.dump(),
                       "application/json");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 500) << r->body;
  // A rank hung in a signal handler would be "did not answer its 'step' job in time", after
  // the deadline, and the request would time out first.
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      r->body, m,
      std::regex(R"(TP rank 1 \(pid (\d+)\) (was killed by signal (\d+)|exited with status \d+))")))
      << r->body;
  if (!kSanitized) {
    EXPECT_EQ(m[3].str(), std::to_string(SIGSEGV)) << r->body;
  }
  const pid_t pid = std::stoi(m[1].str());
  EXPECT_EQ(::kill(pid, 0), -1) << "rank 1 (pid " << pid << ") is still there";
  EXPECT_EQ(errno, ESRCH);
  // The engine cannot serve any more, and says so: to probes, and to new requests at once.
  auto health = client.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 503) << health->body;
  EXPECT_NE(health->body.find("TP rank 1 (pid " + m[1].str() + ")"), std::string::npos)
      << health->body;
  auto next = client.Post("/v1/completions", json{{"prompt", "another"}, {"max_tokens", 1}}.dump(),
                          "application/json");
  ASSERT_TRUE(next);
  EXPECT_EQ(next->status, 503) << next->body;
  EXPECT_NE(next->body.find("TP rank 1"), std::string::npos) << next->body;
}

EngineConfig two_rank_prefill() {
  EngineConfig c;
  c.connector.role = connector::KvRole::kProducer;
  c.connector.engine_id = "prefill-0";
  c.connector.kv_port = 1;
  c.connector.transport = transfer::Transport::kShm;
  c.connector.prefill_tp_size = 2;
  c.tp_size = 2;
  c.model.layers = 2;
  c.model.bytes_per_token = {64, 8, 16};
  c.worker_executable = RD2H_BINARY;
  return c;
}

TEST(RankDeath, ARankKilledWhileTheEngineIsIdleMakesItsHealth503NamingTheRank) {
  auto engine = Engine::start(two_rank_prefill());
  ASSERT_TRUE(engine) << engine.status().to_string();
  httplib::Client client((*engine)->origin());
  auto before = client.Get("/health");
  ASSERT_TRUE(before);
  EXPECT_EQ(before->status, 200) << before->body;
  const auto ranks = rank_processes();
  ASSERT_EQ(ranks.size(), 2u);
  ASSERT_EQ(::kill(ranks[1], SIGKILL), 0);
  std::string body;
  ASSERT_TRUE(rd2h::testing::eventually([&] {
    auto h = client.Get("/health");
    body = h ? h->body : "";
    return h && h->status == 503;
  })) << "a dead rank goes unnoticed: "
      << body;
  EXPECT_NE(body.find("(pid " + std::to_string(ranks[1]) + ") was killed by signal " +
                      std::to_string(SIGKILL)),
            std::string::npos)
      << body;
}

// The directory an `rd2h prefill` process holds its rank sockets in (the one whose owner
// lock it holds open).
std::optional<std::filesystem::path> private_dir_of(pid_t pid) {
  std::error_code ec;
  for (const auto& fd :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec)) {
    const auto target = std::filesystem::read_symlink(fd.path(), ec);
    if (!ec && target.filename() == "owner" &&
        target.parent_path().filename().string().rfind("rd2h-sim-", 0) == 0) {
      return target.parent_path();
    }
  }
  return std::nullopt;
}

TEST(RankDeath, AnEngineKilledWithSigkillLeavesNothingTheNextStartKeeps) {
  auto p = Subprocess::spawn({RD2H_BINARY, "prefill", "--layers", "2", "--num-blocks", "8",
                              "--kv-transfer-config",
                              R"({"kv_connector":"rd2h","kv_role":"kv_producer","kv_port":1})"});
  ASSERT_TRUE(p) << p.status().to_string();
  for (;;) {
    auto line = p->read_line(60s);
    ASSERT_TRUE(line) << line.status().to_string();
    if (line->find("serving") != std::string::npos) break;
  }
  const auto dir = private_dir_of(p->pid());
  ASSERT_TRUE(dir) << "no private directory held by pid " << p->pid();
  p->kill(SIGKILL);
  ASSERT_TRUE(p->wait(30s));
  ASSERT_TRUE(std::filesystem::exists(*dir)) << "a killed process cannot clean up: nothing to see";
  // Long enough ago that it cannot be an engine starting up.
  const auto old = std::filesystem::file_time_type::clock::now() - std::chrono::minutes(5);
  std::filesystem::last_write_time(*dir, old);
  auto next = Engine::start(two_rank_prefill());
  ASSERT_TRUE(next) << next.status().to_string();
  EXPECT_FALSE(std::filesystem::exists(*dir)) << *dir << " is still there";
  const auto mine = private_dir_of(getpid());
  ASSERT_TRUE(mine);
  EXPECT_TRUE(std::filesystem::exists(*mine)) << "the live engine's own directory went";
}

// Starts `rd2h proxy` with `env` and returns what it catches once it serves.
uint64_t proxy_caught_signals(const std::vector<std::string>& env) {
  Subprocess::Options options;
  options.extra_env = env;
  auto p = Subprocess::spawn(
      {RD2H_BINARY, "proxy", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"},
      options);
  EXPECT_TRUE(p) << p.status().to_string();
  if (!p) return 0;
  for (;;) {
    auto line = p->read_line(30s);
    EXPECT_TRUE(line) << line.status().to_string();
    if (!line) return 0;
    if (line->find("serving") != std::string::npos) break;
  }
  const uint64_t set = caught_signals(p->pid());
  p->kill(SIGTERM);
  EXPECT_TRUE(p->wait(30s));
  return set;
}

TEST(RankDeath, Rd2hProcessesLeaveFaultSignalsToTheKernel) {
  if (kSanitized) GTEST_SKIP() << "the sanitizer catches SIGSEGV itself";
  // Asked for UCX's handlers, the process has them: what the check below would see without
  // rd2h turning them off.
  EXPECT_TRUE(catches(proxy_caught_signals({"UCX_ERROR_SIGNALS=SEGV"}), SIGSEGV));
  // Not asked (UCX's default is to handle SIGSEGV, SIGBUS, SIGILL and SIGFPE): none.
  unsetenv("UCX_ERROR_SIGNALS");
  const uint64_t set = proxy_caught_signals({});
  for (int s : {SIGSEGV, SIGBUS, SIGILL, SIGFPE}) EXPECT_FALSE(catches(set, s)) << "signal " << s;
}

}  // namespace
}  // namespace rd2h::sim
