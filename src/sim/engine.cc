#include "sim/engine.h"

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <condition_variable>
#include <ctime>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <utility>
#include <variant>

#include "common/metrics.h"
#include "common/trace.h"
#include "metaserver/http_server.h"
#include "metaserver/openai_body.h"
#include "rd2h/connector/metadata.h"
#include "rd2h/connector/scheduler.h"
#include "rd2h/version.h"
#include "sim/kv_model.h"
#include "sim/rank_set.h"
#include "sim/shared_pool.h"
#include "sim/sim_message.h"

namespace rd2h::sim {

using nlohmann::json;

namespace {

constexpr std::chrono::seconds kRankStartTimeout{60};
// How often a request's handler looks whether its client is still there.
constexpr std::chrono::milliseconds kLook{100};

std::string random_hex(size_t n) {
  thread_local std::mt19937_64 rng(std::random_device{}());
  static const char* digits = "0123456789abcdef";
  std::string s(n, '0');
  for (auto& c : s) c = digits[rng() & 15];
  return s;
}

}  // namespace

struct Result {
  bool ok = false;
  std::string text;
  std::string error;
  uint64_t verified_blocks = 0;
};

struct EngineRequest {
  connector::Request request;  // id, prompt length, params, tokens
  std::string ext_id;          // the id both sides share (the client's, per prompt)
  uint64_t max_tokens = 16;
  std::vector<int64_t> blocks;
  // Decode: a later prompt of a list, admitted only together with the prompts before it.
  bool admit_with_previous = false;
  uint64_t computed = 0;   // prompt tokens with KV
  uint64_t generated = 0;  // Decode
  // kAbandoned: Decode gave up a request whose KV was still loading (its client went away);
  // it keeps its blocks until the connector reports no read into them is in flight.
  enum class State { kWaitingRemote, kVerifying, kRunning, kAbandoned } state = State::kRunning;
  std::atomic<bool> cancelled{false};  // its client went away
  int verify_pending = 0;  // ranks still checking the request's KV
  uint64_t verified_blocks = 0;
  std::promise<Result> done;
  std::chrono::steady_clock::time_point arrived = std::chrono::steady_clock::now();
  // What the HTTP handler of its client request watches, and which prompt of it this is.
  std::shared_ptr<struct Progress> progress;
  size_t index = 0;

  void produced_token();
  void ended();
};

// Per prompt of one client request: the tokens generated so far and whether it ended. A
// stream sends each token as it appears.
struct Progress {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<uint64_t> tokens;
  std::vector<bool> ended;

  explicit Progress(size_t prompts) : tokens(prompts, 0), ended(prompts, false) {}
};

void EngineRequest::produced_token() {
  {
    std::lock_guard lock(progress->mu);
    ++progress->tokens[index];
  }
  progress->cv.notify_all();
}
void EngineRequest::ended() {
  {
    std::lock_guard lock(progress->mu);
    progress->ended[index] = true;
  }
  progress->cv.notify_all();
}

struct Engine::Impl {
  EngineConfig config;
  // GET /metrics.
  metrics::Registry registry;
  metaserver::HttpMetrics http_metrics{registry};
  metrics::Family<metrics::Histogram>& ttft = registry.histogram(
      "rd2h_engine_time_to_first_token_seconds",
      "From a prompt's arrival to its first token (Prefill: to the end of its prefill)", {},
      metrics::latency_buckets());
  metrics::Family<metrics::Histogram>& e2e = registry.histogram(
      "rd2h_engine_request_seconds", "From a prompt's arrival to its end, by outcome",
      {"outcome"}, metrics::latency_buckets());
  metrics::Family<metrics::Counter>& prompts_done = registry.counter(
      "rd2h_engine_prompts_total", "Prompts ended, by outcome", {"outcome"});
  // Decode: what its ranks' connectors read, summed over the ranks.
  metrics::Family<metrics::Counter>& kv_layers = registry.counter(
      "rd2h_kv_layers_total", "Layers of requests loaded (done) or failed, summed over ranks",
      {"outcome"});
  metrics::Family<metrics::Counter>& kv_reads =
      registry.counter("rd2h_kv_reads_total", "Batched reads from Prefill ranks");
  metrics::Family<metrics::Counter>& kv_bytes =
      registry.counter("rd2h_kv_bytes_read_total", "KV bytes read from Prefill ranks");
  metrics::Family<metrics::Histogram>& kv_read_seconds = registry.histogram(
      "rd2h_kv_layer_read_seconds", "Latency of each batched read (one per layer and peer)", {},
      metrics::latency_buckets());
  void take_transfer(const json& delta) {
    kv_layers.with({"done"}).inc(delta.value("layers_done", uint64_t{0}));
    kv_layers.with({"failed"}).inc(delta.value("layers_failed", uint64_t{0}));
    kv_reads.with().inc(delta.value("reads", uint64_t{0}));
    kv_bytes.with().inc(delta.value("bytes_read", uint64_t{0}));
    kv_read_seconds.with().add(delta.value("read_buckets", std::vector<uint64_t>{}),
                               delta.value("read_seconds", 0.0));
  }
  bool prefill = false;
  int64_t started_at = static_cast<int64_t>(std::time(nullptr));
  std::unique_ptr<KvModel> model;
  std::unique_ptr<connector::Scheduler> scheduler;
  std::unique_ptr<RankSet> ranks;
  std::optional<SharedPool> pool;  // Decode: main KV of every layer, shared by the ranks
  bool corrupt_pending = false;
  uint64_t checksum = 0;  // Decode's reads of its pool while decoding

  std::unique_ptr<metaserver::HttpServer> http;
  int http_port = 0;

  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<EngineRequest>> incoming;
  std::set<std::string> in_flight;  // ext ids of requests not answered yet
  // Reports waiting for the ranks' timeline events (the core thread alone talks to them).
  std::vector<std::promise<void>> event_drains;
  bool stopping = false;
  bool cancels_pending = false;  // a client went away: the core looks for what it gave up
  EngineStats stats;
  std::thread core;

  std::vector<int64_t> free_blocks;
  // Admitted once blocks free up, first come first served. On Decode a prompt list is one
  // entry: it gets blocks for all its prompts at once or none, since Prefill starts only once
  // every prompt has its blocks, and a list holding some while waiting for the rest could
  // wait on blocks that only requests behind it would free.
  std::deque<std::vector<std::shared_ptr<EngineRequest>>> waiting_blocks;
  std::vector<std::shared_ptr<EngineRequest>> active;
  std::map<std::string, std::shared_ptr<EngineRequest>> verifying;  // by ext id

