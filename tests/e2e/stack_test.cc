// The stack an operator runs (a proxy over a Prefill and a Decode engine), as operators see
// it. A request nobody waits for any more is given up on every engine, at once: a client
// that hangs up on the proxy, streamed or not, and what a stopping proxy still has in
// flight. SIGTERM to a proxy or an engine drains it: new requests are refused while those in
// flight finish. GET /metrics counts what happened.
#include <gtest/gtest.h>
#include <httplib.h>

#include <future>
#include <optional>
#include <nlohmann/json.hpp>

#include "rd2h/metaserver/proxy.h"
#include "sim/engine.h"
#include "support/http_server.h"
#include "support/sim_engine.h"

namespace rd2h::sim {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

constexpr uint64_t kBlocks = 64;

class Stack : public ::testing::Test {
 protected:
  void SetUp() override {
    EngineConfig d = rd2h::testing::small_engine(connector::KvRole::kConsumer, kBlocks);
    d.test_recompute_after = recompute_after_;
    decode_ = rd2h::testing::start_decode(d);
    ASSERT_TRUE(decode_) << "no Decode engine came up";
    EngineConfig p = rd2h::testing::small_engine(connector::KvRole::kProducer, kBlocks);
    p.compute_min_layer_us = compute_min_layer_us_;
    auto prefill = Engine::start(p);
    ASSERT_TRUE(prefill) << prefill.status().to_string();
    prefill_ = std::move(*prefill);
    metaserver::ProxyConfig pc;
    pc.prefill = {prefill_->origin()};
    pc.decode = {decode_->origin()};
    pc.max_reissues = max_reissues_;
    auto proxy = metaserver::Proxy::start(pc);
    ASSERT_TRUE(proxy) << proxy.status().to_string();
    proxy_ = std::move(*proxy);
  }

  static json body(bool stream) {
    return {{"prompt", std::string(100, 'q')}, {"max_tokens", 2}, {"stream", stream}};
  }
  // Posts `b` to the proxy on a thread of its own, through `client`.
  std::future<httplib::Result> post(httplib::Client& client, const json& b) {
    client.set_read_timeout(120, 0);
    return std::async(std::launch::async, [&client, b] {
      return client.Post("/v1/completions", b.dump(), "application/json");
    });
  }
  // `origin` says it is draining: its /health is 503 (its body naming `health_says`, if
  // given), and a new request is refused 503 naming `why`.
  void expect_refusing(const std::string& origin, const std::string& health_says,
                       const std::string& why) {
    httplib::Client probe(origin);
    ASSERT_TRUE(rd2h::testing::eventually([&] {
      auto h = probe.Get("/health");
      return h && h->status == 503 && h->body.find(health_says) != std::string::npos;
    })) << origin
        << " does not say it is draining";
    auto refused = probe.Post("/v1/completions", body(false).dump(), "application/json");
    ASSERT_TRUE(refused);
    EXPECT_EQ(refused->status, 503) << refused->body;
    EXPECT_NE(refused->body.find(why), std::string::npos) << refused->body;
  }
  // Decode holds the request's blocks and Prefill has it.
  bool in_both_engines() {
    return decode_->stats().free_blocks < kBlocks && proxy_->stats().prefill_dispatches >= 1;
  }

  static std::optional<double> metric(const std::string& origin, const std::string& series) {
    return rd2h::testing::metric(origin, series);
  }

