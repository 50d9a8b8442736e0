// rd2h: one binary, one subcommand per job.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "bench_engine.h"
#include "bench_layers.h"
#include "config_reference.h"
#include "control/curve.h"
#include "engine_command.h"
#include "pd_read.h"
#include "proxy_command.h"
#include "rd2h/common/log.h"
#include "rd2h/version.h"
#include "sim/demo.h"
#include "sim/engine.h"
#include "util/subprocess.h"

namespace {

// Every setting of rd2h demo as a flag, from the one list its config file also reads.
void add_demo_settings(CLI::App* cmd, rd2h::sim::DemoOptions& o) {
  for (const auto& s : rd2h::sim::demo_settings(o)) {
    const std::string flag = "--" + s.name;
    CLI::Option* opt = nullptr;
    if (auto* b = std::get_if<bool*>(&s.field)) {
      opt = cmd->add_flag(s.negatable ? flag + ",!--no-" + s.name : flag, **b, s.help);
    } else if (auto* list = std::get_if<std::vector<uint64_t>*>(&s.field)) {
      opt = cmd->add_option(flag, **list, s.help)
                ->delimiter(',')
                ->expected(static_cast<int>(s.min_items), static_cast<int>(s.max_items))
                ->check(CLI::Range(s.lo, s.hi));
    } else if (auto* f = std::get_if<double*>(&s.field)) {
      opt = cmd->add_option(flag, **f, s.help)->check(CLI::Range(0.0, 1.0));
    } else if (auto* text = std::get_if<std::string*>(&s.field)) {
      opt = cmd->add_option(flag, **text, s.help);
      if (!s.choices.empty()) opt->check(CLI::IsMember(s.choices));
    } else {
      std::visit(
          [&](auto* field) {
            if constexpr (std::is_integral_v<std::remove_pointer_t<decltype(field)>>) {
              opt = cmd->add_option(flag, *field, s.help);
              if (s.hi > 0) opt->check(CLI::Range(s.lo, s.hi));
            }
          },
          s.field);
    }
    if (opt != nullptr && s.hidden) opt->group("");
  }
}

// What the command line sets, and the subcommands it may choose.
struct Commands {
  rd2h::tools::PdReadOptions pd;
  CLI::App* pd_read = nullptr;
  rd2h::tools::BenchEngineOptions be;
  CLI::App* bench_engine = nullptr;
  rd2h::tools::BenchLayersOptions bl;
  CLI::App* bench_layers = nullptr;
  rd2h::sim::BenchDemoOptions bd;
  std::string bench_demo_config;
  CLI::App* bench_demo = nullptr;
  rd2h::metaserver::ProxyConfig px;
  int64_t proxy_drain_s = 30;
  std::string proxy_token_file;
  CLI::App* proxy = nullptr;
  std::string keygen_stem;
  CLI::App* keygen = nullptr;
  rd2h::tools::EngineCommandOptions eo;
  CLI::App* prefill_cmd = nullptr;
  CLI::App* decode_cmd = nullptr;
  rd2h::sim::DemoOptions dm;
  std::string demo_config;
  CLI::App* demo = nullptr;
  std::string core_url;
  int worker_rank = 0;
  int core_pid = 0;
  CLI::App* worker_cmd = nullptr;
  std::string log_level;
};

// rd2h pd-read
void add_pd_read(CLI::App& app, Commands& c) {
  auto& pd = c.pd;
  auto* pd_read = c.pd_read = app.add_subcommand(
      "pd-read",
      "Validate two-endpoint registration and reads: a source registers a KV-like pool, a "
      "destination pulls random blocks and verifies every byte");
  pd_read->add_option("--role", pd.role, "local (spawn both on this host) | source | dest")
      ->check(CLI::IsMember({"local", "source", "dest"}));
  pd_read->add_option("--listen", pd.listen, "source: host:port to listen on (port 0: any)");
  pd_read->add_option("--connect", pd.connect, "dest: the source's host:port");
  pd_read->add_option("--transport", pd.transport, "shm | tcp | auto")
      ->check(CLI::IsMember({"shm", "tcp", "auto"}));
  pd_read
      ->add_option("--memory", pd.memory,
                   "source pool: alloc (engine-allocated) | register (caller memory)")
      ->check(CLI::IsMember({"alloc", "register"}));
  pd_read
      ->add_option("--read-path", pd.read_path,
                   "dest: auto | rma (ucp_get) | am (active messages) for unmapped reads")
      ->check(CLI::IsMember({"auto", "rma", "am"}));
  pd_read->add_option("--layers", pd.layers, "layers in the pool")->check(CLI::Range(1u, 4096u));
  pd_read->add_option("--blocks", pd.blocks, "blocks per tensor")->check(CLI::Range(1u, 1u << 24));
  pd_read->add_option("--main-bytes", pd.main_bytes, "bytes per block of each main tensor")
      ->delimiter(',');
  pd_read->add_option("--indexer-bytes", pd.indexer_bytes,
                      "bytes per block of the indexer (0: none)");
  pd_read->add_option("--batch-blocks", pd.batch_blocks, "random blocks per batch");
  pd_read->add_option("--batches", pd.batches, "batches to read (0: one per layer)");
  pd_read->add_option("--seed", pd.seed, "pattern and block-choice seed");
  pd_read->add_option("--timeout-ms", pd.timeout_ms, "read and connect timeout")
      ->check(CLI::Range(1u, 3600000u));
  pd_read
      ->add_option("--serve-timeout", pd.serve_timeout_s,
                   "seconds a source waits for its reader to finish")
      ->check(CLI::Range(1u, 86400u));
  pd_read
      ->add_option("--busy-threads", pd.busy_threads,
                   "source: threads spinning while it serves (a Prefill computing)")
      ->check(CLI::Range(0u, 1024u));
  pd_read->add_flag("--share,!--no-share", pd.share,
                    "source, --memory register: move the pool into shared memory that "
                    "co-located readers map (default)");
}

// rd2h bench engine | layers | demo
void add_bench(CLI::App& app, Commands& c) {
  auto* bench = app.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  auto& be = c.be;
  auto* bench_engine = c.bench_engine = bench->add_subcommand(
      "engine", "Batched-read GB/s over shm and tcp next to memcpy and ucx_perftest");
  bench_engine->add_option("--transports", be.transports, "transports to measure")->delimiter(',');
  bench_engine->add_option("--block-bytes", be.block_bytes, "block sizes")->delimiter(',');
  bench_engine->add_option("--batch-bytes", be.batch_bytes, "bytes per batch");
  bench_engine->add_option("--memory", be.memory, "source pool: alloc | register")
      ->check(CLI::IsMember({"alloc", "register"}));
  bench_engine->add_option("--read-path", be.read_path, "auto | rma | am")
      ->check(CLI::IsMember({"auto", "rma", "am"}));
  bench_engine->add_option("--min-seconds", be.min_seconds, "time per measurement");
  bench_engine->add_flag("!--no-perftest", be.perftest, "skip ucx_perftest");
  bench_engine
      ->add_option("--peers", be.peers,
                   "peer engines measured on the same blocks: nixl, mooncake (comma-separated)")
      ->delimiter(',')
      ->check(CLI::IsMember({"nixl", "mooncake"}));
  bench_engine->add_option("--peers-python", be.peers_python,
                           "Python with the peers installed (default: scripts/bench-venv's)");
  bench_engine
      ->add_option("--source-load", be.source_load,
                   "the source while read: none | busy (a spinning thread per core) | stopped")
      ->check(CLI::IsMember({"none", "busy", "stopped"}));
  bench_engine->add_flag("--share,!--no-share", be.share,
                         "--memory register: the source moves its pool into shared memory "
                         "(default)");

  auto& bl = c.bl;
  auto* bench_layers = c.bench_layers = bench->add_subcommand(
      "layers", "Per-layer control overhead and GB/s of the connector over shm, 1 vs N requests");
  bench_layers->add_option("--layers", bl.layers, "layers measured per configuration")
      ->check(CLI::Range(1u, 1000000u));
  bench_layers->add_option("--warmup", bl.warmup, "layers run before measuring");
  bench_layers->add_option("--requests", bl.requests, "requests per layer")->delimiter(',');
  bench_layers->add_option("--blocks", bl.blocks, "blocks per layer")
      ->check(CLI::Range(1u, 65536u));
  bench_layers->add_option("--main-bytes", bl.main_bytes, "bytes per block of K, V")
      ->delimiter(',');
  bench_layers->add_option("--indexer-bytes", bl.indexer_bytes, "bytes per indexer block");
  bench_layers->add_flag("--distinct-layers", bl.distinct_layers,
                         "each of the 61 layers in memory of its own");
  bench_layers
      ->add_option("--peers", bl.peers,
                   "peer completion paths measured on the same layers: nixl (notifications)")
      ->delimiter(',')
      ->check(CLI::IsMember({"nixl"}));
  bench_layers->add_option("--peers-python", bl.peers_python,
                           "Python with the peers installed (default: scripts/bench-venv's)");
  bench_layers->add_option("--timeout-ms", bl.timeout_ms, "bound on every wait")
      ->check(CLI::Range(1u, 3600000u));

  auto& bd = c.bd;
  auto* bench_demo = c.bench_demo = bench->add_subcommand(
      "demo", "The demo's workload over several Prefill:Decode TP pairs, in one table");
  bench_demo->add_option("--config", c.bench_demo_config, "demo settings (JSON, as rd2h demo)");
  bench_demo->add_option("--topologies", bd.topologies, "Prefill:Decode TP pairs")->delimiter(',');
  bench_demo->add_option("--requests", bd.demo.requests, "requests per run");
  bench_demo->add_option("--compute-ns-per-token", bd.demo.compute_ns_per_token,
                         "Prefill compute per token per layer");
}

// rd2h proxy
void add_proxy(CLI::App& app, Commands& c) {
  auto& px = c.px;
  auto* proxy = c.proxy = app.add_subcommand(
      "proxy", "OpenAI-style front over Prefill and Decode instances, with the metaserver");
  proxy->add_option("--host", px.host, "address to bind (no wildcard by default)");
  proxy->add_option("--advertise-host", px.advertise_host,
                    "the address Decode engines reach this proxy at (default: --host; needed "
                    "with a wildcard --host)");
  proxy->add_flag("--allow-unauthenticated", px.allow_unauthenticated,
                  "serve a non-loopback --host without an API key or token (warned)");
  proxy->add_option("--port", px.port, "client API port (0: any)")->check(CLI::Range(0, 65535));
  proxy->add_option("--metaserver-port", px.metaserver_port, "rendezvous port (0: any)")
      ->check(CLI::Range(0, 65535));
  proxy->add_option("--prefill", px.prefill, "Prefill engines, http://host:port")
      ->delimiter(',')
      ->required();
  proxy->add_option("--decode", px.decode, "Decode engines, http://host:port")
      ->delimiter(',')
      ->required();
  proxy->add_option("--max-body-bytes", px.max_body_bytes, "largest request body accepted");
  proxy->add_option("--max-concurrent", px.max_concurrent, "client requests served at once")
      ->check(CLI::Range(1u, 65536u));
  proxy->add_option("--max-prompts", px.max_prompts, "prompts in one prompt list")
      ->check(CLI::Range(1u, 1u << 24));
  proxy->add_option("--max-prompt-tokens", px.max_prompt_tokens, "tokens in one token list")
      ->check(CLI::Range(1u, 1u << 30));
  proxy->add_option("--api-key", px.api_key,
                    "key clients must send as Authorization: Bearer <key> on /v1/* "
                    "(default: $RD2H_API_KEY, if set; else none)");
  proxy
      ->add_option("--drain-timeout", c.proxy_drain_s,
                   "seconds requests in flight may take to finish after SIGTERM before they "
                   "are aborted")
      ->check(CLI::Range(int64_t{0}, int64_t{86400}));
  proxy
      ->add_option("--prefill-attempts", px.prefill_attempts,
                   "attempts of a Prefill dispatch that gets no answer or a 5xx, with "
                   "exponential backoff, before the client gets a 502")
      ->check(CLI::Range(1, 100));
  proxy
      ->add_option("--decode-attempts", px.decode_attempts,
                   "attempts of a client request whose Decode gets no answer or answers a 5xx "
                   "before anything reached the client, each on another Decode")
      ->check(CLI::Range(1, 100));
  proxy
      ->add_option_function<int64_t>(
          "--probe-interval-ms",
          [&px](int64_t ms) { px.probe_interval = std::chrono::milliseconds(ms); },
          "how often every engine's /health is probed (an engine that fails leaves the "
          "rotation until it answers again; default 1000), 0: never")
      ->check(CLI::Range(int64_t{0}, int64_t{3600000}));
  proxy
      ->add_option_function<int64_t>(
          "--probe-timeout-ms",
          [&px](int64_t ms) { px.probe_timeout = std::chrono::milliseconds(ms); },
          "how long a health probe may take (default 2000)")
      ->check(CLI::Range(int64_t{1}, int64_t{600000}));
  proxy
      ->add_option("--max-reissues", px.max_reissues,
                   "times a stream Decode ends with stop reason recomputed is continued from "
                   "a new Prefill and Decode (prompt plus text so far), 0: never")
      ->check(CLI::Range(0, 100));
  proxy->add_option("--token-file", c.proxy_token_file,
                    "file holding the bearer token of the metaserver and the engines "
                    "(default: $RD2H_TOKEN, if set)");
}

// rd2h keygen
void add_keygen(CLI::App& app, Commands& c) {
  auto* keygen = c.keygen = app.add_subcommand(
      "keygen",
      "Write a CURVE key pair for the control channels: STEM.key (the public certificate, "
      "for the peers' curve_trusted_keys_file) and STEM.key_secret (mode 0600, this engine's "
      "curve_secret_key_file)");
  keygen->add_option("stem", c.keygen_stem, "path of the two files without their suffix")
      ->required();
}

// rd2h prefill | decode: the simulated engines
void add_engines(CLI::App& app, Commands& c) {
  // The model and compute flags the engines and the demo share (same field names): the
  // KV layout both sides hold, and how Prefill computes.
  auto layout_options = [](CLI::App* cmd, auto& o) {
    cmd->add_option("--layers", o.layers, "attention layers")->check(CLI::Range(1, 1024));
    cmd->add_option("--block-size", o.block_size, "tokens per block");
    cmd->add_option("--num-blocks", o.num_blocks, "blocks per rank");
    cmd->add_option("--bytes-per-token", o.bytes_per_token, "K, V, indexer[, scale]")
        ->delimiter(',');
  };
  auto prefill_options = [](CLI::App* cmd, auto& o) {
    cmd->add_option("--slots", o.slots, "Prefill's physical layer buffers (0: one per layer)");
    cmd->add_option("--token-budget", o.token_budget, "Prefill tokens per step (chunking)");
    cmd->add_option("--compute-ns-per-token", o.compute_ns_per_token,
                    "Prefill compute time per token per layer");
    cmd->add_option("--compute-min-layer-us", o.compute_min_layer_us,
                    "least Prefill compute time per layer");
    cmd->add_option("--test-corrupt-layer", o.test_corrupt_layer)->group("");
  };

  auto& eo = c.eo;
  auto engine_options = [&eo, &layout_options](CLI::App* cmd) {
    cmd->add_option("--kv-transfer-config", eo.kv_transfer_config,
                    "vLLM-style kv_transfer_config JSON");
    cmd->add_option("--host", eo.host, "HTTP address to bind");
    cmd->add_option("--port", eo.port, "HTTP port (0: any)")->check(CLI::Range(0, 65535));
    cmd->add_option("--served-model-name", eo.served_model_name,
                    "the model name the OpenAI API serves; requests naming another are 404");
    cmd->add_option("--tp", eo.tp, "TP size (ranks)")->check(CLI::Range(1, 64));
    layout_options(cmd, eo);
    cmd->add_flag("--trace", eo.trace, "record the timeline (GET /rd2h/report)");
    cmd->add_option("--token-file", eo.token_file,
                    "file holding the bearer token the HTTP API requires "
                    "(default: $RD2H_TOKEN, if set)");
    cmd->add_option("--max-prompts", eo.max_prompts, "prompts in one prompt list")
        ->check(CLI::Range(1u, 1u << 24));
    cmd->add_option("--max-prompt-tokens", eo.max_prompt_tokens, "tokens in one prompt")
        ->check(CLI::Range(1u, 1u << 30));
    cmd->add_option("--drain-timeout", eo.drain_timeout_s,
                    "seconds requests in flight may take to finish after SIGTERM (new ones get "
                    "503) before they are failed")
        ->check(CLI::Range(int64_t{0}, int64_t{86400}));
  };
  auto* prefill_cmd = c.prefill_cmd =
      app.add_subcommand("prefill", "A simulated Prefill engine (HTTP server)");
  engine_options(prefill_cmd);
  prefill_options(prefill_cmd, eo);
  auto* decode_cmd = c.decode_cmd =
      app.add_subcommand("decode", "A simulated Decode engine (HTTP server)");
  engine_options(decode_cmd);
  decode_cmd->add_option("--cached-tokens", eo.decode_cached_tokens,
                         "tokens of each prompt held in a pretend local prefix cache");
  decode_cmd->add_option("--test-recompute-after", eo.test_recompute_after)->group("");
}

// rd2h demo
void add_demo(CLI::App& app, Commands& c) {
  auto* demo = c.demo = app.add_subcommand(
      "demo",
      "A whole PD-disaggregated run on this machine: proxy, Prefill (TP 4) and Decode (TP 2) "
      "engines, a verified workload, a summary and an optional timeline trace");
  demo->add_option("--config", c.demo_config, "JSON file of settings (keys: the flag names)");
  add_demo_settings(demo, c.dm);
}

// rd2h worker: one TP rank of a simulated engine
void add_worker(CLI::App& app, Commands& c) {
  auto* worker_cmd = c.worker_cmd =
      app.add_subcommand("worker", "One TP rank process of a prefill/decode engine");
  worker_cmd->group("");  // started by the engine, not by hand
  worker_cmd->add_option("--core", c.core_url, "the engine core's rank channel")->required();
  worker_cmd->add_option("--rank", c.worker_rank, "TP rank")->required();
  worker_cmd->add_option("--core-pid", c.core_pid, "the engine core's process id")->required();
}

// --log-level, on each server (and the processes it starts).
void add_log_level(Commands& c) {
  for (CLI::App* cmd : {c.proxy, c.prefill_cmd, c.decode_cmd, c.demo}) {
    cmd->add_option("--log-level", c.log_level,
                    cmd == c.demo
                        ? "trace|debug|info|warn|error|critical|off, of the processes the "
                          "demo starts (default: $RD2H_LOG_LEVEL, else warn)"
                        : "trace|debug|info|warn|error|critical|off (default: "
                          "$RD2H_LOG_LEVEL, else info)");
  }
}

// Runs the subcommand the command line chose; the process's exit code.
int run(Commands& c) {
  // The demo's own output is its report: its servers say only what is wrong.
  if (c.log_level.empty() && c.demo->parsed() && std::getenv("RD2H_LOG_LEVEL") == nullptr) {
    c.log_level = "warn";
  }
  // The flag's level, else the environment's, checked alike: a typo is an error, not info.
  const char* env = std::getenv("RD2H_LOG_LEVEL");
  const std::string level = !c.log_level.empty() ? c.log_level : env != nullptr ? env : "";
  if (!level.empty()) {
    if (auto st = rd2h::set_log_level(level); !st) {
      std::fprintf(stderr, "rd2h: %s: %s\n", c.log_level.empty() ? "RD2H_LOG_LEVEL" : "--log-level",
                   st.message().c_str());
      return 2;
    }
    ::setenv("RD2H_LOG_LEVEL", level.c_str(), 1);  // for the processes it starts
  }
  if (c.worker_cmd->parsed())
    return rd2h::sim::run_rank_worker(c.core_url, c.worker_rank, c.core_pid);
  // A demo config file fills in what the command line did not set.
  auto load_demo_config = [](CLI::App* cmd, const std::string& path,
                             rd2h::sim::DemoOptions& options) {
    if (path.empty()) return true;
    auto st = rd2h::sim::apply_demo_config(path, options, [cmd](const std::string& key) {
      auto* opt = cmd->get_option_no_throw("--" + key);
      return opt != nullptr && opt->count() > 0;
    });
    if (!st) std::fprintf(stderr, "rd2h: %s\n", st.message().c_str());
    return st.is_ok();
  };
  if (c.bench_demo->parsed()) {
    if (!load_demo_config(c.bench_demo, c.bench_demo_config, c.bd.demo)) return 2;
    return rd2h::sim::run_bench_demo(c.bd);
  }
  if (c.demo->parsed()) {
    if (!load_demo_config(c.demo, c.demo_config, c.dm)) return 2;
    return rd2h::sim::run_demo(c.dm);
  }
  if (c.prefill_cmd->parsed())
    return rd2h::tools::run_engine(c.eo, rd2h::connector::KvRole::kProducer);
  if (c.decode_cmd->parsed())
    return rd2h::tools::run_engine(c.eo, rd2h::connector::KvRole::kConsumer);
  if (c.proxy->parsed())
    return rd2h::tools::run_proxy(c.px, c.proxy_token_file, std::chrono::seconds(c.proxy_drain_s));
  if (c.keygen->parsed()) {
    auto keys = rd2h::control::generate_key_pair();
    rd2h::Status st = keys ? rd2h::control::write_key_pair(c.keygen_stem, *keys) : keys.status();
    if (!st) {
      std::fprintf(stderr, "rd2h keygen: %s\n", st.message().c_str());
      return 1;
    }
    std::printf("rd2h keygen: wrote %s.key and %s.key_secret; public key %s\n",
                c.keygen_stem.c_str(), c.keygen_stem.c_str(), keys->public_key.c_str());
    return 0;
  }
  if (c.bench_layers->parsed()) return rd2h::tools::run_bench_layers(c.bl);
  if (c.pd_read->parsed()) return rd2h::tools::run_pd_read(c.pd);
  if (c.bench_engine->parsed()) return rd2h::tools::run_bench_engine(c.be);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  // A fault must end the process, not leave it hung in UCX's handler of error signals, which
  // UCX installs when its library loads (before main): unless the environment says
  // otherwise, start again with them off. The processes this one starts inherit it.
  if (std::getenv("UCX_ERROR_SIGNALS") == nullptr) {
    ::setenv("UCX_ERROR_SIGNALS", "", 1);
    ::execv("/proc/self/exe", argv);  // returns only if it failed: go on with them on
  }
  // Started by `rd2h demo`: do not outlive it.
  if (!rd2h::die_with_parent_if_asked()) return 1;
  CLI::App app{"rd2h: layerwise KV-cache transfer for prefill/decode disaggregated serving"};
  app.set_version_flag("--version", std::string("rd2h ") + rd2h::version());
  app.require_subcommand(1);
  app.option_defaults()->always_capture_default();  // --help shows every default

  Commands c;
  add_pd_read(app, c);
  add_bench(app, c);
  add_proxy(app, c);
  add_keygen(app, c);
  add_engines(app, c);
  add_demo(app, c);
  add_worker(app, c);
  add_log_level(c);
  auto* reference = app.add_subcommand("config-reference",
                                       "Print the configuration reference (docs/configuration.md)");
  // An unknown command is named as such (CLI11 would only say a subcommand is required).
  const auto commands = app.get_subcommands([](CLI::App*) { return true; });
  if (argc > 1 && argv[1][0] != '-' &&
      std::none_of(commands.begin(), commands.end(),
                   [&](const CLI::App* sub) { return sub->check_name(argv[1]); })) {
    std::string known;
    for (const auto* sub : commands) known += (known.empty() ? "" : ", ") + sub->get_name();
    std::fprintf(stderr, "rd2h: unknown command '%s' (commands: %s; rd2h --help)\n", argv[1],
                 known.c_str());
    return 2;
  }
  CLI11_PARSE(app, argc, argv);
  if (reference->parsed()) {
    std::fputs(rd2h::tools::config_reference_markdown(app).c_str(), stdout);
    return 0;
  }
  return run(c);
}
