// A request nobody waits for any more is given up on every engine, at once: a client that
// hangs up on the proxy, streamed or not, and what a stopping proxy still has in flight.
// SIGTERM to a proxy drains it: new requests are refused while those in flight finish.
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

constexpr uint64_t kBlocks = 64;

EngineConfig engine_config(connector::KvRole role) {
  EngineConfig c;
  c.connector.role = role;
  c.connector.transport = transfer::Transport::kShm;
  c.connector.prefill_tp_size = 1;
  c.tp_size = 1;
  c.model.layers = 4;
  c.model.block_size = 16;
  c.model.num_blocks = kBlocks;
  c.model.bytes_per_token = {64, 8, 16};
  c.worker_executable = RD2H_BINARY;
  return c;
}

class Cancellation : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937 rng(std::random_device{}());
    for (int attempt = 0; attempt < 20 && !decode_; ++attempt) {
      EngineConfig c = engine_config(connector::KvRole::kConsumer);
      c.connector.engine_id = "decode-0";
      c.connector.kv_port = std::uniform_int_distribution<int>(20000, 60000)(rng);
      if (auto e = Engine::start(c)) decode_ = std::move(*e);
    }
    ASSERT_TRUE(decode_) << "no Decode engine came up";
    // Each layer takes a second: a request stays in Prefill for seconds.
    EngineConfig p = engine_config(connector::KvRole::kProducer);
    p.connector.engine_id = "prefill-0";
    p.connector.kv_port = 1;
    p.compute_min_layer_us = 1000000;
    auto prefill = Engine::start(p);
    ASSERT_TRUE(prefill) << prefill.status().to_string();
    prefill_ = std::move(*prefill);
    metaserver::ProxyConfig pc;
    pc.prefill = {prefill_->origin()};
    pc.decode = {decode_->origin()};
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
  // Decode holds the request's blocks and Prefill has it.
  bool in_both_engines() {
    return decode_->stats().free_blocks < kBlocks && proxy_->stats().prefill_dispatches >= 1;
  }

  std::unique_ptr<Engine> decode_, prefill_;
  std::unique_ptr<metaserver::Proxy> proxy_;
};

TEST_F(Cancellation, AClientThatHangsUpIsGivenUpOnDecodeWhichFreesItsBlocks) {
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
  }
}

TEST_F(Cancellation, ADrainingProxyRefusesNewRequestsAndLetsTheOnesInFlightFinish) {
  httplib::Client client(proxy_->url());
  auto answer = post(client, body(false));
  ASSERT_TRUE(rd2h::testing::eventually([&] { return in_both_engines(); }));
  auto drained = std::async(std::launch::async, [&] { return proxy_->drain(60s); });
  httplib::Client probe(proxy_->url());
  ASSERT_TRUE(rd2h::testing::eventually([&] {
    auto h = probe.Get("/health");
    return h && h->status == 503;
  })) << "the proxy does not say it is draining";
  auto refused = probe.Post("/v1/completions", body(false).dump(), "application/json");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 503) << refused->body;
  EXPECT_NE(refused->body.find("shutting down"), std::string::npos) << refused->body;

  auto r = answer.get();
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_TRUE(drained.get()) << "the drain did not see the request finish";
  EXPECT_EQ(decode_->stats().failed_requests, 0u);
}

TEST_F(Cancellation, WhatAStoppingProxyStillHasInFlightIsAbortedOnDecode) {
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

}  // namespace
}  // namespace rd2h::sim