  uint64_t compute_min_layer_us_ = 1000000;  // each layer takes a second: requests stay long
  uint64_t recompute_after_ = 0;             // Decode ends streams "recomputed" after this
  int max_reissues_ = 3;
  std::unique_ptr<Engine> decode_, prefill_;
  std::unique_ptr<metaserver::Proxy> proxy_;
};

TEST_F(Stack, AClientThatHangsUpIsGivenUpOnDecodeWhichFreesItsBlocks) {
  for (const bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "streamed" : "not streamed");
    const auto before = decode_->stats().failed_requests;
    httplib::Client client(proxy_->url());
    auto answer = post(client, body(stream));
    ASSERT_TRUE(rd2h::testing::eventually([&] { return in_both_engines(); }));
    client.stop();  // the client hangs up while Prefill computes
    auto r = answer.get();
    EXPECT_FALSE(r && r->status == 200);
    // Given up, not finished: Decode ends the request as failed and has every block back.
    // (Kept, it would have held its blocks until Prefill finished and then succeeded.)
    EXPECT_TRUE(rd2h::testing::eventually([&] {
      const auto s = decode_->stats();
      return s.free_blocks == kBlocks && s.failed_requests == before + 1;
    })) << "free blocks " << decode_->stats().free_blocks;
    EXPECT_EQ(proxy_->stats().client_cancelled, stream ? 2u : 1u);
    // Counted as a cancellation, not as a failure of the engine's.
    EXPECT_TRUE(rd2h::testing::eventually([&] {
      return metric(decode_->origin(), R"(rd2h_engine_prompts_total{outcome="cancelled"})") ==
             (stream ? 2 : 1);
    }));
    EXPECT_EQ(metric(decode_->origin(), R"(rd2h_engine_prompts_total{outcome="failed"})"), 0);
  }
}

TEST_F(Stack, AClientThatHangsUpIsGivenUpOnPrefillBetweenItsSteps) {
  httplib::Client client(proxy_->url());
  // 100 tokens in chunks of 64: two Prefill steps of four seconds each.
  auto answer = post(client, body(false));
  ASSERT_TRUE(rd2h::testing::eventually(
      [&] { return in_both_engines() && prefill_->stats().requests == 1; }));
  client.stop();
  (void)answer.get();
  // Given up after its first step, not computed to the end: failed, every block back.
  EXPECT_TRUE(rd2h::testing::eventually([&] {
    const auto s = prefill_->stats();
    return s.free_blocks == kBlocks && s.failed_requests == 1;
  })) << "Prefill free blocks " << prefill_->stats().free_blocks << ", failed "
      << prefill_->stats().failed_requests;
  EXPECT_LE(prefill_->stats().prefill_chunks, 1u) << "its second chunk was computed";
}

TEST_F(Stack, ADrainingProxyRefusesNewRequestsAndLetsTheOnesInFlightFinish) {
  httplib::Client client(proxy_->url());
  auto answer = post(client, body(false));
  ASSERT_TRUE(rd2h::testing::eventually([&] { return in_both_engines(); }));
  auto drained = std::async(std::launch::async, [&] { return proxy_->drain(60s); });
  ASSERT_NO_FATAL_FAILURE(expect_refusing(proxy_->url(), "", "shutting down"));

  auto r = answer.get();
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_TRUE(drained.get()) << "the drain did not see the request finish";
  EXPECT_EQ(decode_->stats().failed_requests, 0u);
}

TEST_F(Stack, DrainingEnginesRefuseNewRequestsAndFinishTheOnesInFlight) {
  httplib::Client client(proxy_->url());
  auto answer = post(client, body(false));
  // In flight on both: Prefill took the dispatch (not only the proxy sent it).
  ASSERT_TRUE(rd2h::testing::eventually(
      [&] { return in_both_engines() && prefill_->stats().requests == 1; }));
  auto prefill_drained = std::async(std::launch::async, [&] { return prefill_->drain(60s); });
  auto decode_drained = std::async(std::launch::async, [&] { return decode_->drain(60s); });
  for (Engine* engine : {prefill_.get(), decode_.get()}) {
    ASSERT_NO_FATAL_FAILURE(expect_refusing(engine->origin(), "draining", "draining"));
  }
  auto r = answer.get();
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_TRUE(prefill_drained.get()) << "Prefill's drain did not see the request finish";
  EXPECT_TRUE(decode_drained.get()) << "Decode's drain did not see the request finish";
  EXPECT_EQ(decode_->stats().failed_requests, 0u);
  EXPECT_EQ(prefill_->stats().failed_requests, 0u);
}

