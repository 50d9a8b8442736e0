#include "rd2h/sim/engine.h"

#include <httplib.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <thread>

#include "rd2h/common/pattern.h"
#include "rd2h/connector/scheduler.h"
#include "rd2h/connector/worker.h"
#include "rd2h/decode/local_all_gather.h"

namespace rd2h::sim {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

std::string layer_name(int l) {
  return "model.layers." + std::to_string(l) + ".self_attn";
}

std::string random_hex(size_t n) {
  thread_local std::mt19937_64 rng(std::random_device{}());
  static const char* digits = "0123456789abcdef";
  std::string s(n, '0');
  for (auto& c : s) c = digits[rng() & 15];
  return s;
}

// What block `index` of a prompt holds in `layer`, tensor `t`: a function of its tokens.
uint64_t kv_key(const std::vector<int64_t>& tokens, uint64_t block_size, size_t index, int layer,
                size_t t) {
  uint64_t h = 0xcbf29ce484222325ULL;
  const size_t end = std::min(tokens.size(), (index + 1) * block_size);
  for (size_t k = index * block_size; k < end; ++k) {
    h ^= static_cast<uint64_t>(tokens[k]);
    h *= 0x100000001b3ULL;
  }
  return splitmix64(h ^ (static_cast<uint64_t>(layer) << 40) ^ (static_cast<uint64_t>(t) << 32) ^
                    index);
}

// A thread that runs one job at a time for the core.
class RankThread {
 public:
  RankThread() : thread_([this] { run(); }) {}
  ~RankThread() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  std::future<Status> post(std::function<Status()> job) {
    std::packaged_task<Status()> task(std::move(job));
    auto f = task.get_future();
    {
      std::lock_guard lock(mu_);
      jobs_.push_back(std::move(task));
    }
    cv_.notify_all();
    return f;
  }

 private:
  void run() {
    std::unique_lock lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      auto job = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      job();
      lock.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<Status()>> jobs_;
  bool stopping_ = false;
  std::thread thread_;
};

struct Aligned {
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte, Free> data;
  size_t size = 0;
  explicit Aligned(size_t n = 0) : size(n) {
    if (n == 0) return;
    const size_t rounded = (n + 4095) / 4096 * 4096;
    data.reset(static_cast<std::byte*>(std::aligned_alloc(4096, rounded)));
    std::memset(data.get(), 0, rounded);
  }
  uint64_t addr() const { return reinterpret_cast<uint64_t>(data.get()); }
};

}  // namespace

struct Result {
  bool ok = false;
  std::string text;
  std::string error;
  uint64_t verified_blocks = 0;
};

struct EngineRequest {
  connector::Request request;  // id, prompt length, params, tokens
  uint64_t max_tokens = 16;
  std::vector<int64_t> blocks;
  uint64_t computed = 0;   // prompt tokens with KV
  uint64_t generated = 0;  // Decode
  enum class State { kWaitingRemote, kRunning } state = State::kRunning;
  uint64_t verified_blocks = 0;
  std::promise<Result> done;
};

struct Engine::Impl {
  EngineConfig config;
  bool prefill = false;
  std::vector<uint64_t> block_bytes;  // per tensor
  std::unique_ptr<connector::Scheduler> scheduler;
  struct Rank {
    std::unique_ptr<connector::ConnectorWorker> worker;
    uint64_t kv = 0;  // Prefill: engine-allocated slots
    Aligned indexer;  // Decode: indexer (and scale) of every layer
    std::unique_ptr<RankThread> thread;
  };
  std::vector<Rank> ranks;
  Aligned main_pool;  // Decode: K and V of every layer, shared by the ranks
  std::unique_ptr<decode::LocalAllGather> gather;

  httplib::Server http;
  std::thread http_thread;
  int http_port = 0;

  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<EngineRequest>> incoming;
  bool stopping = false;
  EngineStats stats;
  std::thread core;

