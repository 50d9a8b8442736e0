// A PD deployment in one process for the connector's end-to-end tests: p_tp Prefill ranks
// and one or more Decode instances of d_tp ranks, each rank with its own UCX engine over
// shared memory, its worker, and ZeroMQ on loopback. Prefill ranks hold replicated KV in
// engine memory, one physical slot per `prefill_slots`; every Decode instance has one main
// pool shared by its ranks and an indexer (and LIC8 scale) per rank. Block b of tensor t of
// layer L holds a pattern keyed by (L, t, b), so a destination proves what landed in it.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "decode/local_all_gather.h"
#include "decode/worker.h"
#include "layout/cache.h"
#include "prefill/worker.h"
#include "support/engines.h"
#include "transfer/fault_injecting_engine.h"
#include "util/pattern.h"

namespace rd2h::testing {

using namespace std::chrono_literals;

struct ClusterShape {
  int p_tp = 1;
  int d_tp = 1;
  int decode_instances = 1;
  int layers = 3;
  int prefill_slots = 0;                         // physical slots on Prefill; 0: one per layer
  uint64_t blocks = 32;                          // blocks per tensor on both sides
  std::vector<uint64_t> bytes = {512, 64, 128};  // per block: K, V, indexer [, scale]
  // Decode's own tensors when they should differ from Prefill's (layout mismatches).
  std::vector<uint64_t> decode_bytes;  // empty: as Prefill
  std::chrono::milliseconds reply_timeout = 10s;
  std::chrono::milliseconds send_timeout = 20s;
  // Prefill's compute path raises a Decode's failure (the design's fail-fast, which most of
  // these tests check); false: only that Decode's requests fail (the connector's default).
  bool raise_on_peer_failure = true;
};

inline std::string layer_name(int l) {
  return "model.layers." + std::to_string(l) + ".self_attn";
}
inline uint64_t block_key(int layer, size_t tensor, int64_t block) {
  return (static_cast<uint64_t>(layer) << 32) | (tensor << 16) | static_cast<uint64_t>(block);
}

// Zeroed, page-aligned host memory owned by the test.
class HostBuffer {
 public:
  HostBuffer() = default;
  explicit HostBuffer(size_t bytes)
      : size_(bytes), data_(static_cast<std::byte*>(std::aligned_alloc(4096, round(bytes)))) {
    std::memset(data_.get(), 0, round(bytes));
  }
  std::byte* data() const { return data_.get(); }
  uint64_t addr() const { return reinterpret_cast<uint64_t>(data_.get()); }
  size_t size() const { return size_; }

 private:
  static size_t round(size_t n) { return (n + 4095) / 4096 * 4096; }
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  size_t size_ = 0;
  std::unique_ptr<std::byte, Free> data_;
};

using ThreadAllGather = decode::LocalAllGather;

// A request as both sides know it: Prefill's source blocks and Decode's destinations.
struct PdRequest {
  std::string id;
  int instance = 0;
  std::vector<int64_t> p_main, p_indexer;  // Prefill block ids
  std::vector<int64_t> d_main, d_indexer;  // Decode block ids, one per Prefill block
};

// What one step publishes for a request: blocks [begin, end) and whether it is the final chunk.
struct StepPart {
  const PdRequest* request;
  layout::Range slice;
  bool final_chunk = false;
};

class Cluster {
 public:
  struct DecodeRank {
    std::shared_ptr<transfer::FaultInjectingEngine> engine;
    HostBuffer indexer;  // layers x (indexer [, scale]) x blocks
    std::unique_ptr<decode::Worker> worker;
  };
  struct DecodeInstance {
    HostBuffer main;  // layers x (K, V) x blocks, shared by the ranks
    int kv_port = 0;
    std::vector<DecodeRank> ranks;
    std::unique_ptr<ThreadAllGather> gather;
  };
  struct PrefillRank {
    std::shared_ptr<transfer::TransferEngine> engine;
    std::byte* kv = nullptr;  // engine-allocated: slots x tensors x blocks
    std::unique_ptr<prefill::Worker> worker;
  };

  explicit Cluster(ClusterShape shape) : shape_(std::move(shape)) {
    if (shape_.prefill_slots == 0) shape_.prefill_slots = shape_.layers;
    if (shape_.decode_bytes.empty()) shape_.decode_bytes = shape_.bytes;
    for (int i = 0; i < shape_.decode_instances; ++i) start_decode_instance();
    for (int r = 0; r < shape_.p_tp; ++r) start_prefill_rank(r);
  }

  const ClusterShape& shape() const { return shape_; }
  PrefillRank& prefill(int rank) { return prefill_[static_cast<size_t>(rank)]; }
  DecodeInstance& decode(int instance = 0) { return decode_[static_cast<size_t>(instance)]; }
  DecodeRank& decode_rank(int instance, int rank) {
    return decode(instance).ranks[static_cast<size_t>(rank)];
  }

