// A Prefill engine that is a real process, SIGKILLed while requests are in flight through
// the proxy: every one of them fails within seconds, naming the Prefill, instead of at its
// deadline (a minute), and Decode gets back every block they held. Decode and the proxy
// run in this process, over real UCX, ZeroMQ and HTTP on loopback.
#include <gtest/gtest.h>
#include <httplib.h>
#include <sys/wait.h>

#include <future>
#include <nlohmann/json.hpp>

#include "rd2h/metaserver/proxy.h"
#include "sim/engine.h"
#include "support/http_server.h"
#include "support/sim_engine.h"
#include "util/subprocess.h"

namespace rd2h::sim {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

constexpr uint64_t kDecodeBlocks = 48;  // of 16 tokens: two of the requests below at once

std::unique_ptr<Engine> start_decode() {
  return rd2h::testing::start_decode(
      rd2h::testing::small_engine(connector::KvRole::kConsumer, kDecodeBlocks, /*prefill_tp=*/2));
}

struct PrefillProcess {
  Subprocess process;
  std::string origin;
};

// `rd2h prefill`, TP 2, whose every layer takes 100 ms of compute: a request is in Prefill
// for a second or more.
std::optional<PrefillProcess> start_prefill() {
  Subprocess::Options options;
  options.merge_stderr = true;
  auto p = Subprocess::spawn(
      {RD2H_BINARY, "prefill", "--tp", "2", "--layers", "4", "--block-size", "16", "--num-blocks",
       "64", "--bytes-per-token", "64,8,16", "--compute-min-layer-us", "100000", "--token-budget",
       "128", "--kv-transfer-config",
       R"({"kv_connector": "rd2h", "kv_role": "kv_producer", "kv_port": 1,
           "kv_connector_extra_config": {"transport": "shm"}})"},
      options);
  if (!p) return std::nullopt;
  auto line = p->read_line(30s);
  if (!line || line->find("serving ") == std::string::npos) return std::nullopt;
  const size_t at = line->find("http://");
  return PrefillProcess{std::move(*p), line->substr(at, line->find(' ', at) - at)};
}

TEST(KilledPrefill, EveryRequestInFlightFailsWithinSecondsAndDecodeGetsItsBlocksBack) {
  auto decode = start_decode();
  ASSERT_TRUE(decode) << "no Decode engine came up";
  auto prefill = start_prefill();
  ASSERT_TRUE(prefill) << "no Prefill process came up";
  metaserver::ProxyConfig pc;
  pc.prefill = {prefill->origin};
  pc.decode = {decode->origin()};
  auto proxy = metaserver::Proxy::start(pc);
  ASSERT_TRUE(proxy) << proxy.status().to_string();

  // Five requests of 20 blocks each on Decode: two hold blocks, three queue behind them.
  std::vector<std::future<httplib::Result>> requests;
  for (int i = 0; i < 5; ++i) {
    requests.push_back(std::async(std::launch::async, [url = (*proxy)->url(), i] {
      httplib::Client c(url);
      c.set_read_timeout(120, 0);
      const json body = {{"prompt", std::string(300, static_cast<char>('a' + i))},
                         {"max_tokens", 2}};
      return c.Post("/v1/completions", body.dump(), "application/json");
    }));
  }
  ASSERT_TRUE(rd2h::testing::eventually([&] {
    return (*proxy)->stats().prefill_dispatches >= 1 && decode->stats().waiting_for_blocks == 3;
  })) << "the requests did not reach Prefill and Decode's queue";

  prefill->process.kill(SIGKILL);
  auto status = prefill->process.wait(30s);
  ASSERT_TRUE(status && WIFSIGNALED(*status));
  const auto killed = std::chrono::steady_clock::now();
  for (auto& f : requests) {
    // The bound is for sanitizers on a loaded machine; the requests' own deadline is 60 s.
    ASSERT_EQ(f.wait_until(killed + 15s), std::future_status::ready)
        << "a request still waits for the dead Prefill";
    auto r = f.get();
    ASSERT_TRUE(r) << httplib::to_string(r.error());
    EXPECT_EQ(r->status, 502) << r->body;
    EXPECT_NE(r->body.find("Prefill " + prefill->origin + " did not answer"), std::string::npos)
        << r->body;
  }
  EXPECT_TRUE(rd2h::testing::eventually([&] {
    const auto s = decode->stats();
    return s.free_blocks == kDecodeBlocks && s.waiting_for_blocks == 0;
  })) << "Decode still holds blocks for requests whose Prefill is gone";
}

}  // namespace
}  // namespace rd2h::sim
