// The whole request lifecycle over real HTTP, ZeroMQ and UCX on loopback: a client talks to
// rd2h's proxy, which sends the request to a Decode engine (TP 2); Decode's connector posts
// the rendezvous to the proxy's metaserver; the proxy dispatches Prefill (TP 4, chunked
// prefill over two physical layer buffers); Prefill's workers publish every layer; Decode's
// workers read them, check every byte, and Decode answers the client.
#include <gtest/gtest.h>
#include <httplib.h>

#include <future>
#include <nlohmann/json.hpp>
#include <random>

#include "rd2h/metaserver/proxy.h"
#include "sim/engine.h"
#include "support/http_server.h"

namespace rd2h::sim {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

constexpr int kLayers = 4;

EngineConfig engine_config(connector::KvRole role, int tp) {
  EngineConfig c;
  c.connector.role = role;
  c.connector.engine_id = role == connector::KvRole::kProducer ? "prefill-0" : "decode-0";
  c.connector.kv_port = 1;
  c.connector.transport = transfer::Transport::kShm;
  c.connector.prefill_tp_size = 4;
  c.tp_size = tp;
  c.model.layers = kLayers;
  c.model.bytes_per_token = {64, 8, 16, 4};  // K, V, indexer, LIC8 scale
  c.model.prefill_slots = 2;
  c.token_budget = 48;
  c.worker_executable = RD2H_BINARY;  // one `rd2h worker` process per TP rank
  return c;
}

class HttpLifecycle : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937 rng(std::random_device{}());
    for (int attempt = 0; attempt < 20 && !decode_; ++attempt) {
      auto c = engine_config(connector::KvRole::kConsumer, 2);
      c.connector.kv_port = std::uniform_int_distribution<int>(20000, 60000)(rng);
      c.decode_cached_tokens = 32;  // a local prefix cache holds two blocks of long prompts
      auto e = Engine::start(c);
      if (e) decode_ = std::move(*e);
    }
    ASSERT_TRUE(decode_) << "no free Decode ports";
    auto p = Engine::start(engine_config(connector::KvRole::kProducer, 4));
    ASSERT_TRUE(p) << p.status().to_string();
    prefill_ = std::move(*p);
    metaserver::ProxyConfig pc;
    pc.prefill = {prefill_->origin()};
    pc.decode = {decode_->origin()};
    auto x = metaserver::Proxy::start(pc);
    ASSERT_TRUE(x) << x.status().to_string();
    proxy_ = std::move(*x);
  }
  void TearDown() override {
    proxy_.reset();
    prefill_.reset();
    decode_.reset();
  }
  httplib::Result post(const std::string& path, const json& body) {
    httplib::Client c(proxy_->url());
    c.set_read_timeout(120, 0);
    return c.Post(path, body.dump(), "application/json");
  }
  static std::string text(size_t n, char first) {
    std::string s;
    for (size_t i = 0; i < n; ++i) {
      s.push_back(static_cast<char>('a' + (static_cast<size_t>(first - 'a') + i) % 26));
    }
    return s;
  }

  std::unique_ptr<Engine> decode_, prefill_;
  std::unique_ptr<metaserver::Proxy> proxy_;
};

TEST_F(HttpLifecycle, ALongPromptIsChunkedTransferredVerifiedAndAnswered) {
  // 100 tokens: 7 blocks of 16, the last partial; Decode caches 2, Prefill sends 5 in
  // chunks of 48 tokens.
  auto r = post("/v1/completions",
                {{"model", "rd2h-sim"}, {"prompt", text(100, 'a')}, {"max_tokens", 4}});
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  ASSERT_EQ(r->status, 200) << r->body;
  const json out = json::parse(r->body);
  EXPECT_EQ(out["choices"][0]["text"], "yyyy");
  EXPECT_EQ(out["rd2h"]["verified_blocks"], 7 * kLayers) << "every block of every layer checked";
  EXPECT_GE(prefill_->stats().prefill_chunks, 3u) << "100 tokens in chunks of 48";
  EXPECT_EQ(proxy_->stats().prefill_dispatches, 1u);
}

TEST_F(HttpLifecycle, APromptListIsDispatchedToPrefillOnceAndEveryChildArrives) {
  auto r = post("/v1/completions", {{"model", "rd2h-sim"},
                                    {"prompt", {text(20, 'a'), text(70, 'c'), text(33, 'e')}},
                                    {"max_tokens", 2}});
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  ASSERT_EQ(r->status, 200) << r->body;
  const json out = json::parse(r->body);
  ASSERT_EQ(out["choices"].size(), 3u);
  // Blocks per prompt: 2 + 5 + 3.
  EXPECT_EQ(out["rd2h"]["verified_blocks"], (2 + 5 + 3) * kLayers);
  EXPECT_EQ(proxy_->stats().prefill_dispatches, 1u);
  EXPECT_EQ(proxy_->stats().rendezvous, 3u);
}