  // Decode's scheduler allocated the request on every (live) rank of its instance; its KV
  // must arrive by `arrival_deadline`.
  void expect_request(const PdRequest& r, std::chrono::steady_clock::time_point arrival_deadline =
                                              std::chrono::steady_clock::time_point::max()) {
    for (auto& rank : decode(r.instance).ranks) {
      if (!rank.worker) continue;
      ASSERT_TRUE(rank.worker
                      ->add_request(r.id, "internal-" + r.id, r.d_main, r.d_indexer,
                                    arrival_deadline)
                      .is_ok());
    }
  }

  // One forward pass on every Prefill rank, each in its own thread: bind the step, then per
  // layer wait for its slot, write it and save it; then wait for the whole step.
  std::vector<Status> run_step(const std::vector<StepPart>& parts) {
    std::vector<Status> results(prefill_.size());
    std::vector<std::thread> threads;
    for (size_t r = 0; r < prefill_.size(); ++r) {
      threads.emplace_back([&, r] { results[r] = forward(static_cast<int>(r), parts); });
    }
    for (auto& t : threads) t.join();
    return results;
  }

  // One get_finished round on every rank of the instance; returns rank 0's answer after
  // checking that every rank got the same.
  Expected<decode::Finished> gather_finished(int instance = 0) {
    DecodeInstance& d = decode(instance);
    std::vector<Expected<decode::Finished>> out(d.ranks.size(), internal_error("not run"));
    std::vector<std::thread> threads;
    for (size_t r = 0; r < d.ranks.size(); ++r) {
      threads.emplace_back([&, r] {
        out[r] = d.ranks[r].worker->get_finished(d.gather->for_rank(static_cast<int>(r)));
      });
    }
    for (auto& t : threads) t.join();
    for (size_t r = 1; r < out.size(); ++r) {
      if (out[r] && out[0]) {
        EXPECT_EQ(out[r]->finished, out[0]->finished) << "rank " << r;
        EXPECT_EQ(out[r]->failed, out[0]->failed) << "rank " << r;
      }
    }
    return out[0];
  }

  // gather_finished until `n` requests ended (finished or failed) on the instance, or
  // `within` passed: what they all returned. get_finished is polled as vLLM polls it each
  // step; a request from an rd2h Prefill completes when its commit (KV_COMMIT) arrives,
  // which is after Prefill's step returned.
  Expected<decode::Finished> ended(int instance, size_t n,
                                   std::chrono::milliseconds within = std::chrono::seconds(10)) {
    decode::Finished all;
    const auto until = std::chrono::steady_clock::now() + within;
    for (;;) {
      auto done = gather_finished(instance);
      if (!done) return done;
      auto add = [](auto& to, const auto& from) { to.insert(to.end(), from.begin(), from.end()); };
      add(all.finished, done->finished);
      add(all.failed, done->failed);
      add(all.invalid_main_blocks, done->invalid_main_blocks);
      add(all.invalid_indexer_blocks, done->invalid_indexer_blocks);
      if (all.finished.size() + all.failed.size() >= n ||
          std::chrono::steady_clock::now() > until) {
        return all;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));  // a step loop's interval
    }
  }

  // Whether every destination of `r` in `layer` holds its source block: main in the
  // instance's pool, indexer (and scale) on every rank. `why` says what is wrong.
  bool holds(const PdRequest& r, int layer, std::string* why = nullptr) const {
    const DecodeInstance& d = decode_[static_cast<size_t>(r.instance)];
    for (size_t i = 0; i < r.d_main.size(); ++i) {
      for (size_t t = 0; t < 2; ++t) {
        if (!check(main_addr(d, layer, t, r.d_main[i]), shape_.bytes[t],
                   block_key(layer, t, r.p_main[i]))) {
          if (why)
            *why = r.id + " layer " + std::to_string(layer) + " main tensor " + std::to_string(t) +
                   " destination " + std::to_string(i);
          return false;
        }
      }
    }
    for (size_t k = 0; k < d.ranks.size(); ++k) {
      for (size_t i = 0; i < r.d_indexer.size(); ++i) {
        for (size_t t = 2; t < shape_.bytes.size(); ++t) {
          if (!check(indexer_addr(d.ranks[k], layer, t, r.d_indexer[i]), shape_.bytes[t],
                     block_key(layer, t, r.p_indexer[i]))) {
            if (why)
              *why = r.id + " layer " + std::to_string(layer) + " rank " + std::to_string(k) +
                     " tensor " + std::to_string(t) + " destination " + std::to_string(i);
            return false;
          }
        }
      }
    }
    return true;
  }

