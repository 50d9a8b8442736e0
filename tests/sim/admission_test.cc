// A Decode engine admits a prompt list whole: the list waits, holding no block, until all its
// prompts fit at once (Prefill starts only once every prompt has its blocks), and a list that
// could never fit is refused at once, naming what it needs and what the engine has.
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

constexpr int kLayers = 2;
constexpr uint64_t kBlocks = 16;  // of 16 tokens, on each engine

EngineConfig engine_config(connector::KvRole role) {
  EngineConfig c;
  c.connector.role = role;
  c.connector.engine_id = role == connector::KvRole::kProducer ? "prefill-0" : "decode-0";
  c.connector.kv_port = 1;
  c.connector.transport = transfer::Transport::kShm;
  c.connector.prefill_tp_size = 1;
  c.tp_size = 1;
  c.model.layers = kLayers;
  c.model.block_size = 16;
  c.model.bytes_per_token = {64, 8, 16};
  c.model.num_blocks = kBlocks;
  c.token_budget = 256;
  c.request_timeout = 30s;
  c.worker_executable = RD2H_BINARY;
  return c;
}

std::string text(size_t n) {
  std::string s;
  for (size_t i = 0; i < n; ++i) s.push_back(static_cast<char>('a' + i % 26));
  return s;
}

class Admission : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937 rng(std::random_device{}());
    for (int attempt = 0; attempt < 20 && !decode_; ++attempt) {
      auto c = engine_config(connector::KvRole::kConsumer);
      c.connector.kv_port = std::uniform_int_distribution<int>(20000, 60000)(rng);
      auto e = Engine::start(c);
      if (e) decode_ = std::move(*e);
    }
    ASSERT_TRUE(decode_) << "no free Decode ports";
    auto p = Engine::start(engine_config(connector::KvRole::kProducer));
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
  static httplib::Result post(const std::string& origin, const json& body,
                              const std::string& id = "") {
    httplib::Client c(origin);
    c.set_read_timeout(120, 0);
    httplib::Headers headers;
    if (!id.empty()) headers.emplace("X-Request-Id", id);
    return c.Post("/v1/completions", headers, body.dump(), "application/json");
  }
  std::future<httplib::Result> post_async(const std::string& origin, const json& body,
                                          const std::string& id = "") {
    return std::async(std::launch::async, [=] { return post(origin, body, id); });
  }

  std::unique_ptr<Engine> decode_, prefill_;
  std::unique_ptr<metaserver::Proxy> proxy_;
};

TEST_F(Admission, AListWaitsHoldingNoBlockUntilItFitsWholeThenCompletes) {
  // A request whose Prefill the test holds back keeps 10 of Decode's 16 blocks.
  rd2h::testing::MetaserverStub held_back(200);
  const json held = {{"prompt", text(150)},
                     {"max_tokens", 2},
                     {"kv_transfer_params",
                      {{"do_remote_decode", false},
                       {"do_remote_prefill", true},
                       {"metaserver", held_back.url()}}}};
  auto first = post_async(decode_->origin(), held, "held");
  ASSERT_TRUE(rd2h::testing::eventually(
      [&] { return held_back.bodies().size() == 1 && decode_->stats().free_blocks == 6; }));

  // Two prompts of 4 blocks each: 8 at once, more than the 6 free. Neither takes any, and
  // a small request behind the list waits its turn.
  auto list = post_async(proxy_->url(), {{"prompt", {text(60), text(60)}}, {"max_tokens", 2}});
  ASSERT_TRUE(rd2h::testing::eventually([&] {
    const auto s = decode_->stats();
    return s.waiting_for_blocks == 2 && s.free_blocks == 6;
  })) << "the list took blocks for some of its prompts while waiting for the rest";
  auto small = post_async(proxy_->url(), {{"prompt", text(10)}, {"max_tokens", 2}});
  ASSERT_TRUE(rd2h::testing::eventually([&] {
    const auto s = decode_->stats();
    return s.waiting_for_blocks == 3 && s.free_blocks == 6;
  }));
  EXPECT_EQ(proxy_->stats().rendezvous, 0u) << "no prompt of the list posted its rendezvous";

  // Prefill for the held request, as the proxy would dispatch it: Decode frees its blocks,
  // the list gets all it needs, then the small request.
  json prefill_body = held;
  prefill_body["max_tokens"] = 1;
  prefill_body["kv_transfer_params"] = json::parse(held_back.bodies()[0]);
  auto prefilled = post(prefill_->origin(), prefill_body, "held");
  ASSERT_TRUE(prefilled);
  EXPECT_EQ(prefilled->status, 200) << prefilled->body;
  for (auto* f : {&first, &list, &small}) {
    auto r = f->get();
    ASSERT_TRUE(r) << httplib::to_string(r.error());
    EXPECT_EQ(r->status, 200) << r->body;
  }
  EXPECT_EQ(proxy_->stats().rendezvous, 3u);
  EXPECT_EQ(decode_->stats().failed_requests, 0u);
  EXPECT_TRUE(rd2h::testing::eventually([&] { return decode_->stats().free_blocks == kBlocks; }));
}