  std::vector<int64_t> free_blocks;
  std::vector<std::shared_ptr<EngineRequest>> active;

  int slots() const {
    return config.model.prefill_slots > 0 ? config.model.prefill_slots : config.model.layers;
  }
  uint64_t prefill_addr(const Rank& r, int layer, size_t t, int64_t block) const {
    const uint64_t n = config.model.num_blocks;
    uint64_t per_slot = 0;
    for (auto b : block_bytes) per_slot += b * n;
    uint64_t off = static_cast<uint64_t>(layer % slots()) * per_slot;
    for (size_t k = 0; k < t; ++k) off += block_bytes[k] * n;
    return r.kv + off + static_cast<uint64_t>(block) * block_bytes[t];
  }
  uint64_t decode_addr(const Rank& r, int layer, size_t t, int64_t block) const {
    const uint64_t n = config.model.num_blocks;
    if (t < 2) {
      const uint64_t per_layer = (block_bytes[0] + block_bytes[1]) * n;
      return main_pool.addr() + static_cast<uint64_t>(layer) * per_layer +
             (t == 0 ? 0 : block_bytes[0] * n) + static_cast<uint64_t>(block) * block_bytes[t];
    }
    uint64_t per_layer = 0;
    for (size_t k = 2; k < block_bytes.size(); ++k) per_layer += block_bytes[k] * n;
    uint64_t off = static_cast<uint64_t>(layer) * per_layer;
    for (size_t k = 2; k < t; ++k) off += block_bytes[k] * n;
    return r.indexer.addr() + off + static_cast<uint64_t>(block) * block_bytes[t];
  }
  std::vector<layout::CacheLayer> cache_layers(const Rank& r) const {
    std::vector<layout::CacheLayer> out;
    for (int l = 0; l < config.model.layers; ++l) {
      layout::CacheLayer layer{layer_name(l), {}, 2, block_bytes.size() > 2};
      for (size_t t = 0; t < block_bytes.size(); ++t) {
        const uint64_t addr = prefill ? prefill_addr(r, l, t, 0) : decode_addr(r, l, t, 0);
        layer.tensors.push_back(
            {addr, block_bytes[t] * config.model.num_blocks, block_bytes[t], 1, t < 2 ? 0u : 1u});
      }
      out.push_back(std::move(layer));
    }
    return out;
  }

