// One TP rank of a simulated engine, in its own process: it owns the rank's transfer
// engine, connector worker and KV memory, and runs the jobs its engine core sends (init,
// step, local writes, verification, stop), one at a time, answering each.
#include <sys/prctl.h>
#include <unistd.h>

#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <limits>
#include <mutex>
#include <optional>
#include <thread>

#include "rd2h/connector/worker.h"
#include "sim/kv_model.h"
#include "sim/rank_gather.h"
#include "sim/shared_pool.h"
#include "sim/sim_message.h"

namespace rd2h::sim {
namespace {

using nlohmann::json;

struct Aligned {
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte, Free> data;
  explicit Aligned(size_t n = 0) {
    if (n == 0) return;
    const size_t rounded = (n + 4095) / 4096 * 4096;
    data.reset(static_cast<std::byte*>(std::aligned_alloc(4096, rounded)));
    std::memset(data.get(), 0, rounded);
  }
};

// A write or check of blocks [first, first + blocks) of one request.
struct Blocks {
  std::string request;
  size_t first = 0;
  std::vector<int64_t> blocks;
  std::vector<int64_t> tokens;  // from token first * block_size on

  static Blocks from(const json& j) {
    return {j.at("req").get<std::string>(), j.at("first").get<size_t>(),
            j.at("blocks").get<std::vector<int64_t>>(), j.at("tokens").get<std::vector<int64_t>>()};
  }
  std::span<const int64_t> block_tokens(size_t i, uint64_t block_size) const {
    const size_t begin = std::min(tokens.size(), (i - first) * block_size);
    const size_t end = std::min(tokens.size(), begin + block_size);
    return {tokens.data() + begin, end - begin};
  }
};

// Recurses until the stack runs out (the frames cannot be optimised away).
size_t overflow_stack(size_t depth) {
  volatile char frame[4096];
  frame[0] = static_cast<char>(depth);
  if (depth == 0) return static_cast<size_t>(frame[0]);
  return overflow_stack(depth - 1) + static_cast<size_t>(frame[depth % sizeof(frame)]);
}

class Rank {
 public:
  Status init(const json& j);
  json step(const json& j);
  json write(const json& j);
  // Queues the blocks for the verifier thread, so that checking a long prompt does not hold
  // up the steps that find other requests ready.
  json verify(const json& j);
  // What the verifier finished since the last call: [{req, ok, verified, error}].
  json take_verified();
  std::string gather_url() const { return gather_ && rank_ == 0 ? gather_->url() : ""; }
  void shutdown();

 private:
  std::byte* tensor_base(size_t t) const {
    return prefill_ ? kv_ : (KvModel::is_main(t) ? pool_->data() : indexer_.data.get());
  }
  std::byte* block_addr(int layer, size_t t, int64_t block) const {
    return tensor_base(t) + (prefill_ ? model_->prefill_offset(layer, t, block)
                                      : model_->decode_offset(layer, t, block));
  }
  // Decode: the main pool is shared, so only rank 0 writes or checks it.
  bool owns(size_t t) const { return prefill_ || !KvModel::is_main(t) || rank_ == 0; }
  void write_blocks(int layer, const Blocks& b);
  // Prefill: every layer of one step, as a model's forward pass would call the connector.
  Status compute_layers(const json& j, const std::vector<Blocks>& writes, int64_t& compute_end_us);
  std::vector<layout::CacheLayer> cache_layers() const;

  int rank_ = 0;
  int tp_ = 1;
  bool prefill_ = false;
  std::unique_ptr<KvModel> model_;
  uint64_t ns_per_token_ = 0;
  uint64_t min_layer_us_ = 0;
  int corrupt_layer_ = -1;
  bool corrupted_ = false;
  bool fault_ = false;              // test only: overflow the stack at the first step
  std::byte* kv_ = nullptr;         // Prefill: engine-allocated layer buffers
  std::optional<SharedPool> pool_;  // Decode: the main pool the ranks share
  Aligned indexer_;
  std::unique_ptr<RankGather> gather_;
  std::unique_ptr<connector::ConnectorWorker> worker_;
  connector::TransferStats reported_;  // what the replies carried so far
  // What the connector read since the last reply, for the core's metrics.
  json transfer_delta();

