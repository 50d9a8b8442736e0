// A Decode engine that is a real process, SIGKILLed while Prefill still publishes to it:
// Prefill's waits fail within its deadline instead of hanging, its request fails cleanly,
// and once a Decode is back on the same ports Prefill serves it again (MF_META re-sent on a
// new connection). SIGSTOPped mid-transfer and resumed after Prefill reused the blocks, it
// fails the request rather than complete it from overwritten KV. Prefill and the proxy run
// in this process, over real UCX, ZeroMQ and HTTP on loopback.
#include <gtest/gtest.h>
#include <httplib.h>
#include <sys/wait.h>

#include <future>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "rd2h/metaserver/proxy.h"
#include "sim/engine.h"
#include "support/http_server.h"
#include "support/processes.h"
#include "util/subprocess.h"

namespace rd2h::sim {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

struct DecodeProcess {
  Subprocess process;
  std::string origin;
  int kv_base_port = 0;
};

// `rd2h decode` on `kv_port`, TP 2, a small model; empty when the port is taken. `extra`:
// more of kv_connector_extra_config, as `, "key": value` pairs.
std::optional<DecodeProcess> start_decode(int kv_port, const std::string& extra = "") {
  const std::string config = R"({"kv_connector": "rd2h", "kv_role": "kv_consumer", "kv_port": )" +
                             std::to_string(kv_port) +
                             R"(, "kv_connector_extra_config": {"transport": "shm",
                                "prefill_tp_size": 2)" +
                             extra + "}}";
  Subprocess::Options options;
  options.merge_stderr = true;
  auto p = Subprocess::spawn(
      {RD2H_BINARY, "decode", "--tp", "2", "--layers", "4", "--block-size", "16", "--num-blocks",
       "64", "--bytes-per-token", "64,8,16", "--kv-transfer-config", config},
      options);
  if (!p) return std::nullopt;
  auto line = p->read_line(30s);
  if (!line || line->find("serving ") == std::string::npos) return std::nullopt;
  DecodeProcess d{std::move(*p), "", 0};
  const size_t at = line->find("http://");
  d.origin = line->substr(at, line->find(' ', at) - at);
  d.kv_base_port = std::stoi(line->substr(line->find("kv base port ") + 13));
  return d;
}