  std::chrono::milliseconds job_timeout() const {
    return config.request_timeout + config.connector.send_timeout;
  }
  // Blocks holding the prompt's KV, and blocks the request needs here (Decode also holds
  // the tokens it generates).
  size_t prompt_blocks(const EngineRequest& r) const {
    return (r.request.num_prompt_tokens + config.model.block_size - 1) / config.model.block_size;
  }
  size_t blocks_needed(const EngineRequest& r) const {
    return blocks_needed(r.request.num_prompt_tokens, r.max_tokens);
  }
  size_t blocks_needed(uint64_t prompt_tokens, uint64_t max_tokens) const {
    return (prompt_tokens + (prefill ? 0 : max_tokens) + config.model.block_size - 1) /
           config.model.block_size;
  }
  // Why prompts that must hold blocks at once can never get them here (more than the
  // engine has at all), if so.
  std::optional<std::string> never_fits(
      const std::vector<std::pair<std::string, std::vector<int64_t>>>& prompts,
      uint64_t max_tokens) const;
  // Runs `job` on every rank, then takes what their verifiers finished.
  Expected<std::vector<json>> call_ranks(const json& job) {
    auto replies = ranks->call_all(job, job_timeout());
    take_verified(ranks->take_late());
    if (replies) take_verified(*replies);
    return replies;
  }
  void take_verified(const std::vector<json>& replies);
  // Ends what clients that went away gave up (core thread).
  void give_up_cancelled();