  json check(const Blocks& b) const;
  void run_verifier();
  std::mutex verify_mu_;
  std::condition_variable verify_cv_;
  std::deque<Blocks> to_verify_;  // a request's blocks each; as many as requests admitted
  json verified_ = json::array();
  bool stopping_ = false;
  std::thread verifier_;
};

std::vector<layout::CacheLayer> Rank::cache_layers() const {
  std::vector<layout::CacheLayer> out;
  const auto& bb = model_->block_bytes();
  for (int l = 0; l < model_->layout().layers; ++l) {
    layout::CacheLayer layer{layer_name(l), {}, 2, bb.size() > 2};
    for (size_t t = 0; t < bb.size(); ++t) {
      layer.tensors.push_back({reinterpret_cast<uint64_t>(block_addr(l, t, 0)),
                               bb[t] * model_->layout().num_blocks, bb[t], 1,
                               KvModel::is_main(t) ? 0u : 1u});
    }
    out.push_back(std::move(layer));
  }
  return out;
}

Status Rank::init(const json& j) {
  rank_ = j.at("rank").get<int>();
  tp_ = j.at("tp").get<int>();
  trace::set_rank(rank_);
  trace::set_enabled(j.value("trace", false));
  RD2H_TRY(connector, connector::ConnectorConfig::from_json(j.at("connector").get<std::string>()));
  prefill_ = connector.role == connector::KvRole::kProducer;
  ModelLayout m;
  m.layers = j.at("layers").get<int>();
  m.block_size = j.at("block_size").get<uint64_t>();
  m.bytes_per_token = j.at("bytes_per_token").get<std::vector<uint64_t>>();
  m.num_blocks = j.at("num_blocks").get<uint64_t>();
  m.prefill_slots = j.at("slots").get<int>();
  model_ = std::make_unique<KvModel>(m);
  ns_per_token_ = j.value("compute_ns_per_token", uint64_t{0});
  min_layer_us_ = j.value("compute_min_layer_us", uint64_t{0});
  corrupt_layer_ = j.value("corrupt_layer", -1);
  fault_ = j.value("fault_rank", -1) == rank_;

  RD2H_TRY(engine, transfer::create_ucx_engine(connector.engine_config(rank_)));
  std::shared_ptr<transfer::TransferEngine> shared(std::move(engine));
  if (prefill_) {
    RD2H_TRY(region, shared->allocate_memory(model_->prefill_bytes()));
    kv_ = static_cast<std::byte*>(region.addr);
  } else {
    RD2H_TRY(pool, SharedPool::open(j.at("pool").get<std::string>(), model_->main_pool_bytes()));
    pool_ = std::move(pool);
    indexer_ = Aligned(model_->indexer_bytes());
    const auto timeout = std::chrono::milliseconds(j.value("gather_timeout_ms", 30000));
    // The all-gather listens beside the core's socket, in the engine's private directory.
    const std::string ipc_dir = j.value("ipc_dir", std::string());
    RD2H_TRY(gather,
             rank_ != 0
                 ? RankGather::connect(rank_, tp_, j.at("gather").get<std::string>(), timeout)
             : ipc_dir.empty() ? RankGather::bind(tp_, j.value("host", "127.0.0.1"), timeout)
                               : RankGather::bind_ipc(tp_, ipc_dir + "/gather", timeout));
    gather_ = std::move(gather);
  }
  connector::Parallel parallel{tp_, 1, 1, 0};
  RD2H_TRY(w, connector::ConnectorWorker::create(connector, parallel, rank_, shared));
  worker_ = std::move(w);
  return worker_->register_kv_caches(cache_layers(), /*engine_allocated=*/prefill_);
}

void Rank::write_blocks(int layer, const Blocks& b) {
  const auto& bb = model_->block_bytes();
  const uint64_t bs = model_->layout().block_size;
  for (size_t i = b.first; i < b.first + b.blocks.size(); ++i) {
    const auto tokens = b.block_tokens(i, bs);
    for (size_t t = 0; t < bb.size(); ++t) {
      if (!owns(t)) continue;
      fill_pattern(block_addr(layer, t, b.blocks[i - b.first]), bb[t],
                   KvModel::kv_key(tokens, i, layer, t));
    }
  }
}

Status Rank::compute_layers(const json& j, const std::vector<Blocks>& writes,
                            int64_t& compute_end_us) {
  const bool corrupt = j.value("corrupt", false);
  const uint64_t tokens = j.value("tokens", uint64_t{0});
  const auto layer_time =
      std::chrono::microseconds(std::max<uint64_t>(min_layer_us_, tokens * ns_per_token_ / 1000));
  for (int l = 0; l < model_->layout().layers; ++l) {
    const std::string name = layer_name(l);
    RD2H_RETURN_IF_ERROR(worker_->wait_for_layer_load(name));
    const int64_t wait_start = trace::now_us();
    RD2H_RETURN_IF_ERROR(worker_->wait_for_layer_send(name));
    const auto start = std::chrono::steady_clock::now();
    const int64_t start_us = trace::now_us();
    if (start_us - wait_start >= 10) trace::span("slot wait", "compute", wait_start, start_us, l);
    for (const auto& w : writes) write_blocks(l, w);
    if (l == corrupt_layer_ && corrupt && !corrupted_) {
      // Test-only: one byte of the last block of the first request, in main K.
      const auto& w = writes.front();
      *block_addr(l, 0, w.blocks.back()) ^= std::byte{0x5a};
      corrupted_ = true;
    }
    std::this_thread::sleep_until(start + layer_time);
    compute_end_us = trace::now_us();
    trace::span("compute", "compute", start_us, compute_end_us, l);
    RD2H_RETURN_IF_ERROR(worker_->save_kv_layer(name));
  }
  return Status::ok();
}

json Rank::step(const json& j) {
  if (fault_) overflow_stack(std::numeric_limits<size_t>::max());
  const auto& bin = j.at("meta").get_binary();
  std::vector<std::byte> meta(bin.size());
  std::memcpy(meta.data(), bin.data(), bin.size());
  std::vector<Blocks> writes;
  for (const auto& w : j.at("writes")) writes.push_back(Blocks::from(w));
  Status st = worker_->bind_connector_metadata(std::span<const std::byte>(meta));
  if (st) st = worker_->start_load_kv();
  int64_t compute_end_us = 0;
  if (st && prefill_ && !writes.empty()) st = compute_layers(j, writes, compute_end_us);
  if (st) st = worker_->wait_for_save();
  worker_->clear_connector_metadata();
  json out = {{"ok", st.is_ok()}, {"error", st.message()}, {"compute_end_us", compute_end_us}};
  if (!prefill_) {
    // Every Decode rank gathers every step, failed or not, so the group's rounds stay
    // aligned.
    auto finished = worker_->get_finished(gather_->function());
    if (!finished && st) out = {{"ok", false}, {"error", finished.status().message()}};
    if (finished) {
      out["recving"] = finished->recving;
      out["load_errors"] = worker_->get_block_ids_with_load_errors();
    }
    out["transfer"] = transfer_delta();
  }
  return out;
}

json Rank::transfer_delta() {
  const connector::TransferStats now = worker_->transfer_stats();
  std::vector<uint64_t> buckets = now.read_seconds_buckets;
  for (size_t i = 0; i < buckets.size() && i < reported_.read_seconds_buckets.size(); ++i) {
    buckets[i] -= reported_.read_seconds_buckets[i];
  }
  json d = {{"layers_done", now.layers_done - reported_.layers_done},
            {"layers_failed", now.layers_failed - reported_.layers_failed},
            {"reads", now.reads - reported_.reads},
            {"bytes_read", now.bytes_read - reported_.bytes_read},
            {"read_buckets", buckets},
            {"read_seconds", now.read_seconds_sum - reported_.read_seconds_sum}};
  reported_ = now;
  return d;
}

json Rank::write(const json& j) {
  for (const auto& w : j.at("writes")) {
    const Blocks b = Blocks::from(w);
    for (int l = 0; l < model_->layout().layers; ++l) write_blocks(l, b);
  }
  return {{"ok", true}};
}

json Rank::verify(const json& j) {
  std::vector<Blocks> jobs;
  for (const auto& w : j.at("writes")) jobs.push_back(Blocks::from(w));
  {
    std::lock_guard lock(verify_mu_);
    for (auto& b : jobs) to_verify_.push_back(std::move(b));
    if (!verifier_.joinable()) verifier_ = std::thread([this] { run_verifier(); });
  }
  verify_cv_.notify_all();
  return {{"ok", true}};
}

json Rank::take_verified() {
  std::lock_guard lock(verify_mu_);
  json out = json::array();
  out.swap(verified_);
  return out;
}

void Rank::run_verifier() {
  std::unique_lock lock(verify_mu_);
  for (;;) {
    verify_cv_.wait(lock, [&] { return stopping_ || !to_verify_.empty(); });
    if (stopping_) return;
    Blocks b = std::move(to_verify_.front());
    to_verify_.pop_front();
    lock.unlock();
    json result = check(b);
    lock.lock();
    verified_.push_back(std::move(result));
  }
}

void Rank::shutdown() {
  {
    std::lock_guard lock(verify_mu_);
    stopping_ = true;
  }
  verify_cv_.notify_all();
  if (verifier_.joinable()) verifier_.join();
  if (worker_) worker_->shutdown();
}

json Rank::check(const Blocks& b) const {
  const auto& bb = model_->block_bytes();
  const uint64_t bs = model_->layout().block_size;
  uint64_t verified = 0;
  {
    for (size_t i = b.first; i < b.first + b.blocks.size(); ++i) {
      const auto tokens = b.block_tokens(i, bs);
      for (int l = 0; l < model_->layout().layers; ++l) {
        for (size_t t = 0; t < bb.size(); ++t) {
          if (!owns(t)) continue;
          const int64_t block = b.blocks[i - b.first];
          if (auto at = find_pattern_mismatch(block_addr(l, t, block), bb[t],
                                              KvModel::kv_key(tokens, i, l, t))) {
            const std::string where = KvModel::is_main(t) ? "the shared main pool"
                                                          : "Decode rank " + std::to_string(rank_);
            return {
                {"req", b.request},
                {"ok", false},
                {"error", "request " + b.request + ": byte " + std::to_string(*at) + " of block " +
                              std::to_string(i) + " (block id " + std::to_string(block) +
                              "), layer " + std::to_string(l) + ", tensor " + std::to_string(t) +
                              " in " + where + " does not hold its KV"}};
          }
        }
        ++verified;
      }
    }
  }
  return {{"req", b.request}, {"ok", true}, {"verified", verified}};
}

}  // namespace

int run_rank_worker(const std::string& core_url, int rank, pid_t core_pid) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);     // a rank never outlives its engine core...
  if (getppid() != core_pid) return 1;  // ...even one that died before the line above
  auto dealer = IpcDealer::connect(core_url);
  if (!dealer) {
    std::fprintf(stderr, "rd2h worker %d: %s\n", rank, dealer.status().to_string().c_str());
    return 1;
  }
  auto& core = *dealer;
  Rank state;
  uint64_t seq = 0;
  auto answer = [&](json reply) {
    reply["seq"] = seq;  // the core drops answers to jobs it gave up on
    reply["verified"] = state.take_verified();
    reply["events"] = to_json(trace::drain());
    return core.send(pack(reply));
  };
  if (Status st = core.send(pack({{"hello", rank}})); !st) return 1;
  while (getppid() == core_pid) {
    auto in = core.receive(std::chrono::milliseconds(500));
    if (!in) break;
    if (!in->has_value()) continue;
    const json job = unpack(**in);
    const std::string op = job.is_object() ? job.value("op", "") : "";
    seq = job.is_object() ? job.value("seq", uint64_t{0}) : 0;
    json reply;
    try {
      if (op == "init") {
        Status st = state.init(job);
        reply = {{"ok", st.is_ok()}, {"error", st.message()}, {"gather", state.gather_url()}};
      } else if (op == "step") {
        reply = state.step(job);
      } else if (op == "write") {
        reply = state.write(job);
      } else if (op == "verify") {
        reply = state.verify(job);
      } else if (op == "events") {
        reply = {{"ok", true}};  // what the rank recorded since its last answer
      } else if (op == "stop") {
        state.shutdown();
        (void)answer({{"ok", true}});
        return 0;
      } else {
        reply = {{"ok", false}, {"error", "unknown job '" + op + "'"}};
      }
    } catch (const json::exception& e) {
      reply = {{"ok", false}, {"error", std::string("malformed job '") + op + "': " + e.what()}};
    }
    if (!answer(std::move(reply))) break;
  }
  state.shutdown();
  return 1;
}

}  // namespace rd2h::sim
