#include "engine_command.h"

#include <cstdio>

#include "sim/engine.h"
#include "stop_signal.h"
#include "util/subprocess.h"
#include "util/token.h"

namespace rd2h::tools {

namespace {

// The simulated engine the command line describes.
sim::EngineConfig engine_config(const EngineCommandOptions& o,
                                const connector::ConnectorConfig& connector,
                                const std::string& token) {
  sim::EngineConfig config;
  config.connector = connector;
  config.token = token;
  config.max_prompts = o.max_prompts;
  config.max_prompt_tokens = o.max_prompt_tokens;
  config.tp_size = o.tp;
  config.model.layers = o.layers;
  config.model.block_size = o.block_size;
  config.model.num_blocks = o.num_blocks;
  config.model.prefill_slots = o.slots;
  config.model.bytes_per_token = o.bytes_per_token;
  config.token_budget = o.token_budget;
  config.decode_cached_tokens = o.decode_cached_tokens;
  config.test_recompute_after = o.test_recompute_after;
  config.host = o.host;
  config.served_model_name = o.served_model_name;
  config.port = o.port;
  config.worker_executable = self_executable();
  config.compute_ns_per_token = o.compute_ns_per_token;
  config.compute_min_layer_us = o.compute_min_layer_us;
  config.trace = o.trace;
  config.test_corrupt_layer = o.test_corrupt_layer;
  return config;
}

}  // namespace

int run_engine(const EngineCommandOptions& o, connector::KvRole role) {
  const char* name = role == connector::KvRole::kProducer ? "prefill" : "decode";
  std::string text = o.kv_transfer_config;
  if (text.empty()) {
    text = std::string(R"({"kv_connector": "rd2h", "kv_port": 30000, "kv_role": ")") +
           (role == connector::KvRole::kProducer ? "kv_producer" : "kv_consumer") + "\"}";
  }
  auto connector = connector::ConnectorConfig::from_json(text);
  if (!connector) {
    std::fprintf(stderr, "rd2h %s: %s\n", name, connector.status().to_string().c_str());
    return 2;
  }
  if (connector->role != role) {
    std::fprintf(stderr, "rd2h %s: kv_role in --kv-transfer-config is for the other side\n", name);
    return 2;
  }
  auto token = http::load_token(o.token_file);
  if (!token) {
    std::fprintf(stderr, "rd2h %s: --token-file: %s\n", name, token.status().message().c_str());
    return 2;
  }
  // Decode's metaserver posts carry the same token, unless its config names another.
  if (connector->metaserver_token_file.empty()) connector->metaserver_token_file = o.token_file;
  const sim::EngineConfig config = engine_config(o, *connector, *token);

  StopSignal stop;  // before the engine starts its threads
  auto engine = sim::Engine::start(config);
  if (!engine) {
    std::fprintf(stderr, "rd2h %s: %s\n", name, engine.status().to_string().c_str());
    return 1;
  }
  const char* control = connector->curve.enabled() ? "control channels CURVE"
                        : connector->insecure      ? "control channels INSECURE"
                                                   : "control channels plaintext on loopback";
  if (role == connector::KvRole::kConsumer) {
    std::printf("rd2h %s: serving %s (kv base port %d, TP %d, %s)\n", name,
                (*engine)->origin().c_str(), (*engine)->kv_base_port(), o.tp, control);
  } else {
    std::printf("rd2h %s: serving %s (TP %d, %s)\n", name, (*engine)->origin().c_str(), o.tp,
                control);
  }
  std::fflush(stdout);
  const int signal = stop.wait();
  // Drain: new requests get 503 (so a proxy's probe takes this engine out of its rotation)
  // while those in flight finish; what is left after the bound fails.
  std::printf("rd2h %s: signal %d: draining for up to %lld s\n", name, signal,
              static_cast<long long>(o.drain_timeout_s));
  std::fflush(stdout);
  const bool drained = (*engine)->drain(std::chrono::seconds(o.drain_timeout_s));
  const auto stats = (*engine)->stats();
  engine->reset();
  std::printf("rd2h %s: stopped after %llu requests (%llu failed; %s)\n", name,
              static_cast<unsigned long long>(stats.requests),
              static_cast<unsigned long long>(stats.failed_requests),
              drained ? "all finished" : "the rest failed");
  return 0;
}

}  // namespace rd2h::tools