  Status init();
  struct Call;
  void serve(const httplib::Request& req, httplib::Response& res, bool chat);
  void report(httplib::Response& res);
  void run_core();
  void admit(const std::shared_ptr<EngineRequest>& r);
  Status step();
  void complete(const std::shared_ptr<EngineRequest>& r, Result result);
  // Blocks [first, last) of `r` as a rank job names them.
  json blocks_json(const EngineRequest& r, size_t first, size_t last) const;
  Status verify(const std::shared_ptr<EngineRequest>& r);
  void decode_token(EngineRequest& r);
};

std::optional<std::string> Engine::Impl::never_fits(
    const std::vector<std::pair<std::string, std::vector<int64_t>>>& prompts,
    uint64_t max_tokens) const {
  const uint64_t bs = config.model.block_size;
  const std::string capacity = "; the engine holds " +
                               std::to_string(config.model.num_blocks * bs) + " tokens (" +
                               std::to_string(config.model.num_blocks) + " blocks of " +
                               std::to_string(bs) + ")";
  const std::string generated =
      prefill ? std::string() : " and up to " + std::to_string(max_tokens) + " generated";
  // Prefill computes the prompts of a list one after another; Decode holds them all at once.
  if (prefill || prompts.size() == 1) {
    for (const auto& [id, tokens] : prompts) {
      const size_t need = blocks_needed(tokens.size(), max_tokens);
      if (need > config.model.num_blocks) {
        return "request " + id + " of " + std::to_string(tokens.size()) + " prompt tokens" +
               generated + " needs " + std::to_string(need) + " blocks of KV cache" + capacity;
      }
    }
    return std::nullopt;
  }
  size_t need = 0;
  for (const auto& [id, tokens] : prompts) need += blocks_needed(tokens.size(), max_tokens);
  if (need <= config.model.num_blocks) return std::nullopt;
  return "the list of " + std::to_string(prompts.size()) + " prompts" + generated + " each needs " +
         std::to_string(need) + " blocks of KV cache at once" + capacity;
}

json Engine::Impl::blocks_json(const EngineRequest& r, size_t first, size_t last) const {
  const uint64_t bs = config.model.block_size;
  const auto& tokens = r.request.prompt_token_ids;
  last = std::min(last, r.blocks.size());
  const size_t begin = std::min(tokens.size(), first * bs);
  const size_t end = std::min(tokens.size(), last * bs);
  return {{"req", r.ext_id},
          {"first", first},
          {"blocks", std::vector<int64_t>(r.blocks.begin() + static_cast<long>(first),
                                          r.blocks.begin() + static_cast<long>(last))},
          {"tokens", std::vector<int64_t>(tokens.begin() + static_cast<long>(begin),
                                          tokens.begin() + static_cast<long>(end))}};
}

Status Engine::Impl::init() {
  const auto& m = config.model;
  if (m.layers < 1 || m.block_size == 0 || m.num_blocks == 0 || m.bytes_per_token.size() < 2 ||
      std::find(m.bytes_per_token.begin(), m.bytes_per_token.end(), 0u) !=
          m.bytes_per_token.end()) {
    return invalid_argument(
        "model layout: layers, block size, blocks and tensor sizes must be set");
  }
  if (config.tp_size < 1) return invalid_argument("TP size must be at least 1");
  if (config.token_budget == 0) return invalid_argument("token budget must be at least 1");
  prefill = config.connector.role == connector::KvRole::kProducer;
  model = std::make_unique<KvModel>(m);
  corrupt_pending = prefill && config.test_corrupt_layer >= 0;
  trace::set_enabled(config.trace);
  connector::Parallel parallel{config.tp_size, 1, 1, 0};
  connector::KvCacheGroup group{{}, m.block_size};
  for (int l = 0; l < m.layers; ++l) group.layer_names.push_back(layer_name(l));
  auto s = connector::Scheduler::create(config.connector, parallel, {group});
  if (!s) return s.status();
  scheduler = std::move(*s);
  if (!prefill) {
    auto p = SharedPool::create(model->main_pool_bytes());
    if (!p) return p.status();
    pool = std::move(*p);
    stats.main_pool_locked = pool->lock();
  }
  if (config.worker_executable.empty()) {
    return invalid_argument(
        "worker_executable: the rd2h binary the TP rank processes run is not set");
  }
  auto set = RankSet::start(config.worker_executable, config.tp_size, kRankStartTimeout);
  if (!set) return set.status();
  ranks = std::move(*set);

  json init = {{"op", "init"},
               {"tp", config.tp_size},
               {"trace", config.trace},
               {"connector", config.connector.to_json()},
               {"layers", m.layers},
               {"block_size", m.block_size},
               {"bytes_per_token", m.bytes_per_token},
               {"num_blocks", m.num_blocks},
               {"slots", m.prefill_slots},
               {"compute_ns_per_token", config.compute_ns_per_token},
               {"compute_min_layer_us", config.compute_min_layer_us},
               {"corrupt_layer", config.test_corrupt_layer},
               {"fault_rank", config.test_fault_rank},
               {"host", config.connector.host}};
  if (pool) init["pool"] = pool->name();
  init["ipc_dir"] = ranks->ipc_dir();
  // Decode rank 0 binds the group's all-gather before the others connect to it.
  std::vector<json> first(ranks->size());
  first[0] = init;
  first[0]["rank"] = 0;
  auto r0 = ranks->call(first, kRankStartTimeout);
  if (!r0) return r0.status();
  if (!(*r0)[0].value("ok", false)) {
    return internal_error("TP rank 0: " + (*r0)[0].value("error", std::string()));
  }
  std::vector<json> rest(ranks->size());
  for (size_t k = 1; k < rest.size(); ++k) {
    rest[k] = init;
    rest[k]["rank"] = k;
    rest[k]["gather"] = (*r0)[0].value("gather", std::string());
  }
  auto rn = ranks->call(rest, kRankStartTimeout);
  if (!rn) return rn.status();
  for (size_t k = 1; k < rest.size(); ++k) {
    if (!(*rn)[k].value("ok", false)) {
      return internal_error("TP rank " + std::to_string(k) + ": " +
                            (*rn)[k].value("error", std::string()));
    }
  }
  if (pool) pool->unlink();  // every rank mapped it: nothing is left behind after a crash
  for (int64_t b = static_cast<int64_t>(m.num_blocks) - 1; b >= 0; --b) free_blocks.push_back(b);
  stats.free_blocks = m.num_blocks;
  return Status::ok();
}

void Engine::Impl::complete(const std::shared_ptr<EngineRequest>& r, Result result) {
  // An abandoned request was finished with the connector when it was given up.
  if (r->state != EngineRequest::State::kAbandoned) (void)scheduler->request_finished(r->request);
  free_blocks.insert(free_blocks.end(), r->blocks.begin(), r->blocks.end());
  r->blocks.clear();
  {
    std::lock_guard lock(mu);
    if (!result.ok) ++stats.failed_requests;
    stats.verified_blocks += result.verified_blocks;
    in_flight.erase(r->ext_id);
  }
  if (auto it = verifying.find(r->ext_id); it != verifying.end() && it->second == r) {
    verifying.erase(it);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - r->arrived).count();
  if (prefill && result.ok) ttft.with().observe(seconds);
  e2e.with({result.ok ? "ok" : "failed"}).observe(seconds);
  prompts_done.with({result.ok ? "ok" : "failed"}).inc();
  r->done.set_value(std::move(result));
  r->ended();
  active.erase(std::remove(active.begin(), active.end(), r), active.end());
}

void Engine::Impl::give_up_cancelled() {
  // Still queued for blocks: they end here (a list's prompts share one client).
  for (auto group = waiting_blocks.begin(); group != waiting_blocks.end();) {
    const bool cancelled = std::any_of(group->begin(), group->end(),
                                       [](const auto& r) { return r->cancelled.load(); });
    if (!cancelled) {
      ++group;
      continue;
    }
    for (auto& r : *group) complete(r, {false, "", "the client went away"});
    group = waiting_blocks.erase(group);
  }
  // Between steps nothing of a request is in flight but Decode's reads: a request Prefill
  // is computing, or one Decode is generating for, ends now and frees its blocks.
  for (auto r : std::vector<std::shared_ptr<EngineRequest>>(active)) {
    if (!r->cancelled.load()) continue;
    if (prefill || r->state == EngineRequest::State::kRunning) {
      complete(r, {false, "", "the client went away"});
    } else if (r->state == EngineRequest::State::kWaitingRemote) {
      // Decode, KV still coming: the connector stops expecting it now. Its blocks stay until
      // the connector reports no read into them is in flight (the next steps). A request
      // being verified finishes on its own shortly.
      (void)scheduler->request_finished(r->request);
      r->state = EngineRequest::State::kAbandoned;
    }
  }
}

void Engine::Impl::admit(const std::shared_ptr<EngineRequest>& r) {
  const uint64_t bs = config.model.block_size;
  const uint64_t prompt = r->request.num_prompt_tokens;
  const size_t need = blocks_needed(*r);
  r->blocks.assign(free_blocks.end() - static_cast<long>(need), free_blocks.end());
  free_blocks.resize(free_blocks.size() - need);
  active.push_back(r);
  const bool remote = r->request.params && (prefill ? r->request.params->do_remote_decode
                                                    : r->request.params->do_remote_prefill);
  if (prefill || !remote) {
    if (Status st = scheduler->update_state_after_alloc(r->request, {r->blocks}, 0); !st) {
      return complete(r, {false, "", st.message()});
    }
    if (!prefill) r->computed = prompt;  // a plain request on Decode: nothing to pull
    return;
  }
  // Decode: a local prefix cache holds the first whole blocks; the rest comes from Prefill.
  uint64_t cached = std::min(config.decode_cached_tokens, prompt > 0 ? prompt - 1 : 0) / bs * bs;
  if (cached > 0) {
    auto written = call_ranks({{"op", "write"}, {"writes", {blocks_json(*r, 0, cached / bs)}}});
    if (!written) return complete(r, {false, "", written.status().message()});
  }
  const auto matched = scheduler->get_num_new_matched_tokens(r->request, cached);
  if (Status st = scheduler->update_state_after_alloc(r->request, {r->blocks}, matched.tokens);
      !st) {
    return complete(r, {false, "", st.message()});
  }
  r->computed = cached;
  r->state =
      matched.load_async ? EngineRequest::State::kWaitingRemote : EngineRequest::State::kRunning;
}

Status Engine::Impl::verify(const std::shared_ptr<EngineRequest>& r) {
  const size_t blocks = prompt_blocks(*r);
  r->state = EngineRequest::State::kVerifying;
  r->verify_pending = static_cast<int>(ranks->size());
  verifying[r->ext_id] = r;
  auto replies = call_ranks({{"op", "verify"}, {"writes", {blocks_json(*r, 0, blocks)}}});
  if (!replies) return replies.status();
  return Status::ok();
}

void Engine::Impl::take_verified(const std::vector<json>& replies) {
  for (const auto& reply : replies) {
    for (const auto& v : reply.value("verified", json::array())) {
      auto it = verifying.find(v.value("req", std::string()));
      if (it == verifying.end()) continue;  // already failed by another rank's check
      auto r = it->second;
      if (!v.value("ok", false)) {
        complete(r, {false, "", "KV check failed: " + v.value("error", std::string())});
        continue;
      }
      if (--r->verify_pending > 0) continue;
      verifying.erase(it);
      r->verified_blocks = prompt_blocks(*r) * static_cast<uint64_t>(config.model.layers);
      r->computed = r->request.num_prompt_tokens;
      r->state = EngineRequest::State::kRunning;
    }
  }
}

void Engine::Impl::decode_token(EngineRequest& r) {
  // "Attention" over the request's KV: one block of one layer per token, K and V, read
  // from the pool the ranks share.
  const size_t blocks = prompt_blocks(r);
  const int layer = static_cast<int>(r.generated % static_cast<uint64_t>(config.model.layers));
  const int64_t block = r.blocks[r.generated % blocks];
  for (size_t t = 0; t < 2; ++t) {
    const auto* p =
        reinterpret_cast<const uint64_t*>(pool->data() + model->decode_offset(layer, t, block));
    for (size_t i = 0; i < model->block_bytes()[t] / 8; ++i) checksum += p[i];
  }
  if (++r.generated == 1) {
    trace::instant("first token", "core", -1, r.ext_id);
    ttft.with().observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - r.arrived).count());
  }
  r.produced_token();
}

