#include "sim/demo.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <tuple>

#include "rd2h/metaserver/proxy.h"
#include "sim/demo_parts.h"
#include "sim/stop_on_signal.h"
#include "util/thread_pool.h"

namespace rd2h::sim {
namespace {

using namespace demo;

using Say = std::function<void(const std::string&)>;

// The processes of one run.
struct Fleet {
  std::vector<Server> decode, prefill;
  std::optional<Server> proxy;

  // The proxy first, so that nothing new reaches the engines while they stop.
  std::vector<Server*> children() {
    std::vector<Server*> out;
    if (proxy) out.push_back(&*proxy);
    for (auto* servers : {&prefill, &decode}) {
      for (auto& s : *servers) out.push_back(&s);
    }
    return out;
  }
};

void say_setup(const DemoOptions& o, const std::vector<Request>& requests, const Say& say) {
  uint64_t total_tokens = 0, prompts = 0;
  for (const auto& r : requests) {
    prompts += r.prompts.size();
    for (const auto& p : r.prompts) total_tokens += p.size();
  }
  uint64_t per_token = 0;
  for (auto b : o.bytes_per_token) per_token += b;
  const double pool_gb = static_cast<double>(o.layers) *
                         static_cast<double>(o.bytes_per_token[0] + o.bytes_per_token[1]) *
                         static_cast<double>(o.block_size * o.num_blocks) / 1e9;
  char head[512];
  std::snprintf(head, sizeof(head),
                "rd2h demo: Prefill TP %d x %d, Decode TP %d x %d, %d layers, %llu bytes of KV "
                "per token per layer, Decode main pool %.2f GB per instance, transport %s",
                o.prefill_tp, o.dp, o.decode_tp, o.dp, o.layers,
                static_cast<unsigned long long>(per_token), pool_gb, o.transport.c_str());
  say(head);
  std::snprintf(head, sizeof(head),
                "rd2h demo: workload %u requests (%llu prompts, %llu tokens, %llu..%llu per "
                "prompt), %u at a time",
                o.requests, static_cast<unsigned long long>(prompts),
                static_cast<unsigned long long>(total_tokens),
                static_cast<unsigned long long>(o.min_tokens),
                static_cast<unsigned long long>(o.max_tokens), o.concurrency);
  say(head);
}

// Decode first (the proxy needs every origin), each on a free range of kv ports, then
// Prefill.
Status start_engines(const DemoOptions& o, const RunSecrets& token, Fleet& f, const Say& say) {
  std::mt19937 port_rng(std::random_device{}());
  for (int i = 0; i < o.dp; ++i) {
    say("rd2h demo: starting Decode " + std::to_string(i) + " (" + std::to_string(o.decode_tp) +
        " ranks, each seeding and registering its KV pool) ...");
    Expected<Server> s = internal_error("not started");
    for (int attempt = 0; attempt < (o.kv_port == 0 ? 8 : 1) && !s; ++attempt) {
      const int base =
          o.kv_port != 0 ? o.kv_port + i * o.decode_tp
                         : std::uniform_int_distribution<int>(20000, 60000 - o.decode_tp)(port_rng);
      s = launch("Decode " + std::to_string(i), o.decode_wrapper,
                 engine_args("decode", o.decode_tp, o.decode_host,
                             kv_config("decode", i, base, o.decode_host, o, token), o, token));
    }
    if (!s) return internal_error(s.status().message());
    say("rd2h demo: Decode " + std::to_string(i) + " at " + s->origin + " " + s->extra);
    f.decode.push_back(std::move(*s));
  }
  for (int i = 0; i < o.dp; ++i) {
    say("rd2h demo: starting Prefill " + std::to_string(i) + " (" + std::to_string(o.prefill_tp) +
        " ranks, each seeding its KV pool) ...");
    auto s = launch("Prefill " + std::to_string(i), o.prefill_wrapper,
                    engine_args("prefill", o.prefill_tp, o.prefill_host,
                                kv_config("prefill", i, 1, o.prefill_host, o, token), o, token));
    if (!s) return internal_error(s.status().message());
    say("rd2h demo: Prefill " + std::to_string(i) + " at " + s->origin + " " + s->extra);
    f.prefill.push_back(std::move(*s));
  }
  return Status::ok();
}

Status start_proxy(const DemoOptions& o, const RunSecrets& token, Fleet& f, const Say& say) {
  std::vector<std::string> args = {"proxy",
                                   "--host",
                                   o.host,
                                   "--port",
                                   std::to_string(o.proxy_port),
                                   "--metaserver-port",
                                   std::to_string(o.metaserver_port)};
  std::vector<std::string> origins;
  for (auto& s : f.prefill) origins.push_back(s.origin);
  args.insert(args.end(), {"--prefill", join(origins, ",")});
  origins.clear();
  for (auto& s : f.decode) origins.push_back(s.origin);
  args.insert(args.end(),
              {"--decode", join(origins, ","), "--max-body-bytes", std::to_string(64u << 20),
               "--token-file", token.file, "--max-prompts",
               std::to_string(std::max<uint64_t>(1024, o.prompt_list_size)), "--max-prompt-tokens",
               std::to_string(std::max<uint64_t>(262144, o.max_tokens)), "--drain-timeout", "5"});
  auto proxy = launch("the proxy", "", args);
  if (!proxy) return internal_error(proxy.status().message());
  say("rd2h demo: proxy at " + proxy->origin + " " + proxy->extra);
  f.proxy = std::move(*proxy);
  return Status::ok();
}

// The first request between a Prefill and a Decode instance connects their engines (and
// maps Prefill's KV into Decode); that one-time cost is kept out of the figures, whose
// timelines start after it. With several instances every pair gets its request through a
// proxy of its own, since the main one picks pairs by load.
Status warm_up(const DemoOptions& o, const RunSecrets& token, Fleet& f, Watch& watch) {
  for (size_t i = 0; i < f.prefill.size(); ++i) {
    for (size_t j = 0; j < f.decode.size(); ++j) {
      std::unique_ptr<metaserver::Proxy> pair;
      if (o.dp > 1) {
        metaserver::ProxyConfig pc;
        pc.host = o.host;
        pc.prefill = {f.prefill[i].origin};
        pc.decode = {f.decode[j].origin};
        pc.token = token.token;
        auto started = metaserver::Proxy::start(pc);
        if (!started) return internal_error(started.status().message());
        pair = std::move(*started);
      }
      const int n = static_cast<int>(i * f.decode.size() + j);
      Request warm{
          "warmup-" + std::to_string(n), {std::vector<int64_t>(o.block_size, 7 + n)}, false};
      const ClientRecord r = send(pair ? pair->url() : f.proxy->origin, warm, o, watch);
      if (!r.ok) return internal_error("warm-up request failed: " + r.error);
    }
  }
  for (const auto* servers : {&f.prefill, &f.decode}) {
    for (const auto& s : *servers) {
      if (auto t = collect(s, "", 0, 0, /*quiet=*/true, token); !t) {
        return internal_error(t.status().message());
      }
    }
  }
  return Status::ok();
}

// The workload, `concurrency` requests at a time, with progress once a second; returns how
// many failed. After the first failure no new request leaves: the run has failed already.
size_t run_workload(const DemoOptions& o, const std::vector<Request>& requests,
                    const std::string& proxy, Watch& watch, MemoryWatch& memory,
                    std::vector<ClientRecord>& records) {
  uint64_t total_tokens = 0;
  for (const auto& r : requests) {
    for (const auto& p : r.prompts) total_tokens += p.size();
  }
  records.assign(requests.size(), {});
  std::atomic<size_t> done{0}, failed{0};
  std::atomic<uint64_t> tokens_done{0};
  ThreadPool clients(std::min<uint32_t>(o.concurrency, o.requests));
  const auto started = std::chrono::steady_clock::now();
  for (size_t i = 0; i < requests.size(); ++i) {
    clients.run([&, i] {
      if (failed > 0) return;  // the run failed: what is left is not sent
      records[i] = send(proxy, requests[i], o, watch);
      if (!records[i].ok) {
        ++failed;
        std::fprintf(stderr, "rd2h demo: request %s failed: %s\n", records[i].id.c_str(),
                     records[i].error.c_str());
      }
      tokens_done += records[i].tokens;
      ++done;
    });
  }
  std::mutex progress_mu;
  std::condition_variable progress_cv;
  bool finished = false;
  memory.sample(false);
  std::thread progress([&] {
    std::unique_lock lock(progress_mu);
    while (!progress_cv.wait_for(lock, 1s, [&] { return finished; })) {
      memory.sample(2 * done.load() >= requests.size());
      if (o.quiet) continue;
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      std::printf("rd2h demo: %5.1f s  %zu/%zu requests  %llu/%llu prompt tokens  %zu failed\n", s,
                  done.load(), requests.size(), static_cast<unsigned long long>(tokens_done.load()),
                  static_cast<unsigned long long>(total_tokens), failed.load());
      std::fflush(stdout);
    }
  });
  clients.stop();  // every request answered, or given up after a failure
  {
    std::lock_guard lock(progress_mu);
    finished = true;
  }
  progress_cv.notify_all();
  progress.join();
  memory.sample(true);
  return failed.load();
}

// The engines' timelines (not after a failure: an engine stuck on a dead peer answers its
// report only once its own deadlines fire), then every process stopped.
std::vector<EngineTrace> collect_and_stop(const DemoOptions& o, const RunSecrets& token, Fleet& f,
                                          bool failed, std::vector<std::string>& errors) {
  std::vector<EngineTrace> traces;
  for (const auto& [servers, role, tp] : {std::tuple{&f.prefill, "prefill", o.prefill_tp},
                                          std::tuple{&f.decode, "decode", o.decode_tp}}) {
    for (size_t i = 0; !failed && i < servers->size(); ++i) {
      auto t = collect((*servers)[i], role, static_cast<int>(i), tp, o.quiet, token);
      if (!t) errors.push_back(t.status().message());
      if (t) traces.push_back(std::move(*t));
    }
  }
  for (auto* s : f.children()) {
    if (Status st = stop(*s); !st) errors.push_back(st.message());
  }
  return traces;
}

}  // namespace

Expected<DemoSummary> run_demo_once(const DemoOptions& options) {
  DemoOptions o = options;
  if (o.prefill_host.empty()) o.prefill_host = o.host;
  if (o.decode_host.empty()) o.decode_host = o.host;
  const Say say = [&](const std::string& line) {
    if (!o.quiet) std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  };
  RD2H_RETURN_IF_ERROR(check_options(o));
  RunSecrets token;
  RD2H_RETURN_IF_ERROR(token.create(o.dp));
  const std::vector<Request> requests = workload(o);
  say_setup(o, requests, say);

  Fleet f;
  RD2H_RETURN_IF_ERROR(start_engines(o, token, f, say));
  RD2H_RETURN_IF_ERROR(start_proxy(o, token, f, say));
  const std::vector<Server*> children = f.children();
  Watch watch(children);
  say("rd2h demo: warming up: one request per Prefill-Decode pair connects their engines ...");
  RD2H_RETURN_IF_ERROR(warm_up(o, token, f, watch));

  std::vector<ClientRecord> records;
  MemoryWatch memory(children);
  const size_t failed = run_workload(o, requests, f.proxy->origin, watch, memory, records);
  watch.stop();  // from here on the processes are this thread's

  std::vector<std::string> errors;
  if (const std::string death = watch.death(); !death.empty()) errors.push_back(death);
  say("rd2h demo: collecting the engines' timelines and stopping them ...");
  const std::vector<EngineTrace> traces = collect_and_stop(o, token, f, failed != 0, errors);

  // Requests never sent (the run stopped at a failure) are not in the figures.
  std::erase_if(records, [](const ClientRecord& r) { return r.start_us == 0; });
  const DemoSummary summary = summarize(traces, records);
  if (failed == 0) {
    say("\nrd2h demo: summary\n" + format_summary(summary));
    say(memory.report());
  }
  if (!o.trace_file.empty()) {
    std::ofstream out(o.trace_file);
    out << chrome_trace(traces, records);
    if (!out) {
      errors.push_back("cannot write the trace to " + o.trace_file);
    } else {
      say("rd2h demo: timeline written to " + o.trace_file + " (open it in ui.perfetto.dev)");
    }
  }
  if (summary.failed > 0) {
    errors.push_back(std::to_string(summary.failed) + " of " + std::to_string(summary.requests) +
                     " requests sent failed" +
                     (summary.requests < requests.size()
                          ? " (the other " + std::to_string(requests.size() - summary.requests) +
                                " were not sent)"
                          : ""));
  }
  if (!errors.empty()) return internal_error(join(errors, "; "));
  return summary;
}

int run_demo(const DemoOptions& options) {
  StopOnSignal stop(kStopTimeout);
  auto summary = run_demo_once(options);
  if (stop.signal() != 0) {
    std::fprintf(stderr, "rd2h demo: stopped by signal %d\n", stop.signal());
    return 128 + stop.signal();
  }
  if (!summary) {
    std::fprintf(stderr, "rd2h demo: FAILED: %s\n", summary.status().message().c_str());
    return 1;
  }
  if (!options.quiet) {
    std::printf("rd2h demo: OK: every byte of every prompt's KV was verified on Decode\n");
  }
  return 0;
}

int run_bench_demo(const BenchDemoOptions& options) {
  struct Row {
    std::string topology;
    DemoSummary s;
  };
  std::vector<Row> rows;
  StopOnSignal stop(kStopTimeout);
  for (const auto& t : options.topologies) {
    DemoOptions o = options.demo;
    const size_t colon = t.find(':');
    try {
      if (colon == std::string::npos) throw std::invalid_argument(t);
      o.prefill_tp = std::stoi(t.substr(0, colon));
      o.decode_tp = std::stoi(t.substr(colon + 1));
    } catch (const std::exception&) {
      std::fprintf(stderr, "rd2h bench demo: topology '%s' is not P:D (e.g. 4:2)\n", t.c_str());
      return 2;
    }
    o.quiet = true;
    std::printf("rd2h bench demo: Prefill TP %d, Decode TP %d ...\n", o.prefill_tp, o.decode_tp);
    std::fflush(stdout);
    auto s = run_demo_once(o);
    if (stop.signal() != 0) {
      std::fprintf(stderr, "rd2h bench demo: stopped by signal %d\n", stop.signal());
      return 128 + stop.signal();
    }
    if (!s) {
      std::fprintf(stderr, "rd2h bench demo: %s: %s\n", t.c_str(), s.status().message().c_str());
      return 1;
    }
    rows.push_back({t, *s});
  }
  std::printf(
      "\n| P:D | hidden | layer compute p50 | layer read p50 | last-layer read p50 | "
      "Decode-ready p50 (x last-layer read) | p99 | core pickup p50 | GB/s in flight | "
      "GB/s run | TTFT p50 | wall |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& r : rows) {
    const auto& s = r.s;
    std::printf(
        "| %s | %.1f%% | %.0f us | %.0f us | %.0f us | %.0f us (%.1fx) | %.0f us (%.1fx) | %.0f us "
        "| "
        "%.2f | %.2f | %.0f ms | %.1f s |\n",
        r.topology.c_str(), 100 * s.hidden, s.compute_p50_us, s.read_p50_us,
        s.last_layer_read_p50_us, s.ready_delay_p50_us, s.ready_ratio_p50, s.ready_delay_p99_us,
        s.ready_ratio_p99, s.pickup_delay_p50_us, s.link_gbps, s.aggregate_gbps, s.ttft_p50_ms,
        s.wall_s);
  }
  return 0;
}

}  // namespace rd2h::sim