  // What the compute of layer `l` writes, on Prefill rank `p_rank`, into that layer's slot.
  void write_layer(int p_rank, int l) { write_layer(prefill(p_rank), l); }

  // Whether no byte of the instance's destinations was written.
  bool untouched(int instance = 0) const {
    const DecodeInstance& d = decode_[static_cast<size_t>(instance)];
    auto zero = [](const HostBuffer& b) {
      return std::all_of(b.data(), b.data() + b.size(),
                         [](std::byte x) { return x == std::byte{0}; });
    };
    if (!zero(d.main)) return false;
    for (const auto& rank : d.ranks) {
      if (!zero(rank.indexer)) return false;
    }
    return true;
  }

 private:
  size_t main_bytes_per_layer(const std::vector<uint64_t>& bytes) const {
    return (bytes[0] + bytes[1]) * shape_.blocks;
  }
  size_t indexer_bytes_per_layer(const std::vector<uint64_t>& bytes) const {
    uint64_t sum = 0;
    for (size_t t = 2; t < bytes.size(); ++t) sum += bytes[t] * shape_.blocks;
    return sum;
  }
  uint64_t main_addr(const DecodeInstance& d, int layer, size_t t, int64_t block) const {
    const auto& b = shape_.decode_bytes;
    return d.main.addr() + static_cast<uint64_t>(layer) * main_bytes_per_layer(b) +
           (t == 0 ? 0 : b[0] * shape_.blocks) + static_cast<uint64_t>(block) * b[t];
  }
  uint64_t indexer_addr(const DecodeRank& r, int layer, size_t t, int64_t block) const {
    const auto& b = shape_.decode_bytes;
    uint64_t off = static_cast<uint64_t>(layer) * indexer_bytes_per_layer(b);
    for (size_t k = 2; k < t; ++k) off += b[k] * shape_.blocks;
    return r.indexer.addr() + off + static_cast<uint64_t>(block) * b[t];
  }
  // Prefill tensor t of physical slot s.
  uint64_t prefill_addr(const PrefillRank& p, int slot, size_t t) const {
    uint64_t off = 0;
    for (size_t k = 0; k < shape_.bytes.size(); ++k) off += shape_.bytes[k] * shape_.blocks;
    off *= static_cast<uint64_t>(slot);
    for (size_t k = 0; k < t; ++k) off += shape_.bytes[k] * shape_.blocks;
    return reinterpret_cast<uint64_t>(p.kv) + off;
  }
  static bool check(uint64_t addr, uint64_t len, uint64_t key) {
    return !find_pattern_mismatch(reinterpret_cast<const void*>(addr), len, key);
  }

  void start_decode_instance() {
    DecodeInstance d;
    const auto& b = shape_.decode_bytes;
    d.main = HostBuffer(main_bytes_per_layer(b) * static_cast<size_t>(shape_.layers));
    d.gather = std::make_unique<ThreadAllGather>(shape_.d_tp);
    for (int r = 0; r < shape_.d_tp; ++r) {
      DecodeRank rank;
      rank.engine =
          std::make_shared<transfer::FaultInjectingEngine>(shm_engine(transfer::Role::kDecode));
      rank.indexer = HostBuffer(indexer_bytes_per_layer(b) * static_cast<size_t>(shape_.layers));
      d.ranks.push_back(std::move(rank));
    }
    // Rank ports are base + rank: retry a few random bases until every rank binds.
    std::mt19937 rng(std::random_device{}());
    for (int attempt = 0; attempt < 50; ++attempt) {
      d.kv_port = std::uniform_int_distribution<int>(20000, 60000)(rng);
      bool bound = true;
      for (int r = 0; r < shape_.d_tp && bound; ++r) {
        decode::WorkerConfig cfg;
        cfg.reader.d_rank = r;
        cfg.reader.d_tp = shape_.d_tp;
        cfg.reader.host = "127.0.0.1";
        cfg.reader.hold_timeout = 2s;
        cfg.p_tp = shape_.p_tp;
        cfg.kv_port = d.kv_port;
        cfg.global_dp_rank = 0;
        auto w = decode::Worker::create(cfg, d.ranks[static_cast<size_t>(r)].engine, context_,
                                        decode_layers(d, d.ranks[static_cast<size_t>(r)]));
        if (!w) {
          ASSERT_NE(w.status().code(), StatusCode::kInvalidArgument) << w.status().to_string();
          bound = false;
          break;
        }
        d.ranks[static_cast<size_t>(r)].worker = std::move(*w);
      }
      if (bound) break;
      for (auto& rank : d.ranks) rank.worker.reset();
    }
    ASSERT_TRUE(d.ranks.back().worker) << "no free run of " << shape_.d_tp << " ports";
    decode_.push_back(std::move(d));
  }

