// The simulated engine's insides, shared by its parts: the state of one request, and
// Engine::Impl, the engine core (engine_core.cc: scheduler loop, block allocator, rank
// jobs) with its HTTP front (engine_http.cc) and its start-up (engine.cc).
#pragma once

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

#include "rd2h/common/trace.h"
#include "rd2h/connector/metadata.h"
#include "rd2h/connector/scheduler.h"
#include "rd2h/version.h"
#include "sim/engine.h"
#include "sim/kv_model.h"
#include "sim/rank_set.h"
#include "sim/shared_pool.h"
#include "sim/sim_message.h"
#include "util/http_server.h"
#include "util/metrics.h"
#include "util/openai_body.h"

namespace rd2h::sim {

using nlohmann::json;

// How long the TP rank processes may take to start and load their connectors.
inline constexpr std::chrono::seconds kRankStartTimeout{60};
// How often a request's handler looks whether its client is still there.
inline constexpr std::chrono::milliseconds kLook{100};

// Why a client request gets an HTTP error instead of an answer.
struct HttpFault {
  int status = 400;
  std::string message;
  std::string param;
  std::string code;
};

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
  int verify_pending = 0;              // ranks still checking the request's KV
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

struct Engine::Impl {
  EngineConfig config;
  // GET /metrics.
  metrics::Registry registry;
  http::HttpMetrics http_metrics{registry};
  metrics::Family<metrics::Histogram>& ttft = registry.histogram(
      "rd2h_engine_time_to_first_token_seconds",
      "From a prompt's arrival to its first token (Prefill: to the end of its prefill)", {},
      metrics::latency_buckets());
  metrics::Family<metrics::Histogram>& e2e = registry.histogram(
      "rd2h_engine_request_seconds", "From a prompt's arrival to its end, by outcome", {"outcome"},
      metrics::latency_buckets());
  metrics::Family<metrics::Counter>& prompts_done =
      registry.counter("rd2h_engine_prompts_total", "Prompts ended, by outcome", {"outcome"});
  // Tokens of the prompts that ended well: taken in (Prefill and Decode alike), and made
  // (Decode; Prefill's one token is not an answer's).
  metrics::Family<metrics::Counter>& prompt_tokens = registry.counter(
      "rd2h_engine_prompt_tokens_total", "Prompt tokens of the prompts that ended well");
  metrics::Family<metrics::Counter>& generation_tokens = registry.counter(
      "rd2h_engine_generation_tokens_total", "Tokens generated for the prompts that ended well");
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
      metrics::transfer_buckets());
  // Every outcome's series present at 0 from the start.
  const bool outcomes_shown = [this] {
    for (const char* o : {"ok", "failed", "cancelled"}) {
      e2e.with({o});
      prompts_done.with({o});
    }
    for (const char* o : {"done", "failed"}) kv_layers.with({o});
    return true;
  }();
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

  std::unique_ptr<http::HttpServer> server;
  int http_port = 0;

  std::mutex mu;
  std::condition_variable cv;
  // Bounded by the HTTP server's threads: each request waits in its handler until served.
  std::deque<std::shared_ptr<EngineRequest>> incoming;
  std::set<std::string> in_flight;  // ext ids of requests not answered yet
  // Reports waiting for the ranks' timeline events (the core thread alone talks to them).
  std::vector<std::promise<void>> event_drains;
  bool stopping = false;
  bool draining = false;  // new requests are refused (503) while those in flight finish
  // Why the engine cannot serve (a TP rank process died), once it knows: new requests are
  // refused with it and /health answers 503 naming the rank.
  std::string broken;
  std::condition_variable idle_cv;  // a request ended (drain waits on it)
  bool cancels_pending = false;  // a client went away: the core looks for what it gave up
  EngineStats stats;
  std::thread core;

  std::vector<int64_t> free_blocks;
  // Admitted once blocks free up, first come first served. On Decode a prompt list is one
  // entry: it gets blocks for all its prompts at once or none, since Prefill starts only once
  // every prompt has its blocks, and a list holding some while waiting for the rest could
  // wait on blocks that only requests behind it would free.
  // Bounded as `incoming` is.
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

  // The model and scheduler checked and set up, the rank processes started and initialised.
  Status init();
  Status check_config() const;
  // Each rank told its part (rank 0 first: Decode's all-gather binds there).
  Status init_ranks();
  // The HTTP API (on `http`) and the engine's own metrics.
  void add_routes();
  void add_metrics();
  struct Call;
  struct Asked;
  void serve(const httplib::Request& req, httplib::Response& res, bool chat);
  // The prompts, budget and transfer parameters of a client's body, or why it is refused.
  std::variant<Asked, HttpFault> read_request(const json& body, bool chat,
                                              const std::string& parent);
  // Hands the call's prompts to the core, unless the engine stops or one is in flight.
  std::optional<HttpFault> enqueue(Call& call, Asked& asked);
  std::optional<HttpFault> await_first_token(Call& call);
  void report(httplib::Response& res);
  void run_core();
  // Whether a TP rank process has died; if so the engine is broken from now on and what it
  // holds fails, naming the rank (core thread).
  bool rank_died();
  std::chrono::steady_clock::time_point last_rank_look;
  // Why the engine refuses new requests now (stopping, draining, a rank dead), if it does.
  // Caller holds mu.
  std::optional<std::string> refusal() const;
  // Admits the requests waiting for blocks, in order, while their blocks are free (core).
  void admit_waiting();
  // The engine stops: every request it holds, queued or running, fails (core).
  void end_everything();
  void admit(const std::shared_ptr<EngineRequest>& r);
  Status step();
  // A request's blocks [first, last) a Prefill step writes.
  struct Write {
    std::shared_ptr<EngineRequest> r;
    size_t first, last;
  };
  void schedule_chunks(std::vector<connector::ScheduledRequest>& scheduled,
                       std::vector<Write>& writes, uint64_t& step_tokens);
  void generate_token(const std::shared_ptr<EngineRequest>& r);
  void arrive(const std::shared_ptr<EngineRequest>& r, const std::set<int64_t>& bad);
  void end_prefill_step(const std::vector<Write>& writes, const Status& failure,
                        int64_t compute_end_us);
  void end_decode_step(const std::vector<json>& replies);
  void complete(const std::shared_ptr<EngineRequest>& r, Result result);
  // Blocks [first, last) of `r` as a rank job names them.
  json blocks_json(const EngineRequest& r, size_t first, size_t last) const;
  Status verify(const std::shared_ptr<EngineRequest>& r);
  void decode_token(EngineRequest& r);
};

}  // namespace rd2h::sim