TEST_F(Stack, WhatAStoppingProxyStillHasInFlightIsAbortedOnDecode) {
  httplib::Client client(proxy_->url());
  auto answer = post(client, body(false));
  ASSERT_TRUE(rd2h::testing::eventually([&] { return in_both_engines(); }));
  EXPECT_FALSE(proxy_->drain(0ms));
  proxy_.reset();
  auto r = answer.get();
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 503) << r->body;
  EXPECT_TRUE(rd2h::testing::eventually([&] {
    const auto s = decode_->stats();
    return s.free_blocks == kBlocks && s.failed_requests == 1;
  })) << "Decode still holds the blocks of a request no proxy waits for: free "
         << decode_->stats().free_blocks << ", failed " << decode_->stats().failed_requests;
}

class FastStack : public Stack {
 protected:
  void SetUp() override {
    compute_min_layer_us_ = 0;
    Stack::SetUp();
  }
};

TEST_F(FastStack, MetricsCountRequestsTransfersAndRendezvous) {
  httplib::Client client(proxy_->url());
  client.set_read_timeout(60, 0);
  for (const bool stream : {false, true}) {
    auto r = client.Post("/v1/completions", body(stream).dump(), "application/json");
    ASSERT_TRUE(r) << httplib::to_string(r.error());
    ASSERT_EQ(r->status, 200) << r->body;
  }
  auto refused = client.Post("/v1/completions", R"({"prompt": 5})", "application/json");
  ASSERT_TRUE(refused);
  const std::string proxy = proxy_->url();
  // A request is counted once its answer is written: a scrape may overtake the last count.
  auto counted = [&](const std::string& series, double n) {
    (void)rd2h::testing::eventually([&] { return metric(proxy, series).value_or(0) >= n; });
    return metric(proxy, series);
  };
  EXPECT_EQ(counted(R"(rd2h_http_requests_total{listener="api",route="/v1/completions",status="200"})",
                    2),
            2);
  EXPECT_EQ(counted(R"(rd2h_http_requests_total{listener="api",route="/v1/completions",status="400"})",
                    1),
            1);
  EXPECT_EQ(counted(R"(rd2h_http_request_duration_seconds_count{listener="api",route="/v1/completions"})",
                    3),
            3);
  // Only the scrape itself, once the connections of the requests before it are done.
  EXPECT_TRUE(rd2h::testing::eventually([&] {
    return metric(proxy, R"(rd2h_http_requests_in_flight{listener="api"})") == 1;
  }));
  EXPECT_EQ(metric(proxy, R"(rd2h_proxy_rendezvous_total{known="true"})"), 2);
  EXPECT_EQ(
      metric(proxy, "rd2h_proxy_prefill_dispatches_total{engine=\"" + prefill_->origin() + "\"}"),
      2);
  EXPECT_EQ(metric(proxy, "rd2h_proxy_time_to_first_token_seconds_count"), 1) << "one stream";
  EXPECT_TRUE(rd2h::testing::eventually([&] {
    return metric(proxy, "rd2h_proxy_upstream_in_flight{role=\"decode\",engine=\"" +
                             decode_->origin() + "\"}") == 0;
  }));

  const std::string decode = decode_->origin();
  // 100 tokens are 7 blocks of 16; a block of a layer is 16 x (64 + 8 + 16) bytes; 4 layers.
  EXPECT_EQ(metric(decode, "rd2h_kv_bytes_read_total"), 2.0 * 7 * 16 * 88 * 4);
  const auto reads = metric(decode, "rd2h_kv_reads_total");
  ASSERT_TRUE(reads);
  EXPECT_GE(*reads, 2.0 * 4) << "a read per layer at least";
  EXPECT_EQ(metric(decode, "rd2h_kv_layer_read_seconds_count"), reads);
  EXPECT_EQ(metric(decode, R"(rd2h_kv_layers_total{outcome="failed"})"), 0);
  EXPECT_EQ(metric(decode, "rd2h_metaserver_posts_delivered_total"), 2);
  EXPECT_EQ(metric(decode, R"(rd2h_engine_prompts_total{outcome="ok"})"), 2);
  // Two prompts of 100 tokens, 2 tokens asked for each; Prefill's one token is no answer's.
  EXPECT_EQ(metric(decode, "rd2h_engine_prompt_tokens_total"), 200);
  EXPECT_EQ(metric(decode, "rd2h_engine_generation_tokens_total"), 4);
  EXPECT_EQ(metric(prefill_->origin(), "rd2h_engine_prompt_tokens_total"), 200);
  EXPECT_EQ(metric(prefill_->origin(), "rd2h_engine_generation_tokens_total"), 0);
  // Series without a label, and each outcome's, are there from the start at 0.
  EXPECT_EQ(metric(decode, R"(rd2h_engine_prompts_total{outcome="cancelled"})"), 0);
  EXPECT_EQ(metric(proxy, "rd2h_proxy_decode_retries_total"), 0);
  // Layer reads take microseconds: the first bucket is 5 us.
  EXPECT_TRUE(metric(decode, R"(rd2h_kv_layer_read_seconds_bucket{le="5e-06"})").has_value());
  EXPECT_EQ(metric(decode, "rd2h_engine_time_to_first_token_seconds_count"), 2);
  EXPECT_EQ(metric(decode, "rd2h_engine_free_blocks"), kBlocks);
}