Status Engine::Impl::step() {
  std::vector<connector::ScheduledRequest> scheduled;
  struct Write {
    std::shared_ptr<EngineRequest> r;
    size_t first, last;
  };
  std::vector<Write> writes;
  uint64_t step_tokens = 0;
  const uint64_t bs = config.model.block_size;
  if (prefill) {
    uint64_t budget = config.token_budget;
    for (auto& r : active) {
      const uint64_t prompt = r->request.num_prompt_tokens;
      const uint64_t chunk = std::min(budget, prompt - r->computed);
      if (chunk == 0) continue;
      const uint64_t before = r->computed;
      r->computed += chunk;
      budget -= chunk;
      step_tokens += chunk;
      scheduled.push_back({r->request.request_id, {}, r->computed});
      writes.push_back({r, before / bs, (r->computed + bs - 1) / bs});
      if (budget == 0) break;
    }
  }
  auto handed = scheduler->build_connector_meta(scheduled);
  if (!handed) return handed.status();
  const std::vector<std::byte> meta = connector::encode(*handed);  // as a host ships it
  bool waiting = false;
  for (auto& r : active) waiting = waiting || r->state != EngineRequest::State::kRunning;
  if (scheduled.empty() && !waiting && handed->empty()) {
    if (!prefill) {
      for (auto r : std::vector<std::shared_ptr<EngineRequest>>(active)) {
        decode_token(*r);
        if (r->generated >= r->max_tokens) {
          complete(r, {true, std::string(r->max_tokens, 'y'), "", r->verified_blocks});
        }
      }
    }
    return Status::ok();
  }
  {
    std::lock_guard lock(mu);
    ++stats.steps;
    stats.prefill_chunks += scheduled.size();
  }
  json job = {{"op", "step"},
              {"meta", json::binary(std::vector<uint8_t>(
                           reinterpret_cast<const uint8_t*>(meta.data()),
                           reinterpret_cast<const uint8_t*>(meta.data()) + meta.size()))},
              {"tokens", step_tokens},
              {"writes", json::array()}};
  for (const auto& w : writes) job["writes"].push_back(blocks_json(*w.r, w.first, w.last));
  if (corrupt_pending && !writes.empty() &&
      writes.front().r->computed == writes.front().r->request.num_prompt_tokens) {
    job["corrupt"] = true;
    corrupt_pending = false;
  }
  auto replies = call_ranks(job);
  if (!replies) return replies.status();
  Status failure;
  int64_t compute_end_us = 0;
  for (size_t k = 0; k < replies->size(); ++k) {
    const json& reply = (*replies)[k];
    if (!reply.value("ok", false) && failure.is_ok()) {
      failure = internal_error("TP rank " + std::to_string(k) + ": " +
                               reply.value("error", std::string()));
    }
    compute_end_us = std::max(compute_end_us, reply.value("compute_end_us", int64_t{0}));
  }
  if (prefill) {
    for (const auto& wr : writes) {
      if (!failure.is_ok()) {
        complete(wr.r, {false, "", failure.message()});
      } else if (wr.r->computed == wr.r->request.num_prompt_tokens) {
        if (trace::enabled()) {
          trace::record({"prefill done", "core", compute_end_us, -1, -1, -1, 0, wr.r->ext_id});
        }
        complete(wr.r, {true, "x", "", 0});  // the one token Prefill is asked for
      }
    }
    return Status::ok();
  }
  for (const auto& reply : *replies) {
    if (auto t = reply.find("transfer"); t != reply.end() && t->is_object()) take_transfer(*t);
  }
  if (!failure.is_ok()) return failure;
  std::set<int64_t> bad;
  for (const auto& reply : *replies) {
    for (int64_t b : reply.value("load_errors", std::vector<int64_t>{})) bad.insert(b);
  }
  const auto recving = (*replies)[0].value("recving", std::vector<std::string>{});
  const std::set<std::string> ready(recving.begin(), recving.end());
  for (auto r : std::vector<std::shared_ptr<EngineRequest>>(active)) {
    if (r->state == EngineRequest::State::kAbandoned) {
      if (ready.count(r->request.request_id) != 0) {
        complete(r, {false, "", "the client went away while its KV loaded"});
      }
      continue;
    }
    if (r->state == EngineRequest::State::kWaitingRemote) {
      if (ready.count(r->request.request_id) == 0) continue;
      trace::instant("kv ready", "core", -1, r->ext_id);
      const size_t blocks = prompt_blocks(*r);
      bool failed_load = false;
      for (size_t i = 0; i < blocks; ++i) failed_load = failed_load || bad.count(r->blocks[i]);
      if (failed_load) {
        complete(r, {false, "", "the KV of the request failed to load"});
        continue;
      }
      if (Status st = verify(r); !st) complete(r, {false, "", st.message()});
      continue;
    }
    if (r->state != EngineRequest::State::kRunning || r->blocks.empty()) continue;
    decode_token(*r);
    if (r->generated >= r->max_tokens) {
      complete(r, {true, std::string(r->max_tokens, 'y'), "", r->verified_blocks});
    }
  }
  return Status::ok();
}