// `on_peer_failure`: "raise" (the request fails with the reason) or "fail" (only what was
// sent to the dead Decode fails; the Prefill engine answers its request). `slots`: Prefill's
// layer buffers (0: one per layer); `layer_us`: the least time each layer's compute takes.
std::unique_ptr<Engine> start_prefill(const std::string& on_peer_failure, int slots = 2,
                                      uint64_t layer_us = 0) {
  EngineConfig c;
  // Deadlines short enough to find the dead Decode soon, long enough for a restarted one
  // (its rank processes seed the request while its readiness is held) under sanitizers.
  // A restarted Decode's first transfer (new UCX endpoints, its pool mapped) takes over 3 s
  // under ThreadSanitizer on a loaded machine.
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
  const char* reply_ms = "8000";
#else
  const char* reply_ms = "3000";
#endif
  auto cfg = connector::ConnectorConfig::from_json(
      std::string(R"({"kv_connector": "rd2h", "kv_role": "kv_producer", "kv_port": 1,
          "kv_connector_extra_config": {"transport": "shm", "reply_timeout_ms": )") +
      reply_ms + R"(, "ack_timeout_ms": )" + reply_ms +
      R"(, "send_timeout_ms": 10000, "on_peer_failure": ")" + on_peer_failure + R"("}})");
  EXPECT_TRUE(cfg) << cfg.status().to_string();
  c.connector = *cfg;
  c.tp_size = 2;
  c.model.layers = 4;
  c.model.block_size = 16;
  c.model.num_blocks = 64;
  c.model.bytes_per_token = {64, 8, 16};
  c.model.prefill_slots = slots;
  c.compute_min_layer_us = layer_us;
  c.worker_executable = RD2H_BINARY;
  auto e = Engine::start(c);
  EXPECT_TRUE(e) << e.status().to_string();
  return e ? std::move(*e) : nullptr;
}

httplib::Result post(const std::string& origin, const json& body, const std::string& id = "") {
  httplib::Client c(origin);
  c.set_read_timeout(60, 0);
  httplib::Headers headers;
  if (!id.empty()) headers.emplace("X-Request-Id", id);
  return c.Post("/v1/completions", headers, body.dump(), "application/json");
}

class KilledDecode : public ::testing::TestWithParam<std::string> {};

TEST_P(KilledDecode, PrefillFailsWithinItsDeadlineAndServesADecodeThatComesBack) {
  const bool raises = GetParam() == "raise";
  std::mt19937 rng(std::random_device{}());
  std::optional<DecodeProcess> decode;
  int kv_port = 0;
  for (int attempt = 0; attempt < 20 && !decode; ++attempt) {
    kv_port = std::uniform_int_distribution<int>(20000, 60000)(rng);
    decode = start_decode(kv_port);
  }
  ASSERT_TRUE(decode) << "no Decode process came up";
  auto prefill = start_prefill(GetParam());
  ASSERT_TRUE(prefill);
  {
    metaserver::ProxyConfig pc;
    pc.prefill = {prefill->origin()};
    pc.decode = {decode->origin};
    auto proxy = metaserver::Proxy::start(pc);
    ASSERT_TRUE(proxy);
    auto r = post((*proxy)->url(), {{"prompt", std::string(40, 'a')}, {"max_tokens", 2}});
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;  // both Decode ranks are connected now
  }

  decode->process.kill(SIGKILL);
  auto status = decode->process.wait(30s);
  ASSERT_TRUE(status && WIFSIGNALED(*status));

  // Prefill is told to publish to the dead Decode: its wait fails, the request with it.
  const json dead = {{"prompt", std::string(40, 'b')},
                     {"max_tokens", 1},
                     {"kv_transfer_params",
                      {{"do_remote_decode", true},
                       {"request_id", "cmpl-dead-0"},
                       {"remote_host", "127.0.0.1"},
                       {"remote_port", decode->kv_base_port},
                       {"remote_tp_size", 2}}}};
  auto r = post(prefill->origin(), dead, "dead");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  if (raises) {
    EXPECT_EQ(r->status, 500) << r->body;
    EXPECT_TRUE(r->body.find("Decode restarted or died") != std::string::npos ||
                r->body.find("no answer") != std::string::npos ||
                r->body.find("no ACK") != std::string::npos ||
                r->body.find("nothing listens") != std::string::npos)
        << r->body;
  } else {
    EXPECT_EQ(r->status, 200) << "the engine failed with the dead Decode: " << r->body;
  }

  // A Decode back on the same ports is served again.
  auto back = start_decode(kv_port);
  ASSERT_TRUE(back) << "Decode did not come back on kv port " << kv_port;
  metaserver::ProxyConfig pc;
  pc.prefill = {prefill->origin()};
  pc.decode = {back->origin};
  auto proxy = metaserver::Proxy::start(pc);
  ASSERT_TRUE(proxy);
  auto again = post((*proxy)->url(), {{"prompt", std::string(40, 'c')}, {"max_tokens", 2}});
  ASSERT_TRUE(again);
  EXPECT_EQ(again->status, 200) << again->body;
  back->process.kill(SIGTERM);

  EXPECT_TRUE(back->process.wait(30s));
}

// The sum of every series of counter `name` in `origin`'s /metrics, through `client`.
std::optional<double> counter_sum(httplib::Client& client, const std::string& name) {
  auto r = client.Get("/metrics");
  if (!r || r->status != 200) return std::nullopt;
  double sum = 0;
  std::istringstream lines(r->body);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(name, 0) != 0 || line.size() <= name.size()) continue;
    if (line[name.size()] != '{' && line[name.size()] != ' ') continue;
    sum += std::stod(line.substr(line.rfind(' ') + 1));
  }
  return sum;
}

// The fence, with a real stall. Decode's TP rank processes are SIGSTOPped in the middle of a
// request's transfer (its first layer read, the rest not); Prefill sends the remaining
// layers' readiness, the final one included, gives that Decode up at its deadline, and
// computes another prompt into the same blocks of the same layer buffers. Resumed, the ranks
// find the rest of the readiness waiting, pointing at the other prompt's KV: the request
// must fail on Decode, never complete (had it completed, Decode's byte check would have found
// the other prompt's KV: "does not hold its KV"). Two fences hold it, each enough alone:
// the connection Prefill gave up is closed, and Decode fails what a closed connection owed
// and reads nothing more from it; and Prefill never commits the request (KV_COMMIT), so its
// final layer does not complete it. The test fails only with both removed.
class StoppedDecode : public ::testing::TestWithParam<std::string> {};