TEST_F(Admission, AListThatCanNeverFitIsRefusedAtOnceNamingItsBlocksAndTheCapacity) {
  // 10 blocks per prompt, 20 at once: more than the engine has at all.
  auto r = post(proxy_->url(), {{"prompt", {text(150), text(150)}}, {"max_tokens", 2}});
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 400) << r->body;
  EXPECT_NE(r->body.find("the list of 2 prompts and up to 2 generated each needs 20 blocks of "
                         "KV cache at once; the engine holds 256 tokens (16 blocks of 16)"),
            std::string::npos)
      << r->body;

  r = post(proxy_->url(), {{"prompt", text(300)}, {"max_tokens", 2}}, "long");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 400) << r->body;
  EXPECT_NE(r->body.find("of 300 prompt tokens and up to 2 generated needs 19 blocks of KV "
                         "cache; the engine holds 256 tokens"),
            std::string::npos)
      << r->body;
  const json error = json::parse(r->body)["error"];
  EXPECT_EQ(error["type"], "invalid_request_error");
  EXPECT_EQ(error["param"], "prompt");
  EXPECT_EQ(error["code"], "context_length_exceeded");
  EXPECT_EQ(proxy_->stats().rendezvous, 0u);
  EXPECT_EQ(proxy_->stats().prefill_dispatches, 0u);

  // Nothing was left waiting: a list that fits goes through.
  r = post(proxy_->url(), {{"prompt", {text(100), text(100)}}, {"max_tokens", 2}});
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(decode_->stats().waiting_for_blocks, 0u);
}

TEST_F(Admission, AClientThatGoesAwayGivesItsRequestUpAndItsBlocksComeBack) {
  // One request holds 10 of Decode's 16 blocks waiting for a Prefill that never comes (its
  // Prefill died, say); a second waits in the queue behind it. Both clients go away.
  rd2h::testing::MetaserverStub never(200);
  const json body = {{"prompt", text(150)},
                     {"max_tokens", 2},
                     {"kv_transfer_params",
                      {{"do_remote_decode", false},
                       {"do_remote_prefill", true},
                       {"metaserver", never.url()}}}};
  auto held_client = std::make_shared<httplib::Client>(decode_->origin());
  auto queued_client = std::make_shared<httplib::Client>(decode_->origin());
  auto send = [&](std::shared_ptr<httplib::Client> c, const std::string& id) {
    return std::async(std::launch::async, [c, body, id] {
      c->set_read_timeout(120, 0);
      return c->Post("/v1/completions", {{"X-Request-Id", id}}, body.dump(), "application/json");
    });
  };
  auto held = send(held_client, "held");
  ASSERT_TRUE(rd2h::testing::eventually(
      [&] { return never.bodies().size() == 1 && decode_->stats().free_blocks == 6; }));
  auto queued = send(queued_client, "queued");
  ASSERT_TRUE(rd2h::testing::eventually([&] { return decode_->stats().waiting_for_blocks == 1; }));

  held_client->stop();
  queued_client->stop();
  EXPECT_FALSE(held.get());
  EXPECT_FALSE(queued.get());
  // Well before the KV arrival deadline (120 s) the blocks are back and the queue is empty.
  EXPECT_TRUE(rd2h::testing::eventually([&] {
    const auto s = decode_->stats();
    return s.free_blocks == kBlocks && s.waiting_for_blocks == 0;
  })) << "free blocks " << decode_->stats().free_blocks << ", waiting "
      << decode_->stats().waiting_for_blocks;
  // The engine serves on.
  auto again = post(proxy_->url(), {{"prompt", text(150)}, {"max_tokens", 2}});
  ASSERT_TRUE(again) << httplib::to_string(again.error());
  EXPECT_EQ(again->status, 200) << again->body;
}

}  // namespace
}  // namespace rd2h::sim