  Status init();
  void serve(const httplib::Request& req, httplib::Response& res, bool chat);
  void run_core();
  void admit(const std::shared_ptr<EngineRequest>& r);
  Status step();
  void complete(const std::shared_ptr<EngineRequest>& r, Result result);
  // Writes (Prefill compute, or Decode's own cached prefix) blocks [first, last) of `r`.
  // On Decode the main tensors live in the pool the ranks share: only rank 0 writes them.
  void write_blocks(Rank& rank, int layer, const EngineRequest& r, size_t first, size_t last,
                    bool decode_side, bool main_tensors = true);
  uint64_t verify(const EngineRequest& r, size_t first, size_t last, std::string* why);
  std::vector<Status> on_ranks(const std::function<Status(size_t)>& job);
};

std::vector<Status> Engine::Impl::on_ranks(const std::function<Status(size_t)>& job) {
  std::vector<std::future<Status>> futures;
  for (size_t r = 0; r < ranks.size(); ++r) {
    futures.push_back(ranks[r].thread->post([&job, r] { return job(r); }));
  }
  std::vector<Status> out;
  for (auto& f : futures) out.push_back(f.get());
  return out;
}

Status Engine::Impl::init() {
  const auto& m = config.model;
  for (auto b : m.bytes_per_token) block_bytes.push_back(b * m.block_size);
  if (m.layers < 1 || m.block_size == 0 || m.num_blocks == 0 || block_bytes.size() < 2 ||
      std::find(block_bytes.begin(), block_bytes.end(), 0u) != block_bytes.end()) {
    return invalid_argument(
        "model layout: layers, block size, blocks and tensor sizes must be set");
  }
  prefill = config.connector.role == connector::KvRole::kProducer;
  connector::Parallel parallel{config.tp_size, 1, 1, 0};
  connector::KvCacheGroup group{{}, m.block_size};
  for (int l = 0; l < m.layers; ++l) group.layer_names.push_back(layer_name(l));
  auto s = connector::Scheduler::create(config.connector, parallel, {group});
  if (!s) return s.status();
  scheduler = std::move(*s);
  if (!prefill) {
    main_pool =
        Aligned((block_bytes[0] + block_bytes[1]) * m.num_blocks * static_cast<uint64_t>(m.layers));
  }
  gather = std::make_unique<decode::LocalAllGather>(config.tp_size);
  for (int r = 0; r < config.tp_size; ++r) {
    transfer::EngineConfig ec;
    ec.role = prefill ? transfer::Role::kPrefill : transfer::Role::kDecode;
    ec.device_id = r;
    ec.transport = config.connector.transport;
    ec.read_timeout = config.connector.read_timeout;
    auto engine = transfer::create_ucx_engine(ec);
    if (!engine) return engine.status();
    std::shared_ptr<transfer::TransferEngine> shared(std::move(*engine));
    Rank rank;
    if (prefill) {
      uint64_t per_slot = 0;
      for (auto b : block_bytes) per_slot += b * m.num_blocks;
      auto region = shared->allocate_memory(per_slot * static_cast<uint64_t>(slots()));
      if (!region) return region.status();
      rank.kv = reinterpret_cast<uint64_t>(region->addr);
    } else {
      uint64_t per_layer = 0;
      for (size_t k = 2; k < block_bytes.size(); ++k) per_layer += block_bytes[k] * m.num_blocks;
      rank.indexer = Aligned(per_layer * static_cast<uint64_t>(m.layers));
    }
    auto w = connector::ConnectorWorker::create(config.connector, parallel, r, shared);
    if (!w) return w.status();
    rank.worker = std::move(*w);
    RD2H_RETURN_IF_ERROR(rank.worker->register_kv_caches(cache_layers(rank), prefill));
    rank.thread = std::make_unique<RankThread>();
    ranks.push_back(std::move(rank));
  }
  for (int64_t b = static_cast<int64_t>(m.num_blocks) - 1; b >= 0; --b) free_blocks.push_back(b);
  return Status::ok();
}

void Engine::Impl::write_blocks(Rank& rank, int layer, const EngineRequest& r, size_t first,
                                size_t last, bool decode_side, bool main_tensors) {
  const auto& tokens = r.request.prompt_token_ids;
  for (size_t i = first; i < last && i < r.blocks.size(); ++i) {
    for (size_t t = main_tensors ? 0 : 2; t < block_bytes.size(); ++t) {
      const uint64_t addr = decode_side ? decode_addr(rank, layer, t, r.blocks[i])
                                        : prefill_addr(rank, layer, t, r.blocks[i]);
      fill_pattern(reinterpret_cast<void*>(addr), block_bytes[t],
                   kv_key(tokens, config.model.block_size, i, layer, t));
    }
  }
}

uint64_t Engine::Impl::verify(const EngineRequest& r, size_t first, size_t last, std::string* why) {
  const auto& tokens = r.request.prompt_token_ids;
  uint64_t ok = 0;
  for (size_t i = first; i < last && i < r.blocks.size(); ++i) {
    for (int l = 0; l < config.model.layers; ++l) {
      for (size_t k = 0; k < ranks.size(); ++k) {
        for (size_t t = 0; t < block_bytes.size(); ++t) {
          if (t < 2 && k > 0) continue;  // main KV: one shared pool
          const uint64_t addr = decode_addr(ranks[k], l, t, r.blocks[i]);
          if (find_pattern_mismatch(reinterpret_cast<const void*>(addr), block_bytes[t],
                                    kv_key(tokens, config.model.block_size, i, l, t))) {
            *why = "block " + std::to_string(i) + " of layer " + std::to_string(l) + ", tensor " +
                   std::to_string(t) + ", rank " + std::to_string(k) + " does not hold its KV";
            return ok;
          }
        }
      }
      ++ok;
    }
  }
  return ok;
}

void Engine::Impl::complete(const std::shared_ptr<EngineRequest>& r, Result result) {
  (void)scheduler->request_finished(r->request);
  free_blocks.insert(free_blocks.end(), r->blocks.begin(), r->blocks.end());
  r->blocks.clear();
  {
    std::lock_guard lock(mu);
    if (!result.ok) ++stats.failed_requests;
    stats.verified_blocks += result.verified_blocks;
  }
  r->done.set_value(std::move(result));
  active.erase(std::remove(active.begin(), active.end(), r), active.end());
}

void Engine::Impl::admit(const std::shared_ptr<EngineRequest>& r) {
  const uint64_t bs = config.model.block_size;
  const uint64_t prompt = r->request.num_prompt_tokens;
  const uint64_t need = (prompt + (prefill ? 0 : r->max_tokens) + bs - 1) / bs;
  if (need > free_blocks.size()) {
    return complete(r, {false, "",
                        "the engine has " + std::to_string(free_blocks.size()) +
                            " free blocks, the request needs " + std::to_string(need)});
  }
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
    on_ranks([&](size_t k) {
      for (int l = 0; l < config.model.layers; ++l) {
        write_blocks(ranks[k], l, *r, 0, cached / bs, true, /*main_tensors=*/k == 0);
      }
      return Status::ok();
    });
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

Status Engine::Impl::step() {
  std::vector<connector::ScheduledRequest> scheduled;
  struct Write {
    std::shared_ptr<EngineRequest> r;
    size_t first, last;
  };
  std::vector<Write> writes;
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
      scheduled.push_back({r->request.request_id, {}, r->computed});
      writes.push_back({r, before / bs, (r->computed + bs - 1) / bs});
      if (budget == 0) break;
    }
  }
  auto handed = scheduler->build_connector_meta(scheduled);
  if (!handed) return handed.status();
  const std::vector<std::byte> meta = connector::encode(*handed);  // as a host ships it
  bool waiting = false;
  for (auto& r : active) waiting = waiting || r->state == EngineRequest::State::kWaitingRemote;
  const bool run_workers = !scheduled.empty() || waiting || !handed->empty();
  if (run_workers) {
    std::lock_guard lock(mu);
    ++stats.steps;
    stats.prefill_chunks += scheduled.size();
  }
  std::vector<connector::FinishedTransfers> finished(ranks.size());
  std::vector<std::vector<int64_t>> errors(ranks.size());
  std::vector<Status> results;
  if (run_workers)
    results = on_ranks([&](size_t k) -> Status {
      auto& w = *ranks[k].worker;
      RD2H_RETURN_IF_ERROR(w.bind_connector_metadata(std::span<const std::byte>(meta)));
      RD2H_RETURN_IF_ERROR(w.start_load_kv());
      Status first;
      for (int l = 0; l < config.model.layers && prefill && !writes.empty(); ++l) {
        RD2H_RETURN_IF_ERROR(w.wait_for_layer_load(layer_name(l)));
        RD2H_RETURN_IF_ERROR(w.wait_for_layer_send(layer_name(l)));
        for (const auto& wr : writes) write_blocks(ranks[k], l, *wr.r, wr.first, wr.last, false);
        RD2H_RETURN_IF_ERROR(w.save_kv_layer(layer_name(l)));
      }
      Status saved = w.wait_for_save();
      w.clear_connector_metadata();
      if (!prefill) {
        auto f = w.get_finished(gather->for_rank(static_cast<int>(k)));
        if (!f) return f.status();
        finished[k] = std::move(*f);
        errors[k] = w.get_block_ids_with_load_errors();
      }
      return saved;
    });
  Status failure;
  for (const auto& st : results) {
    if (!st && failure.is_ok()) failure = st;
  }
  if (prefill) {
    for (const auto& wr : writes) {
      if (!failure.is_ok()) {
        complete(wr.r, {false, "", failure.message()});
      } else if (wr.r->computed == wr.r->request.num_prompt_tokens) {
        complete(wr.r, {true, "x", "", 0});  // the one token Prefill is asked for
      }
    }
    return Status::ok();
  }
  if (!failure.is_ok()) return failure;
  std::set<int64_t> bad;
  for (const auto& e : errors) bad.insert(e.begin(), e.end());
  const std::set<std::string> ready(
      finished.empty()
          ? std::set<std::string>{}
          : std::set<std::string>(finished[0].recving.begin(), finished[0].recving.end()));
  for (auto r : std::vector<std::shared_ptr<EngineRequest>>(active)) {
    if (r->state == EngineRequest::State::kWaitingRemote) {
      if (ready.count(r->request.request_id) == 0) continue;
      const size_t blocks = (r->request.num_prompt_tokens + bs - 1) / bs;
      bool failed_load = false;
      for (size_t i = 0; i < blocks; ++i) failed_load = failed_load || bad.count(r->blocks[i]);
      if (failed_load) {
        complete(r, {false, "", "the KV of the request failed to load"});
        continue;
      }
      std::string why;
      r->verified_blocks = verify(*r, 0, blocks, &why);
      if (!why.empty()) {
        complete(r, {false, "", "KV check failed: " + why});
        continue;
      }
      r->computed = r->request.num_prompt_tokens;
      r->state = EngineRequest::State::kRunning;
      continue;
    }
    if (++r->generated >= r->max_tokens) {
      complete(r, {true, std::string(r->max_tokens, 'y'), "", r->verified_blocks});
    }
  }
  return Status::ok();
}

