// The simulator engine's HTTP API over real HTTP on loopback: its bearer token, bounded
// bodies and prompt lists, field types refused naming the field, and service while
// slow-loris connections are held.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "sim/engine.h"

namespace rd2h::sim {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

// A starved server answers after its idle or request deadlines (5 s, 30 s); a served one
// within a second, or a few under a sanitizer on a loaded machine.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr auto kAnsweredWithin = std::chrono::milliseconds(3000);
#else
constexpr auto kAnsweredWithin = std::chrono::milliseconds(1000);
#endif

constexpr const char* kToken = "engine-test-token";

class EngineHttp : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    EngineConfig c;
    c.connector.role = connector::KvRole::kProducer;
    c.connector.engine_id = "prefill-0";
    c.connector.kv_port = 1;
    c.connector.transport = transfer::Transport::kShm;
    c.connector.prefill_tp_size = 1;
    c.tp_size = 1;
    c.model.layers = 2;
    c.model.bytes_per_token = {64, 8, 16};
    c.worker_executable = RD2H_BINARY;
    c.token = kToken;
    c.max_body_bytes = 1 << 20;
    c.max_prompts = 4;
    c.max_prompt_tokens = 64;
    auto e = Engine::start(c);
    ASSERT_TRUE(e) << e.status().to_string();
    engine_ = std::move(*e).release();
  }
  static void TearDownTestSuite() {
    delete engine_;
    engine_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(engine_, nullptr); }

  static httplib::Result post(const json& body, const std::string& token = kToken) {
    httplib::Client c(engine_->origin());
    c.set_read_timeout(30s);
    httplib::Headers h;
    if (!token.empty()) h.emplace("Authorization", "Bearer " + token);
    return c.Post("/v1/completions", h, body.dump(), "application/json");
  }
  static int port() {
    const std::string o = engine_->origin();
    return std::stoi(o.substr(o.rfind(':') + 1));
  }
  static int connect_raw() {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port()));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    return fd;
  }

  static Engine* engine_;
};
Engine* EngineHttp::engine_ = nullptr;

TEST_F(EngineHttp, RequestsWithoutTheTokenAre401AndNothingRuns) {
  const uint64_t before = engine_->stats().requests;
  for (const std::string token : {"", "wrong", "engine-test-token-"}) {
    auto r = post({{"prompt", "abc"}, {"max_tokens", 1}}, token);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 401) << "token '" << token << "'";
  }
  httplib::Client c(engine_->origin());
  auto report = c.Get("/rd2h/report");
  ASSERT_TRUE(report);
  EXPECT_EQ(report->status, 401);
  EXPECT_EQ(engine_->stats().requests, before);
  auto ok = post({{"prompt", "abc"}, {"max_tokens", 1}});
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
  EXPECT_EQ(engine_->stats().requests, before + 1);
}

TEST_F(EngineHttp, WrongFieldTypesAndOverlongListsAre400NamingTheField) {
  const uint64_t before = engine_->stats().requests;
  const std::vector<std::pair<json, std::string>> cases = {
      {{{"prompt", 5}}, "prompt"},
      {{{"prompt", "abc"}, {"max_tokens", "x"}}, "max_tokens"},
      {{{"prompt", "abc"}, {"stream", 1}}, "stream"},
      {{{"prompt", "abc"}, {"kv_transfer_params", "str"}}, "kv_transfer_params"},
      {{{"prompt", "abc"}, {"kv_transfer_params", {{"remote_port", "x"}}}}, "remote_port"},
      {{{"prompt", "abc"}, {"kv_transfer_params", {{"do_remote_decode", 1}}}}, "do_remote_decode"},
      {{{"prompt", {"a", "b", "c", "d", "e"}}}, "limit is 4"},
      {{{"prompt", std::vector<int>(65, 1)}}, "limit is 64"},
      {{{"prompt", std::string(65, 'a')}}, "limit is 64"},
      {{{"prompt", {"a", json::array({1, "x"})}}}, "prompt[1]"},
  };
  for (const auto& [body, field] : cases) {
    auto r = post(body);
    ASSERT_TRUE(r) << body.dump();
    EXPECT_EQ(r->status, 400) << body.dump() << " -> " << r->body;
    EXPECT_NE(r->body.find(field), std::string::npos) << body.dump() << " -> " << r->body;
  }
  httplib::Client c(engine_->origin());
  auto r = c.Post("/v1/chat/completions", {{"Authorization", std::string("Bearer ") + kToken}},
                  R"({"messages": "hi"})", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_NE(r->body.find("messages"), std::string::npos) << r->body;
  EXPECT_EQ(engine_->stats().requests, before) << "a refused body registered requests";
}

TEST_F(EngineHttp, AChunkedBodyOverTheLimitIs413AndTheEngineStaysUp) {
  httplib::Client c(engine_->origin());
  c.set_read_timeout(10s);
  size_t sent = 0;
  const std::string chunk(64 << 10, ' ');
  auto r = c.Post(
      "/v1/completions", {{"Authorization", std::string("Bearer ") + kToken}},
      [&](size_t, httplib::DataSink& sink) {
        if (sent >= (64u << 20)) {
          sink.done();
          return true;
        }
        sent += chunk.size();
        return sink.write(chunk.data(), chunk.size());
      },
      "application/json");
  // The engine answers 413 once the body passes 1 MiB and closes; a client still sending
  // may see the close before the answer.
  if (r) {
    EXPECT_EQ(r->status, 413);
  }
  EXPECT_LT(sent, 64u << 20) << "the whole 64 MiB was read";
  auto ok = post({{"prompt", "abc"}, {"max_tokens", 1}});
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200);
}

TEST_F(EngineHttp, AReportIsServedWithin1sWhile200SlowLorisConnectionsAreHeld) {
  std::vector<int> fds;
  for (int i = 0; i < 200; ++i) fds.push_back(connect_raw());
  const std::string partial = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthoriz";
  for (size_t k = 0; k < 8; ++k) {
    for (int fd : fds) {
      [[maybe_unused]] ssize_t n = ::send(fd, partial.data() + k, 1, MSG_NOSIGNAL);
    }
  }
  httplib::Client c(engine_->origin());
  c.set_read_timeout(5s);
  const auto t0 = std::chrono::steady_clock::now();
  auto r = c.Get("/rd2h/report", {{"Authorization", std::string("Bearer ") + kToken}});
  const auto took = std::chrono::steady_clock::now() - t0;
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200);
  EXPECT_LT(took, kAnsweredWithin);
  for (int fd : fds) ::close(fd);
}

}  // namespace
}  // namespace rd2h::sim