void Engine::Impl::run_core() {
  while (true) {
    std::deque<std::shared_ptr<EngineRequest>> fresh;
    std::vector<std::promise<void>> drains;
    bool cancels = false;  // a client went away since the last look
    {
      std::unique_lock lock(mu);
      const bool busy = !active.empty();
      cv.wait_for(lock, busy ? std::chrono::milliseconds(1) : std::chrono::milliseconds(50),
                  [&] {
                    return stopping || !incoming.empty() || !event_drains.empty() ||
                           cancels_pending;
                  });
      cancels = std::exchange(cancels_pending, false);
      if (stopping) break;
      fresh.swap(incoming);
      drains.swap(event_drains);
    }
    if (!drains.empty()) {
      (void)call_ranks({{"op", "events"}});  // their events go to this process's recorder
      for (auto& d : drains) d.set_value();
      drains.clear();
    }
    // A list's prompts were queued together, so they are together in `fresh`.
    for (auto& r : fresh) {
      if (!r->admit_with_previous || waiting_blocks.empty()) waiting_blocks.emplace_back();
      waiting_blocks.back().push_back(r);
    }
    if (cancels) give_up_cancelled();
    // First come, first served: a large request is not starved by smaller ones behind it.
    while (!waiting_blocks.empty()) {
      size_t need = 0;
      for (const auto& r : waiting_blocks.front()) need += blocks_needed(*r);
      if (need > free_blocks.size() && need <= config.model.num_blocks) break;
      auto next = std::move(waiting_blocks.front());
      waiting_blocks.pop_front();
      for (auto& r : next) {
        if (need > config.model.num_blocks) {  // serve() refuses these; nothing may wait on them
          complete(r, {false, "",
                       "needs " + std::to_string(need) + " blocks, the engine has " +
                           std::to_string(config.model.num_blocks)});
        } else {
          admit(r);
        }
      }
    }
    if (Status st = step(); !st) {
      for (auto r : std::vector<std::shared_ptr<EngineRequest>>(active)) {
        complete(r, {false, "", st.message()});
      }
    }
    size_t waiting = 0;
    for (const auto& group : waiting_blocks) waiting += group.size();
    std::lock_guard lock(mu);
    stats.free_blocks = free_blocks.size();
    stats.waiting_for_blocks = waiting;
  }
  for (auto r : std::vector<std::shared_ptr<EngineRequest>>(active)) {
    complete(r, {false, "", "the engine is stopping"});
  }
  for (auto& group : waiting_blocks) {
    for (auto& r : group) complete(r, {false, "", "the engine is stopping"});
  }
  waiting_blocks.clear();
  std::lock_guard lock(mu);
  for (auto& d : event_drains) d.set_value();
  event_drains.clear();
  for (auto& r : incoming) {
    in_flight.erase(r->ext_id);
    r->done.set_value({false, "", "the engine is stopping"});
    r->ended();
  }
  incoming.clear();
}

// One client request as its handler and its stream see it.
struct Engine::Impl::Call {
  std::string id, object, model;
  bool chat = false;
  int64_t created = 0;
  std::vector<std::string> children;      // ext ids, one per prompt
  std::vector<uint64_t> prompt_tokens;    // per prompt
  std::vector<std::shared_future<Result>> results;
  std::shared_ptr<Progress> progress;
  std::chrono::steady_clock::time_point deadline;
  std::function<bool()> client_went_away;  // true (and the request given up) if it did
  char token_text = 'y';                   // what one generated token reads as
  uint64_t recompute_after = 0;            // end the stream "recomputed" after this many
  uint64_t max_tokens = 0;                 // the request's budget (never cut at its end)
  std::function<void()> give_up;           // cancels the request in the engine core