void Engine::Impl::run_core() {
  while (true) {
    std::deque<std::shared_ptr<EngineRequest>> fresh;
    {
      std::unique_lock lock(mu);
      const bool busy = !active.empty();
      cv.wait_for(lock, busy ? std::chrono::milliseconds(1) : std::chrono::milliseconds(50),
                  [&] { return stopping || !incoming.empty(); });
      if (stopping) break;
      fresh.swap(incoming);
    }
    for (auto& r : fresh) admit(r);
    if (Status st = step(); !st) {
      for (auto r : std::vector<std::shared_ptr<EngineRequest>>(active)) {
        complete(r, {false, "", st.message()});
      }
    }
  }
  for (auto r : std::vector<std::shared_ptr<EngineRequest>>(active)) {
    complete(r, {false, "", "the engine is stopping"});
  }
  std::lock_guard lock(mu);
  for (auto& r : incoming) r->done.set_value({false, "", "the engine is stopping"});
  incoming.clear();
}

void Engine::Impl::serve(const httplib::Request& req, httplib::Response& res, bool chat) {
  auto fail = [&](int status, const std::string& why) {
    res.status = status;
    res.set_content(json{{"error", {{"message", why}, {"code", status}}}}.dump(),
                    "application/json");
  };
  auto body = json::parse(req.body, nullptr, false);
  if (body.is_discarded() || !body.is_object()) return fail(400, "the body is not a JSON object");
  std::optional<connector::KvTransferParams> params;
  if (body.contains("kv_transfer_params") && !body["kv_transfer_params"].is_null()) {
    auto p = connector::KvTransferParams::from_json(body["kv_transfer_params"].dump());
    if (!p) return fail(400, p.status().message());
    params = std::move(*p);
  }
  std::string parent = req.get_header_value("X-Request-Id");
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
  std::vector<std::pair<std::string, std::vector<int64_t>>> children;
  if (chat) {
    std::string text;
    for (const auto& m : body.value("messages", json::array())) text += m.value("content", "");
    children.push_back({"chatcmpl-" + parent, tokens_of(json(text))});
  } else {
    const json prompt = body.value("prompt", json(""));
    if (prompt.is_array() && !prompt.empty() && !prompt[0].is_number()) {
      for (size_t i = 0; i < prompt.size(); ++i) {
        children.push_back({"cmpl-" + parent + "-" + std::to_string(i), tokens_of(prompt[i])});
      }
    } else {
      children.push_back({"cmpl-" + parent + "-0", tokens_of(prompt)});
    }
  }
  const uint64_t max_tokens = std::max<int64_t>(1, body.value("max_tokens", 16));
  std::vector<std::future<Result>> results;
  {
    std::lock_guard lock(mu);
    if (stopping) return fail(503, "the engine is stopping");
    for (auto& [id, tokens] : children) {
      if (tokens.empty()) return fail(400, "request " + id + " has an empty prompt");
      auto r = std::make_shared<EngineRequest>();
      r->request.request_id = id + "-" + random_hex(8);
      r->request.num_prompt_tokens = tokens.size();
      r->request.prompt_token_ids = std::move(tokens);
      r->request.params = params;
      r->max_tokens = max_tokens;
      results.push_back(r->done.get_future());
      incoming.push_back(std::move(r));
      ++stats.requests;
    }
  }
  cv.notify_all();
  json choices = json::array();
  uint64_t verified = 0;
  for (size_t i = 0; i < results.size(); ++i) {
    if (results[i].wait_for(config.request_timeout) != std::future_status::ready) {
      return fail(504, "request " + children[i].first + " did not finish in time");
    }
    Result r = results[i].get();
    if (!r.ok) return fail(500, "request " + children[i].first + ": " + r.error);
    verified += r.verified_blocks;
    choices.push_back({{"index", i}, {"text", r.text}, {"finish_reason", "length"}});
  }
  json out = {{"id", chat ? "chatcmpl-" + parent : "cmpl-" + parent},
              {"object", chat ? "chat.completion" : "text_completion"},
              {"choices", choices},
              {"rd2h", {{"verified_blocks", verified}}}};
  if (body.value("stream", false)) {
    res.set_content("data: " + out.dump() + "\n\ndata: [DONE]\n\n", "text/event-stream");
  } else {
    res.set_content(out.dump(), "application/json");
  }
}

