// A Decode engine that is a real process, SIGKILLed while Prefill still publishes to it:
// Prefill's waits fail within its deadline instead of hanging, its request fails cleanly,
// and once a Decode is back on the same ports Prefill serves it again (MF_META re-sent on a
// new connection). Prefill and the proxy run in this process, over real UCX, ZeroMQ and
// HTTP on loopback.
#include <gtest/gtest.h>
#include <httplib.h>
#include <sys/wait.h>

#include <nlohmann/json.hpp>
#include <random>

#include "rd2h/metaserver/proxy.h"
#include "sim/engine.h"
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

// `rd2h decode` on `kv_port`, TP 2, a small model; empty when the port is taken.
std::optional<DecodeProcess> start_decode(int kv_port) {
  const std::string config = R"({"kv_connector": "rd2h", "kv_role": "kv_consumer", "kv_port": )" +
                             std::to_string(kv_port) +
                             R"(, "kv_connector_extra_config": {"transport": "shm",
                                "prefill_tp_size": 2}})";
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
// sent to the dead Decode fails; the Prefill engine answers its request).
std::unique_ptr<Engine> start_prefill(const std::string& on_peer_failure) {
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
  c.model.prefill_slots = 2;
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

INSTANTIATE_TEST_SUITE_P(OnPeerFailure, KilledDecode, ::testing::Values("raise", "fail"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace rd2h::sim