// Decode ends every stream "recomputed" after 3 tokens, as one that lost the KV does.
class RecomputingStack : public Stack {
 protected:
  void SetUp() override {
    compute_min_layer_us_ = 0;
    recompute_after_ = 3;
    Stack::SetUp();
  }
  // The data of every event of a stream, in order.
  static std::vector<std::string> events(const std::string& stream) {
    std::vector<std::string> out;
    size_t at = 0, end;
    while ((end = stream.find("\n\n", at)) != std::string::npos) {
      const std::string e = stream.substr(at, end - at);
      at = end + 2;
      if (e.rfind("data: ", 0) == 0) out.push_back(e.substr(6));
    }
    return out;
  }
};

TEST_F(RecomputingStack, AStreamDecodeRecomputesGoesOnInANewRoundAsOneAnswer) {
  const json completion = {{"prompt", std::string(100, 'q')},
                           {"max_tokens", 8},
                           {"stream", true},
                           {"stream_options", {{"include_usage", true}}}};
  json chat = {{"messages", {{{"role", "user"}, {"content", std::string(100, 'q')}}}},
               {"max_completion_tokens", 8},
               {"stream", true},
               {"stream_options", {{"include_usage", true}}}};
  uint64_t rounds_before = 0;
  for (const bool is_chat : {false, true}) {
    SCOPED_TRACE(is_chat ? "chat" : "completions");
    httplib::Client client(proxy_->url());
    client.set_read_timeout(60, 0);
    auto r = client.Post(is_chat ? "/v1/chat/completions" : "/v1/completions",
                         (is_chat ? chat : completion).dump(), "application/json");
    ASSERT_TRUE(r) << httplib::to_string(r.error());
    ASSERT_EQ(r->status, 200) << r->body;
    const auto data = events(r->body);
    ASSERT_FALSE(data.empty());
    EXPECT_EQ(data.back(), "[DONE]");
    std::string text, id;
    int finishes = 0, roles = 0, dones = 0;
    std::optional<json> usage;
    for (const auto& d : data) {
      if (d == "[DONE]") {
        ++dones;
        continue;
      }
      const json e = json::parse(d);
      ASSERT_FALSE(e.contains("error")) << d;
      if (id.empty()) id = e["id"];
      EXPECT_EQ(e["id"], id) << "one answer has one id";
      if (e.contains("usage") && e["usage"].is_object()) usage = e["usage"];
      if (e["choices"].empty()) continue;
      const json& c = e["choices"][0];
      EXPECT_FALSE(c.contains("stop_reason") && c["stop_reason"] == "recomputed") << d;
      if (!c["finish_reason"].is_null()) {
        ++finishes;
        EXPECT_EQ(c["finish_reason"], "length") << d;
      }
      if (is_chat) {
        if (c["delta"].contains("role")) ++roles;
        text += c["delta"].value("content", std::string());
      } else {
        text += c["text"].get<std::string>();
      }
    }
    EXPECT_EQ(dones, 1);
    EXPECT_EQ(finishes, 1);
    if (is_chat) {
      EXPECT_EQ(roles, 1);
    }
    EXPECT_EQ(text.size(), 8u) << "every token of the budget, across rounds: " << text;
    ASSERT_TRUE(usage);
    EXPECT_EQ((*usage)["prompt_tokens"], 100) << usage->dump();
    EXPECT_EQ((*usage)["completion_tokens"], 8) << usage->dump();
    const auto rounds = proxy_->stats().reissued;
    EXPECT_GE(rounds, rounds_before + 2) << "8 tokens, 3 at most per round";
    rounds_before = rounds;
    EXPECT_TRUE(rd2h::testing::eventually(
        [&] { return decode_->stats().free_blocks == kBlocks; }));
  }
  EXPECT_EQ(metric(proxy_->url(), "rd2h_proxy_recomputed_reissues_total"), rounds_before);
}