Expected<std::unique_ptr<Engine>> Engine::start(EngineConfig config) {
  auto impl = std::make_unique<Impl>();
  impl->config = std::move(config);
  RD2H_RETURN_IF_ERROR(impl->init());
  Impl* p = impl.get();
  p->http.new_task_queue = [] { return new httplib::ThreadPool(64); };
  p->http.Post("/v1/completions",
               [p](const httplib::Request& q, httplib::Response& s) { p->serve(q, s, false); });
  p->http.Post("/v1/chat/completions",
               [p](const httplib::Request& q, httplib::Response& s) { p->serve(q, s, true); });
  p->http_port = p->config.port == 0
                     ? p->http.bind_to_any_port(p->config.host)
                     : (p->http.bind_to_port(p->config.host, p->config.port) ? p->config.port : -1);
  if (p->http_port <= 0) {
    return unreachable("cannot listen on " + p->config.host + ":" + std::to_string(p->config.port));
  }
  p->core = std::thread([p] { p->run_core(); });
  p->http_thread = std::thread([p] { p->http.listen_after_bind(); });
  for (int i = 0; i < 5000 && !p->http.is_running(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
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
  p.http.stop();
  p.http_thread.join();
  for (auto& r : p.ranks) r.thread.reset();
  for (auto& r : p.ranks) r.worker->shutdown();
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