TEST_P(StoppedDecode, ResumedAfterPrefillReusedItsBlocksItFailsTheRequestInsteadOfCompletingIt) {
  std::mt19937 rng(std::random_device{}());
  std::optional<DecodeProcess> decode;
  for (int attempt = 0; attempt < 20 && !decode; ++attempt) {
    decode = start_decode(std::uniform_int_distribution<int>(20000, 60000)(rng),
                          R"(, "kv_arrival_timeout_ms": 20000, "control_link": )" + GetParam());
  }
  ASSERT_TRUE(decode) << "no Decode process came up";
  // One buffer per layer (no slot gate holds a layer back), a third of a second per layer.
  auto prefill = start_prefill("fail", /*slots=*/0, /*layer_us=*/300000);
  ASSERT_TRUE(prefill);
  metaserver::ProxyConfig pc;
  pc.prefill = {prefill->origin()};
  pc.decode = {decode->origin};
  pc.decode_attempts = 1;  // the client is to see what Decode made of the request
  auto proxy = metaserver::Proxy::start(pc);
  ASSERT_TRUE(proxy);
  const auto warm = post((*proxy)->url(), {{"prompt", std::string(40, 'w')}, {"max_tokens", 2}});
  ASSERT_TRUE(warm);
  ASSERT_EQ(warm->status, 200) << warm->body;  // both Decode ranks are connected now
  const auto ranks = rd2h::testing::workers_of(decode->process.pid());
  ASSERT_EQ(ranks.size(), 2u);

  httplib::Client decode_metrics(decode->origin);
  const auto layers = counter_sum(decode_metrics, "rd2h_kv_layers_total");
  ASSERT_TRUE(layers);
  auto answer = std::async(std::launch::async, [&] {
    return post((*proxy)->url(), {{"prompt", std::string(40, 's')}, {"max_tokens", 2}});
  });
  // Decode has read the request's first layer (each layer takes Prefill a third of a
  // second): its ranks stop in the middle of the request's transfer.
  ASSERT_TRUE(rd2h::testing::eventually(
      [&] { return counter_sum(decode_metrics, "rd2h_kv_layers_total") > *layers; }));
  for (const pid_t rank : ranks) ASSERT_EQ(kill(rank, SIGSTOP), 0);
  struct Resume {
    const std::vector<pid_t>& ranks;
    ~Resume() {
      for (const pid_t rank : ranks) kill(rank, SIGCONT);
    }
  } resume{ranks};

  // Prefill gives the stalled Decode up at its deadline, ends the request and frees its
  // blocks...
  httplib::Client metrics(prefill->origin());
  ASSERT_TRUE(rd2h::testing::eventually(
      [&] {
        return counter_sum(metrics, "rd2h_engine_prompts_total") == 2.0 &&
               prefill->stats().free_blocks == 64;
      },
      30s));
  // ...which the next prompt of the same length takes (the last freed are taken first).
  auto other = post(prefill->origin(), {{"prompt", std::string(40, 't')}, {"max_tokens", 1}});
  ASSERT_TRUE(other);
  ASSERT_EQ(other->status, 200) << other->body;
  for (const pid_t rank : ranks) ASSERT_EQ(kill(rank, SIGCONT), 0);

  auto r = answer.get();
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_NE(r->status, 200) << "a request completed from KV Prefill overwrote: " << r->body;
  EXPECT_EQ(r->body.find("does not hold its KV"), std::string::npos) << r->body;
  // Decode serves on.
  const auto after = post((*proxy)->url(), {{"prompt", std::string(40, 'u')}, {"max_tokens", 2}});
  ASSERT_TRUE(after);
  EXPECT_EQ(after->status, 200) << after->body;
  decode->process.kill(SIGTERM);
  EXPECT_TRUE(decode->process.wait(30s));
}

// Readiness and answers on a transfer link, or on ZeroMQ.
INSTANTIATE_TEST_SUITE_P(Control, StoppedDecode, ::testing::Values("true", "false"),
                         [](const auto& info) {
                           return info.param == "true" ? std::string("OnALink")
                                                       : std::string("OnZeroMq");
                         });

INSTANTIATE_TEST_SUITE_P(OnPeerFailure, KilledDecode, ::testing::Values("raise", "fail"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace rd2h::sim