  json chunk(json choices) const {
    return {{"id", id}, {"object", object + ".chunk"}, {"created", created}, {"model", model},
            {"choices", std::move(choices)}};
  }
  json token_choice(size_t i, const std::string& text, json finish = nullptr) const {
    json c = {{"index", i}};
    if (chat) {
      c["delta"] = text.empty() ? json::object() : json{{"content", text}};
    } else {
      c["text"] = text;
    }
    c["logprobs"] = nullptr;
    c["finish_reason"] = std::move(finish);
    return c;
  }
  json usage(const std::vector<Result>& done) const {
    uint64_t prompt = 0, completion = 0;
    for (uint64_t t : prompt_tokens) prompt += t;
    for (const auto& r : done) completion += r.text.size();
    return {{"prompt_tokens", prompt},
            {"completion_tokens", completion},
            {"total_tokens", prompt + completion}};
  }
  // Every prompt's result, or an HTTP status and why not.
  std::variant<std::vector<Result>, std::pair<int, std::string>> wait() const {
    std::vector<Result> done;
    for (size_t i = 0; i < results.size(); ++i) {
      while (results[i].wait_for(kLook) != std::future_status::ready) {
        if (std::chrono::steady_clock::now() >= deadline) {
          return std::pair{504, "request " + children[i] + " did not finish in time"};
        }
        if (client_went_away()) return std::pair{499, std::string("the client went away")};
      }
      const Result& r = results[i].get();
      if (!r.ok) return std::pair{500, "request " + children[i] + ": " + r.error};
      done.push_back(r);
    }
    return done;
  }
  json whole(const std::vector<Result>& done) const {
    json choices = json::array();
    uint64_t verified = 0;
    for (size_t i = 0; i < done.size(); ++i) {
      json c = {{"index", i}};
      if (chat) {
        c["message"] = {{"role", "assistant"}, {"content", done[i].text}};
      } else {
        c["text"] = done[i].text;
      }
      c["logprobs"] = nullptr;
      c["finish_reason"] = "length";
      choices.push_back(std::move(c));
      verified += done[i].verified_blocks;
    }
    return {{"id", id},          {"object", object},     {"created", created},
            {"model", model},    {"choices", choices},   {"usage", usage(done)},
            {"rd2h", {{"verified_blocks", verified}}}};
  }
  // Ends the stream as a Decode that lost the request's KV: the request is given up, its
  // last event has stop reason "recomputed".
  bool recomputed(httplib::DataSink& sink, uint64_t tokens, bool include_usage) const {
    give_up();
    json c = token_choice(0, "", "stop");
    c["stop_reason"] = "recomputed";
    std::string out = "data: " + chunk({c}).dump() + "\n\n";
    if (include_usage) {
      json u = chunk(json::array());
      u["usage"] = {{"prompt_tokens", prompt_tokens[0]},
                    {"completion_tokens", tokens},
                    {"total_tokens", prompt_tokens[0] + tokens}};
      out += "data: " + u.dump() + "\n\n";
    }
    out += "data: [DONE]\n\n";
    sink.write(out.data(), out.size());
    sink.done();
    return true;
  }
  // The stream: one event per token as the engine makes it, a last event per prompt with its
  // finish reason, the usage if asked for, then [DONE]. False if the client went away.
  bool stream(httplib::DataSink& sink, bool include_usage) const {
    auto send = [&](const json& event) {
      const std::string data = "data: " + event.dump() + "\n\n";
      return sink.write(data.data(), data.size());
    };
    auto finish = [&](const std::string& data) {
      sink.write(data.data(), data.size());
      sink.done();
      return true;
    };
    auto with_usage = [&](json event) {
      if (include_usage) event["usage"] = nullptr;
      return event;
    };
    const size_t n = children.size();
    if (chat) {
      json c = token_choice(0, "");
      c["delta"] = {{"role", "assistant"}, {"content", ""}};
      if (!send(with_usage(chunk({c})))) return false;
    }
    std::vector<uint64_t> sent(n, 0);
    for (;;) {
      std::vector<uint64_t> made;
      bool all_ended;
      {
        std::unique_lock lock(progress->mu);
        auto news = [&] {
          for (size_t i = 0; i < n; ++i) {
            if (progress->tokens[i] > sent[i]) return true;
          }
          return std::all_of(progress->ended.begin(), progress->ended.end(),
                             [](bool e) { return e; });
        };
        progress->cv.wait_for(lock, kLook, news);
        made = progress->tokens;
        all_ended = std::all_of(progress->ended.begin(), progress->ended.end(),
                                [](bool e) { return e; });
      }
      // A stream that ends "recomputed" carries exactly recompute_after tokens.
      const uint64_t cut = recompute_after > 0 && n == 1 ? recompute_after : UINT64_MAX;
      for (size_t i = 0; i < n; ++i) {
        for (; sent[i] < std::min(made[i], cut); ++sent[i]) {
          if (!send(with_usage(chunk({token_choice(i, std::string(1, token_text))})))) {
            client_went_away();
            return false;
          }
        }
      }
      // Cut whether or not the engine made the rest already (it may be that fast): the
      // stream ends at exactly recompute_after tokens, every time.
      if (recompute_after > 0 && n == 1 && sent[0] >= recompute_after && sent[0] < max_tokens) {
        return recomputed(sink, sent[0], include_usage);
      }
      if (all_ended) break;
      if (std::chrono::steady_clock::now() >= deadline) {
        return finish("data: " +
                      metaserver::api_error_json(504, "the request did not finish in time") +
                      "\n\ndata: [DONE]\n\n");
      }
      if (client_went_away()) return false;
    }
    auto outcome = wait();
    if (auto* failed = std::get_if<std::pair<int, std::string>>(&outcome)) {
      if (failed->first == 499) return false;
      return finish("data: " + metaserver::api_error_json(failed->first, failed->second) +
                    "\n\ndata: [DONE]\n\n");
    }
    const auto& done = std::get<std::vector<Result>>(outcome);
    uint64_t verified = 0;
    for (size_t i = 0; i < n; ++i) {
      // What the stream has not carried yet (Prefill's one token is not generated in steps).
      if (done[i].text.size() > sent[i] &&
          !send(with_usage(chunk({token_choice(i, done[i].text.substr(sent[i]))})))) {
        return false;
      }
      verified += done[i].verified_blocks;
      json last = with_usage(chunk({token_choice(i, "", "length")}));
      if (i + 1 == n) last["rd2h"] = {{"verified_blocks", verified}};
      if (!send(last)) return false;
    }
    if (include_usage) {
      json u = chunk(json::array());
      u["usage"] = usage(done);
      if (!send(u)) return false;
    }
    return finish("data: [DONE]\n\n");
  }
};

// A request id a client may give (X-Request-Id): it becomes part of the transfer's ids, so
// it is short and plain.
bool plain_request_id(const std::string& id) {
  if (id.empty() || id.size() > 128) return false;
  return std::all_of(id.begin(), id.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' ||
           c == ':';
  });
}