TEST_F(HttpLifecycle, ConcurrentChatAndStreamingRequestsAllComplete) {
  std::vector<std::thread> clients;
  std::vector<int> status(6, 0);
  for (int i = 0; i < 6; ++i) {
    clients.emplace_back([&, i] {
      json body;
      body["model"] = "rd2h-sim";
      body["max_tokens"] = 3;
      if (i % 2 == 0) {
        json message;
        message["role"] = "user";
        message["content"] = text(40 + static_cast<size_t>(i), 'k');
        body["messages"] = json::array({message});
        body["stream"] = true;
      } else {
        body["prompt"] = text(17 * static_cast<size_t>(i), 'p');
      }
      auto r = post(i % 2 == 0 ? "/v1/chat/completions" : "/v1/completions", body);
      status[static_cast<size_t>(i)] = r ? r->status : -1;
      if (r && i % 2 == 0) {
        EXPECT_NE(r->body.find("data: [DONE]"), std::string::npos) << r->body;
      }
    });
  }
  for (auto& t : clients) t.join();
  for (int i = 0; i < 6; ++i) EXPECT_EQ(status[static_cast<size_t>(i)], 200) << "client " << i;
  EXPECT_EQ(decode_->stats().failed_requests, 0u);
  EXPECT_EQ(proxy_->stats().prefill_dispatches, 6u);
}

TEST_F(HttpLifecycle, TwoHundredPromptsInOneRequestComplete) {
  json prompts = json::array();
  for (int i = 0; i < 200; ++i) prompts.push_back(text(9 + static_cast<size_t>(i % 7), 'a'));
  auto r = post("/v1/completions", {{"model", "rd2h-sim"}, {"prompt", prompts}, {"max_tokens", 1}});
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  ASSERT_EQ(r->status, 200) << r->body.substr(0, 500);
  const json out = json::parse(r->body);
  EXPECT_EQ(out["choices"].size(), 200u);
  EXPECT_EQ(out["rd2h"]["verified_blocks"], 200 * kLayers);
  EXPECT_EQ(proxy_->stats().rendezvous, 200u);
  EXPECT_EQ(proxy_->stats().prefill_dispatches, 1u);
}

TEST_F(HttpLifecycle, ASecondRequestWithTheIdOfOneInFlightIsRefused) {
  // Both sides know a request by its id: a second one under the same id would mix with it.
  // Decode generates 400 tokens for the first (one per step), so it stays in flight.
  httplib::Client c(decode_->origin());
  c.set_read_timeout(60, 0);
  const httplib::Headers id = {{"X-Request-Id", "same"}};
  const json body = {{"prompt", text(20, 'a')}, {"max_tokens", 400}};
  const uint64_t before = decode_->stats().requests;
  auto first = std::async(std::launch::async, [&] {
    return c.Post("/v1/completions", id, body.dump(), "application/json");
  });
  ASSERT_TRUE(rd2h::testing::eventually([&] { return decode_->stats().requests == before + 1; }));
  httplib::Client c2(decode_->origin());
  auto second = c2.Post("/v1/completions", id, body.dump(), "application/json");
  ASSERT_TRUE(second);
  EXPECT_EQ(second->status, 409) << second->body;
  EXPECT_NE(second->body.find("cmpl-same-0 is already in flight"), std::string::npos)
      << second->body;
  auto r = first.get();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  auto again = c2.Post("/v1/completions", id, json{{"prompt", "x"}, {"max_tokens", 1}}.dump(),
                       "application/json");
  ASSERT_TRUE(again);
  EXPECT_EQ(again->status, 200) << "the id is free once its request ended";
}

TEST_F(HttpLifecycle, AStreamedRequestToPrefillGetsItsOneToken) {
  httplib::Client c(prefill_->origin());
  auto r = c.Post("/v1/completions", json{{"prompt", text(30, 'q')}, {"stream", true}}.dump(),
                  "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_NE(r->body.find("data: [DONE]"), std::string::npos) << r->body;
}

TEST(SimEngine, AZeroTokenBudgetIsRefusedBeforeAnythingStarts) {
  EngineConfig c = engine_config(connector::KvRole::kProducer, 1);
  c.token_budget = 0;
  auto e = Engine::start(c);
  ASSERT_FALSE(e);
  EXPECT_NE(e.status().message().find("token budget must be at least 1"), std::string::npos)
      << e.status().to_string();
}

}  // namespace
}  // namespace rd2h::sim