  std::vector<layout::CacheLayer> decode_layers(const DecodeInstance& d,
                                                const DecodeRank& r) const {
    const auto& b = shape_.decode_bytes;
    std::vector<layout::CacheLayer> layers;
    for (int l = 0; l < shape_.layers; ++l) {
      layout::CacheLayer layer{layer_name(l), {}, 2, b.size() > 2};
      for (size_t t = 0; t < b.size(); ++t) {
        const uint64_t addr = t < 2 ? main_addr(d, l, t, 0) : indexer_addr(r, l, t, 0);
        layer.tensors.push_back({addr, b[t] * shape_.blocks, b[t], 1, t < 2 ? 0u : 1u});
      }
      layers.push_back(std::move(layer));
    }
    return layers;
  }

  void start_prefill_rank(int p_rank) {
    PrefillRank p;
    p.engine = shm_engine(transfer::Role::kPrefill);
    ASSERT_TRUE(p.engine);
    uint64_t per_slot = 0;
    for (auto b : shape_.bytes) per_slot += b * shape_.blocks;
    auto region = p.engine->allocate_memory(per_slot * static_cast<uint64_t>(shape_.prefill_slots));
    ASSERT_TRUE(region) << region.status().to_string();
    p.kv = static_cast<std::byte*>(region->addr);
    std::vector<layout::CacheLayer> layers;
    for (int l = 0; l < shape_.layers; ++l) {
      layout::CacheLayer layer{layer_name(l), {}, 2, shape_.bytes.size() > 2};
      for (size_t t = 0; t < shape_.bytes.size(); ++t) {
        layer.tensors.push_back({prefill_addr(p, l % shape_.prefill_slots, t),
                                 shape_.bytes[t] * shape_.blocks, shape_.bytes[t], 1,
                                 t < 2 ? 0u : 1u});
      }
      layers.push_back(std::move(layer));
    }
    prefill::WorkerConfig cfg;
    cfg.p_rank = p_rank;
    cfg.p_tp = shape_.p_tp;
    cfg.sender.reply_timeout = shape_.reply_timeout;
    cfg.sender.ack_timeout = shape_.reply_timeout;
    cfg.send_timeout = shape_.send_timeout;
    cfg.raise_on_peer_failure = shape_.raise_on_peer_failure;
    cfg.register_memory = false;  // engine-allocated
    auto w = prefill::Worker::create(cfg, p.engine, context_, layers);
    ASSERT_TRUE(w) << w.status().to_string();
    p.worker = std::move(*w);
    prefill_.push_back(std::move(p));
  }

  // The compute of layer `l` on a Prefill rank: every block of its slot gets layer l's data.
  void write_layer(PrefillRank& p, int l) {
    for (size_t t = 0; t < shape_.bytes.size(); ++t) {
      const uint64_t base = prefill_addr(p, l % shape_.prefill_slots, t);
      for (uint64_t b = 0; b < shape_.blocks; ++b) {
        fill_pattern(reinterpret_cast<void*>(base + b * shape_.bytes[t]), shape_.bytes[t],
                     block_key(l, t, static_cast<int64_t>(b)));
      }
    }
  }

  Status forward(int p_rank, const std::vector<StepPart>& parts) {
    PrefillRank& p = prefill(p_rank);
    std::vector<prefill::SendRequest> requests;
    for (const auto& part : parts) {
      const PdRequest& r = *part.request;
      prefill::SendRequest s;
      s.ext_id = r.id;
      s.d_host = "127.0.0.1";
      s.d_base_port = decode(r.instance).kv_port;
      s.d_tp = shape_.d_tp;
      s.main_block_ids.assign(r.p_main.begin() + static_cast<long>(part.slice.begin),
                              r.p_main.begin() + static_cast<long>(part.slice.end));
      s.indexer_block_ids.assign(r.p_indexer.begin() + static_cast<long>(part.slice.begin),
                                 r.p_indexer.begin() + static_cast<long>(part.slice.end));
      s.main_start = s.indexer_start = static_cast<int64_t>(part.slice.begin);
      s.final_chunk = part.final_chunk;
      requests.push_back(std::move(s));
    }
    RD2H_RETURN_IF_ERROR(p.worker->bind_step(std::move(requests)));
    for (int l = 0; l < shape_.layers; ++l) {
      RD2H_RETURN_IF_ERROR(p.worker->wait_for_layer_send(layer_name(l)));
      write_layer(p, l);
      RD2H_RETURN_IF_ERROR(p.worker->save_kv_layer(layer_name(l)));
    }
    return p.worker->wait_for_save();
  }

  ClusterShape shape_;
  std::shared_ptr<control::Context> context_ = control::Context::create();
  std::vector<DecodeInstance> decode_;
  std::vector<PrefillRank> prefill_;
};

}  // namespace rd2h::testing