void Engine::Impl::serve(const httplib::Request& req, httplib::Response& res, bool chat) {
  auto fail = [&](int status, const std::string& why, const std::string& param = {},
                  const std::string& code = {}) {
    metaserver::set_api_error(res, status, why, param, code);
  };
  std::string parent = req.get_header_value("X-Request-Id");
  if (!parent.empty()) {
    res.set_header("X-Request-Id", parent);
    if (!plain_request_id(parent)) {
      return fail(400,
                  "X-Request-Id must be 1 to 128 letters, digits and the characters - _ . :",
                  "X-Request-Id");
    }
  }
  auto body = json::parse(req.body, nullptr, false);
  if (body.is_discarded() || !body.is_object()) return fail(400, "the body is not a JSON object");
  const metaserver::PromptLimits limits{config.max_prompts, config.max_prompt_tokens};
  metaserver::BodyFault fault;
  if (auto checked = metaserver::check_openai_body(body, chat, limits, &fault); !checked) {
    return fail(400, checked.status().message(), fault.param, fault.code);
  }
  if (auto m = body.find("model"); m != body.end() && m->is_string() &&
                                   *m != config.served_model_name) {
    return fail(404,
                "the model '" + m->get<std::string>() + "' does not exist; this engine serves '" +
                    config.served_model_name + "'",
                "model", "model_not_found");
  }
  std::optional<connector::KvTransferParams> params;
  if (body.contains("kv_transfer_params") && !body["kv_transfer_params"].is_null()) {
    auto p = connector::KvTransferParams::from_json(body["kv_transfer_params"].dump());
    if (!p) return fail(400, p.status().message(), "kv_transfer_params");
    params = std::move(*p);
  }
  if (parent.empty()) parent = random_hex(32);
  auto tokens_of = [](const json& prompt) {
    std::vector<int64_t> t;
    if (prompt.is_string()) {
      for (unsigned char c : prompt.get<std::string>()) t.push_back(c);
    } else if (prompt.is_array()) {
      for (const auto& x : prompt) {
        if (x.is_number_integer()) t.push_back(x.get<int64_t>());
      }
    }
    return t;
  };
  // Field types were checked above; null stands for the field's absence.
  auto field = [&](const char* name, json fallback) {
    auto it = body.find(name);
    return it == body.end() || it->is_null() ? fallback : *it;
  };
  std::vector<std::pair<std::string, std::vector<int64_t>>> children;
  if (chat) {
    std::string text;  // every message's text, one token per byte
    for (const auto& m : field("messages", json::array())) {
      auto c = m.find("content");
      if (c == m.end() || c->is_null()) continue;
      if (c->is_string()) {
        text += c->get<std::string>();
        continue;
      }
      for (const auto& part : *c) text += part.value("text", std::string());
    }
    children.push_back({"chatcmpl-" + parent, tokens_of(json(text))});
  } else {
    const json prompt = field("prompt", json(""));
    if (prompt.is_array() && !prompt.empty() && !prompt[0].is_number()) {
      for (size_t i = 0; i < prompt.size(); ++i) {
        children.push_back({"cmpl-" + parent + "-" + std::to_string(i), tokens_of(prompt[i])});
      }
    } else {
      children.push_back({"cmpl-" + parent + "-0", tokens_of(prompt)});
    }
  }
  const char* prompt_param = chat ? "messages" : "prompt";
  for (size_t i = 0; i < children.size(); ++i) {
    const auto& [id, tokens] = children[i];
    // A text prompt is one token per byte here.
    if (tokens.size() > config.max_prompt_tokens) {
      return fail(400,
                  "request " + id + " has " + std::to_string(tokens.size()) +
                      " prompt tokens; the limit is " + std::to_string(config.max_prompt_tokens),
                  prompt_param, "context_length_exceeded");
    }
    if (tokens.empty()) return fail(400, "request " + id + " has an empty prompt", prompt_param);
  }
  const uint64_t max_tokens = metaserver::requested_max_tokens(body, 16);
  if (auto why = never_fits(children, max_tokens)) {
    return fail(400, *why, prompt_param, "context_length_exceeded");
  }
  auto call = std::make_shared<Call>();
  call->chat = chat;
  call->id = chat ? "chatcmpl-" + parent : "cmpl-" + parent;
  call->object = chat ? "chat.completion" : "text_completion";
  call->model = config.served_model_name;
  call->created = static_cast<int64_t>(std::time(nullptr));
  call->token_text = prefill ? 'x' : 'y';
  if (!prefill) call->recompute_after = config.test_recompute_after;
  call->max_tokens = max_tokens;
  call->progress = std::make_shared<Progress>(children.size());
  call->deadline = std::chrono::steady_clock::now() + config.request_timeout;
  std::vector<std::shared_ptr<EngineRequest>> requests;
  {
    std::lock_guard lock(mu);
    if (stopping) return fail(503, "the engine is stopping");
    for (auto& [id, tokens] : children) {
      // Both sides of the transfer know a request by this id: two at once would mix.
      if (in_flight.count(id) != 0) {
        return fail(409, "request " + id + " is already in flight", "X-Request-Id");
      }
    }
    for (auto& [id, tokens] : children) in_flight.insert(id);
    for (auto& [id, tokens] : children) {
      auto r = std::make_shared<EngineRequest>();
      r->ext_id = id;
      r->request.request_id = id + "-" + random_hex(8);
      r->request.num_prompt_tokens = tokens.size();
      r->request.prompt_token_ids = std::move(tokens);
      r->request.params = params;
      r->max_tokens = max_tokens;
      r->admit_with_previous = !prefill && !requests.empty();
      r->progress = call->progress;
      r->index = requests.size();
      call->children.push_back(id);
      call->prompt_tokens.push_back(r->request.num_prompt_tokens);
      call->results.push_back(r->done.get_future().share());
      requests.push_back(r);
      incoming.push_back(std::move(r));
      ++stats.requests;
    }
  }
  cv.notify_all();
  // A client that closes its connection gives its request up (as vLLM aborts it): the core
  // frees what it holds instead of waiting out the request's deadlines.
  call->give_up = [this, requests] {
    for (auto& r : requests) r->cancelled.store(true);
    {
      std::lock_guard lock(mu);
      cancels_pending = true;
    }
    cv.notify_all();
  };
  call->client_went_away = [give_up = call->give_up] {
    if (!metaserver::client_gone()) return false;
    give_up();
    return true;
  };
  if (!field("stream", false).get<bool>()) {
    auto outcome = call->wait();
    if (auto* failed = std::get_if<std::pair<int, std::string>>(&outcome)) {
      return fail(failed->first, failed->second);
    }
    return res.set_content(call->whole(std::get<std::vector<Result>>(outcome)).dump(),
                           "application/json");
  }
  // The answer's status leaves with its first event: it waits for the first token (or the
  // end of every prompt), so a request that fails before it gets an HTTP error.
  {
    auto& p = *call->progress;
    std::unique_lock lock(p.mu);
    auto started = [&] {
      return std::any_of(p.tokens.begin(), p.tokens.end(), [](uint64_t t) { return t > 0; }) ||
             std::all_of(p.ended.begin(), p.ended.end(), [](bool e) { return e; });
    };
    while (!p.cv.wait_for(lock, kLook, started) &&
           std::chrono::steady_clock::now() < call->deadline) {
      lock.unlock();
      const bool gone = call->client_went_away();
      lock.lock();
      if (gone) return fail(499, "the client went away");
    }
    const bool any_token =
        std::any_of(p.tokens.begin(), p.tokens.end(), [](uint64_t t) { return t > 0; });
    lock.unlock();
    if (!any_token) {
      auto outcome = call->wait();  // ended: an error, or Prefill's one token
      if (auto* failed = std::get_if<std::pair<int, std::string>>(&outcome)) {
        return fail(failed->first, failed->second);
      }
    }
  }
  const json options = field("stream_options", json::object());
  const bool include_usage = options.value("include_usage", json(false)).is_boolean() &&
                             options.value("include_usage", false);
  res.set_chunked_content_provider("text/event-stream",
                                   [call, include_usage](size_t, httplib::DataSink& sink) {
                                     return call->stream(sink, include_usage);
                                   });
}

void Engine::Impl::report(httplib::Response& res) {
  if (trace::enabled()) {
    std::future<void> drained;
    {
      std::lock_guard lock(mu);
      if (!stopping) {
        event_drains.emplace_back();
        drained = event_drains.back().get_future();
      }
    }
    cv.notify_all();
    if (drained.valid() &&
        drained.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
      res.status = 503;
      return res.set_content(R"({"error": {"message": "the engine core is busy", "code": 503}})",
                             "application/json");
    }
  }
  json out;
  {
    std::lock_guard lock(mu);
    out["stats"] = {{"requests", stats.requests},
                    {"steps", stats.steps},
                    {"prefill_chunks", stats.prefill_chunks},
                    {"verified_blocks", stats.verified_blocks},
                    {"failed_requests", stats.failed_requests},
                    {"main_pool_locked", stats.main_pool_locked}};
  }
  out["role"] = prefill ? "prefill" : "decode";
  out["tp"] = config.tp_size;
  out["events"] = to_json(trace::drain());
  out["events_dropped"] = trace::dropped();
  res.set_content(out.dump(), "application/json");
}

