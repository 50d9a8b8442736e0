// rd2h pd-read as a user runs it: the real binary, its source and destination processes.
#include <gtest/gtest.h>
#include <httplib.h>
#include <sys/wait.h>

#include "metaserver/client.h"
#include "support/rd2h_run.h"
#include "util/subprocess.h"

namespace rd2h {
namespace {

using namespace std::chrono_literals;

const std::vector<std::string> kSmallPool = {
    "--layers",        "4",    "--blocks",       "12", "--main-bytes", "8192,1024",
    "--indexer-bytes", "1024", "--batch-blocks", "5",  "--batches",    "9"};

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

class PdRead : public ::testing::TestWithParam<std::vector<std::string>> {};

TEST_P(PdRead, VerifiesEveryByteAndReportsLatencyAndThroughput) {
  ToolRun r = run_rd2h(with(with({"pd-read"}, kSmallPool), GetParam()));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("verification: OK"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("9 batches of 5 random blocks x 3 tensors"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("p50"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("p99"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("GB/s"), std::string::npos) << r.output;
}

INSTANTIATE_TEST_SUITE_P(
    Modes, PdRead,
    ::testing::Values(std::vector<std::string>{"--transport", "shm"},
                      std::vector<std::string>{"--transport", "tcp"},
                      std::vector<std::string>{"--transport", "auto", "--memory", "register"},
                      std::vector<std::string>{"--transport", "tcp", "--memory", "register"}),
    [](const auto& info) {
      std::string name;
      for (size_t i = 1; i < info.param.size(); i += 2)
        name += (name.empty() ? "" : "_") + info.param[i];
      return name;
    });

TEST(PdReadErrors, UnreachableSourceExitsNonZeroNamingTheAddress) {
  // Port 1 on loopback has no listener in any sane test environment.
  ToolRun r =
      run_rd2h({"pd-read", "--role", "dest", "--connect", "127.0.0.1:1", "--timeout-ms", "2000"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("cannot connect to 127.0.0.1:1"), std::string::npos) << r.output;
}

TEST(PdReadErrors, SourceWhoseDestinationNeverComesFailsAtItsServeTimeoutNamingItsAddress) {
  const auto start = std::chrono::steady_clock::now();
  ToolRun r = run_rd2h({"pd-read", "--role", "source", "--layers", "1", "--blocks", "2",
                        "--main-bytes", "64", "--indexer-bytes", "0", "--serve-timeout", "1"});
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30s);
  EXPECT_NE(r.exit_code, 0);
  const size_t at = r.output.find("LISTENING ");
  ASSERT_NE(at, std::string::npos) << r.output;
  const std::string address = r.output.substr(at + 10, r.output.find('\n', at) - at - 10);
  EXPECT_NE(r.output.find("timeout: waiting for the destination: no destination asked " + address +
                          " for the handshake"),
            std::string::npos)
      << r.output;
}

TEST(PdReadErrors, ZeroByteTensorIsRejectedByName) {
  ToolRun r = run_rd2h({"pd-read", "--role", "source", "--main-bytes", "4096,0"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("tensor 1 has 0 bytes per block"), std::string::npos) << r.output;
}

TEST(PdReadErrors, BatchLargerThanThePoolIsRejected) {
  ToolRun r =
      run_rd2h(with({"pd-read", "--blocks", "4", "--layers", "2"},
                    {"--batch-blocks", "5", "--main-bytes", "4096", "--indexer-bytes", "0"}));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--batch-blocks must be in 1..4, got 5"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("verification: OK"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace rd2h

namespace rd2h::tools {
namespace {

TEST(BenchLayers, ReportsOverheadAndThroughputPerRequestCount) {
  auto r = run_rd2h({"bench", "layers", "--layers", "20", "--warmup", "5", "--requests", "1,4",
                     "--blocks", "8", "--main-bytes", "4096,512", "--indexer-bytes", "512"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (const char* part : {"overhead p50", "bare ZeroMQ", "4 requests, zeromq: overhead p50",
                           "4 requests, link: overhead p50"}) {
    EXPECT_NE(r.output.find(part), std::string::npos) << part << " missing:\n" << r.output;
  }
}

TEST(BenchLayers, RequestCountsThatDoNotSplitTheBlocksAreRefused) {
  auto r = run_rd2h({"bench", "layers", "--requests", "3", "--blocks", "8"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("3 requests do not split 8 blocks"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace rd2h::tools

namespace rd2h::tools {
namespace {

TEST(ProxyCommand, ServesUntilSigtermAndNamesItsAddresses) {
  Subprocess::Options options;
  options.merge_stderr = true;
  auto p = Subprocess::spawn({RD2H_BINARY, "proxy", "--prefill", "http://127.0.0.1:9",
                              "--decode", "http://127.0.0.1:10"},
                             options);
  ASSERT_TRUE(p) << p.status().to_string();
  auto line = p->read_line(30s);
  ASSERT_TRUE(line) << line.status().to_string();
  EXPECT_NE(line->find("serving http://127.0.0.1:"), std::string::npos) << *line;
  EXPECT_NE(line->find("/v1/metaserver"), std::string::npos) << *line;
  p->kill(SIGTERM);
  auto status = p->wait(30s);
  ASSERT_TRUE(status) << status.status().to_string();
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0);
}

// The proxy as a process, and the origin its first line names.
std::pair<Subprocess, std::string> proxy_process(std::vector<std::string> extra) {
  Subprocess::Options options;
  options.merge_stderr = true;
  std::vector<std::string> argv = {RD2H_BINARY, "proxy", "--prefill", "http://127.0.0.1:9",
                                   "--decode", "http://127.0.0.1:10"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  auto p = Subprocess::spawn(argv, options);
  EXPECT_TRUE(p) << p.status().to_string();
  auto line = p->read_line(30s);
  EXPECT_TRUE(line) << line.status().to_string();
  const size_t at = line ? line->find("http://") : std::string::npos;
  std::string origin = at == std::string::npos ? "" : line->substr(at, line->find(' ', at) - at);
  return {std::move(*p), origin};
}

TEST(ProxyCommand, EveryRequestGetsOneAccessLogLine) {
  auto [p, origin] = proxy_process({});
  ASSERT_FALSE(origin.empty());
  httplib::Client c(origin);
  auto r = c.Post("/v1/completions", {{"X-Request-Id", "access-7"}}, R"({"prompt": 5})",
                  "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  auto v = c.Get("/version");
  ASSERT_TRUE(v);
  std::string lines;
  bool completion = false;
  while (!completion || lines.find("GET /version 200") == std::string::npos) {
    auto line = p.read_line(10s);
    ASSERT_TRUE(line) << "no access log line; the proxy printed:\n" << lines;
    lines += *line + "\n";
    completion = completion || line->find("[info] client API: access-7 POST /v1/completions "
                                          "400 ") != std::string::npos;
  }
  EXPECT_NE(lines.find(" ms"), std::string::npos) << lines;
}

TEST(ProxyCommand, ABadLogLevelIsRefusedNamingIt) {
  auto r = run_rd2h({"proxy", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:10",
                     "--log-level", "loud"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("log level 'loud' is not one of trace, debug, info, warn"),
            std::string::npos)
      << r.output;
}

TEST(ProxyCommand, AtLevelWarnNoAccessLinesArePrinted) {
  auto [p, origin] = proxy_process({"--log-level", "warn"});
  ASSERT_FALSE(origin.empty());
  httplib::Client c(origin);
  ASSERT_TRUE(c.Get("/version"));
  p.kill(SIGTERM);
  auto rest = p.read_all(30s);
  ASSERT_TRUE(rest);
  EXPECT_EQ(rest->find("GET /version"), std::string::npos) << *rest;
  EXPECT_NE(rest->find("stopped after"), std::string::npos) << *rest;
}

TEST(ProxyCommand, AnEngineAddressThatIsNotAnOriginIsRefused) {
  auto r = run_rd2h({"proxy", "--prefill", "127.0.0.1:9", "--decode", "http://127.0.0.1:10"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("--prefill: '127.0.0.1:9' is not http://host:port"), std::string::npos)
      << r.output;
  // Hosts that are neither names nor addresses are refused at the start, naming the flag.
  for (const std::string host : {"10.0.0.256", "", "192.0.0.3192.0.0.3", "-a.example", "a_b"}) {
    SCOPED_TRACE(host);
    r = run_rd2h(
        {"proxy", "--prefill", "http://127.0.0.1:9", "--decode", "http://" + host + ":10"});
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("--decode: 'http://" + host + ":10' is not http://host:port"),
              std::string::npos)
        << r.output;
  }
  r = run_rd2h({"proxy", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:0"});
  EXPECT_NE(r.output.find("port '0' is not in 1..65535"), std::string::npos) << r.output;
}

TEST(ProxyCommand, EngineAddressesByNameOrAddressAreTaken) {
  for (const std::string origin :
       {"http://localhost:10", "http://decode-3.pd.svc.cluster.local:8000", "http://[::1]:10"}) {
    EXPECT_TRUE(metaserver::parse_origin(origin)) << origin;
  }
}

}  // namespace
}  // namespace rd2h::tools