TEST_F(RecomputingStack, AWholeAnswerDecodeRecomputesGoesOnInANewRoundAsOneAnswer) {
  const json completion = {{"prompt", std::string(100, 'q')}, {"max_tokens", 8}};
  const json chat = {{"messages", {{{"role", "user"}, {"content", std::string(100, 'q')}}}},
                     {"max_completion_tokens", 8}};
  uint64_t rounds_before = 0;
  for (const bool is_chat : {false, true}) {
    SCOPED_TRACE(is_chat ? "chat" : "completions");
    httplib::Client client(proxy_->url());
    client.set_read_timeout(60, 0);
    auto r = client.Post(is_chat ? "/v1/chat/completions" : "/v1/completions",
                         (is_chat ? chat : completion).dump(), "application/json");
    ASSERT_TRUE(r) << httplib::to_string(r.error());
    ASSERT_EQ(r->status, 200) << r->body;
    const json a = json::parse(r->body);
    ASSERT_EQ(a["choices"].size(), 1u) << r->body;
    const json& c = a["choices"][0];
    const std::string text =
        is_chat ? c["message"]["content"].get<std::string>() : c["text"].get<std::string>();
    EXPECT_EQ(text.size(), 8u) << "every token of the budget, across rounds: " << r->body;
    EXPECT_EQ(c["finish_reason"], "length") << r->body;
    EXPECT_FALSE(c.contains("stop_reason") && c["stop_reason"] == "recomputed") << r->body;
    EXPECT_EQ(a["usage"]["prompt_tokens"], 100) << r->body;
    EXPECT_EQ(a["usage"]["completion_tokens"], 8) << r->body;
    EXPECT_EQ(a["usage"]["total_tokens"], 108) << r->body;
    const auto rounds = proxy_->stats().reissued;
    EXPECT_GE(rounds, rounds_before + 2) << "8 tokens, 3 at most per round";
    rounds_before = rounds;
  }
}

class RecomputingStackNoReissue : public RecomputingStack {
 protected:
  void SetUp() override {
    max_reissues_ = 0;
    RecomputingStack::SetUp();
  }
};

TEST_F(RecomputingStackNoReissue, WithReissuesOffTheClientSeesDecodesRecomputedEnd) {
  httplib::Client client(proxy_->url());
  client.set_read_timeout(60, 0);
  auto r = client.Post("/v1/completions",
                       json({{"prompt", std::string(100, 'q')}, {"max_tokens", 8}, {"stream", true}})
                           .dump(),
                       "application/json");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_NE(r->body.find(R"("stop_reason":"recomputed")"), std::string::npos) << r->body;
  // Not streamed, the same.
  r = client.Post("/v1/completions",
                  json({{"prompt", std::string(100, 'q')}, {"max_tokens", 8}}).dump(),
                  "application/json");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(json::parse(r->body)["choices"][0]["stop_reason"], "recomputed") << r->body;
  EXPECT_EQ(proxy_->stats().reissued, 0u);
}

}  // namespace
}  // namespace rd2h::sim