Expected<Report> parse_report(std::string_view body) {
  const json j = json::parse(body, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("stats")) {
    return invalid_argument("an engine report must be a JSON object with stats and events");
  }
  Report r;
  try {
    r.role = j.at("role").get<std::string>();
    r.tp_size = j.at("tp").get<int>();
    const json& s = j.at("stats");
    r.stats.requests = s.at("requests").get<uint64_t>();
    r.stats.steps = s.at("steps").get<uint64_t>();
    r.stats.prefill_chunks = s.at("prefill_chunks").get<uint64_t>();
    r.stats.verified_blocks = s.at("verified_blocks").get<uint64_t>();
    r.stats.failed_requests = s.at("failed_requests").get<uint64_t>();
    r.stats.main_pool_locked = s.at("main_pool_locked").get<bool>();
    r.events_dropped = j.value("events_dropped", uint64_t{0});
  } catch (const json::exception& e) {
    return invalid_argument(std::string("engine report: ") + e.what());
  }
  r.events = events_from_json(j.value("events", json::array()));
  return r;
}

Expected<std::unique_ptr<Engine>> Engine::start(EngineConfig config) {
  auto impl = std::make_unique<Impl>();
  impl->config = std::move(config);
  RD2H_RETURN_IF_ERROR(impl->init());
  Impl* p = impl.get();
  metaserver::HttpServerConfig http;
  http.host = p->config.host;
  http.port = p->config.port;
  http.name = "engine's HTTP API";
  http.max_body_bytes = p->config.max_body_bytes;
  http.token = p->config.token;
  http.metrics = &p->http_metrics;
  p->http = std::make_unique<metaserver::HttpServer>(http);
  using Auth = metaserver::HttpServer::Auth;
  p->http->post("/v1/completions", Auth::kToken,
                [p](const httplib::Request& q, httplib::Response& s) { p->serve(q, s, false); });
  p->http->post("/v1/chat/completions", Auth::kToken,
                [p](const httplib::Request& q, httplib::Response& s) { p->serve(q, s, true); });
  p->http->get("/v1/models", Auth::kToken, [p](const httplib::Request&, httplib::Response& s) {
    const json model = {{"id", p->config.served_model_name},
                        {"object", "model"},
                        {"created", p->started_at},
                        {"owned_by", "rd2h"},
                        {"max_model_len", p->config.model.num_blocks * p->config.model.block_size}};
    s.set_content(json{{"object", "list"}, {"data", {model}}}.dump(), "application/json");
  });
  // Nothing to drop: the pretend local prefix cache is a setting, not a cache.
  p->http->post("/reset_prefix_cache", Auth::kToken,
                [](const httplib::Request&, httplib::Response& s) {
                  s.set_content(R"({"status":"ok"})", "application/json");
                });
  // Probes take no token, as load balancers and orchestrators send none.
  p->http->get("/health", Auth::kNone, [p](const httplib::Request&, httplib::Response& s) {
    std::lock_guard lock(p->mu);
    if (p->stopping) return metaserver::set_api_error(s, 503, "the engine is stopping");
    s.set_content(json{{"status", "ok"}, {"role", p->prefill ? "prefill" : "decode"}}.dump(),
                  "application/json");
  });
  p->registry.gauge_callback("rd2h_engine_free_blocks", "KV blocks free after the last step",
                             [p] {
                               std::lock_guard lock(p->mu);
                               return static_cast<double>(p->stats.free_blocks);
                             });
  p->registry.gauge_callback("rd2h_engine_waiting_for_blocks",
                             "Prompts queued until their blocks are free", [p] {
                               std::lock_guard lock(p->mu);
                               return static_cast<double>(p->stats.waiting_for_blocks);
                             });
  if (!p->prefill) {
    connector::Scheduler* s = p->scheduler.get();
    p->registry.counter_callback("rd2h_metaserver_posts_delivered_total",
                                 "Rendezvous posts the metaserver answered 2xx",
                                 [s] { return static_cast<double>(s->metaserver_stats().delivered); });
    p->registry.counter_callback("rd2h_metaserver_posts_refused_total",
                                 "Rendezvous posts the metaserver answered otherwise",
                                 [s] { return static_cast<double>(s->metaserver_stats().refused); });
    p->registry.counter_callback(
        "rd2h_metaserver_post_retries_total",
        "Rendezvous post attempts that got no answer (each is tried again)",
        [s] { return static_cast<double>(s->metaserver_stats().failed_attempts); });
  }
  p->http->get("/metrics", Auth::kNone, [p](const httplib::Request&, httplib::Response& s) {
    s.set_content(p->registry.render(), metrics::kContentType);
  });
  p->http->get("/version", Auth::kNone, [](const httplib::Request&, httplib::Response& s) {
    s.set_content(json{{"version", rd2h::version()}}.dump(), "application/json");
  });
  p->http->get("/rd2h/report", Auth::kToken,
               [p](const httplib::Request&, httplib::Response& s) { p->report(s); });
  // The core first: the destructor joins it before it stops HTTP.
  p->core = std::thread([p] { p->run_core(); });
  if (Status st = p->http->start(); !st) {
    {
      std::lock_guard lock(p->mu);
      p->stopping = true;
    }
    p->cv.notify_all();
    p->core.join();
    p->ranks->stop(std::chrono::seconds(10));
    return st;
  }
  p->http_port = p->http->port();
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Engine::~Engine() {
  Impl& p = *impl_;
  {
    std::lock_guard lock(p.mu);
    p.stopping = true;
  }
  p.cv.notify_all();
  p.core.join();  // answers what is pending, so the HTTP handlers return
  p.http->stop();
  p.ranks->stop(std::chrono::seconds(10));
}

std::string Engine::origin() const {
  return "http://" + impl_->config.host + ":" + std::to_string(impl_->http_port);
}
int Engine::kv_base_port() const {
  return impl_->scheduler->base_port();
}
EngineStats Engine::stats() const {
  std::lock_guard lock(impl_->mu);
  return impl_->stats;
}

}  // namespace rd2h::sim
