// MultiConnector: rd2h composed with the layerwise host-offload connector over shared
// physical layer buffers, with real UCX and ZeroMQ on loopback; and the call order of the
// composition itself.
#include "rd2h/connector/multi_connector.h"
#include "rd2h/common/deadline.h"

#include <gtest/gtest.h>

#include <random>

#include "e2e/pd_cluster.h"
#include "rd2h/connector/host_offload.h"
#include "rd2h/connector/scheduler.h"
#include "rd2h/connector/worker.h"
#include "support/engines.h"
#include "transfer/fault_injecting_engine.h"

namespace rd2h::connector {
namespace {

using namespace rd2h::testing;

constexpr int kLayers = 9;
constexpr int kSlots = 3;
constexpr uint64_t kBlocks = 8;
const std::vector<uint64_t> kBytes = {512, 64, 128};

class OffloadWithRd2h : public ::testing::Test {
 protected:
  void SetUp() override {
    // Decode: one rank whose reads are slow, so a buffer overwritten too early shows.
    decode_kv_ = HostBuffer((kBytes[0] + kBytes[1] + kBytes[2]) * kBlocks * kLayers);
    decode_engine_ =
        std::make_shared<transfer::FaultInjectingEngine>(shm_engine(transfer::Role::kDecode));
    decode_engine_->delay_reads(3ms);
    std::mt19937 rng(std::random_device{}());
    for (int attempt = 0; attempt < 20 && !decode_; ++attempt) {
      ConnectorConfig c;
      c.role = KvRole::kConsumer;
      c.kv_port = std::uniform_int_distribution<int>(20000, 60000)(rng);
      auto w = ConnectorWorker::create(c, {}, 0, decode_engine_);
      ASSERT_TRUE(w);
      if ((*w)->register_kv_caches(layers(decode_kv_.addr(), kLayers)).is_ok()) {
        decode_ = std::move(*w);
        kv_port_ = c.kv_port;
      }
    }
    ASSERT_TRUE(decode_);

    // Prefill: rd2h and the host offload over the same three physical slots.
    auto p_engine = shm_engine(transfer::Role::kPrefill);
    auto region = p_engine->allocate_memory((kBytes[0] + kBytes[1] + kBytes[2]) * kBlocks * kSlots);
    ASSERT_TRUE(region);
    prefill_kv_ = reinterpret_cast<uint64_t>(region->addr);
    ConnectorConfig pc;
    pc.role = KvRole::kProducer;
    pc.kv_port = 1;
    auto rd2h = ConnectorWorker::create(pc, {}, 0, p_engine);
    ASSERT_TRUE(rd2h);
    std::vector<std::unique_ptr<KvConnectorWorker>> parts;
    parts.push_back(std::make_unique<HostOffloadWorker>(store_));  // listed first on purpose
    parts.push_back(std::move(*rd2h));
    prefill_ = std::make_unique<MultiConnectorWorker>(std::move(parts));
    ASSERT_TRUE(prefill_->register_kv_caches(layers(prefill_kv_, kSlots), true).is_ok());
  }

  // kLayers layers over `slots` physical slots starting at `base`.
  static std::vector<layout::CacheLayer> layers(uint64_t base, int slots) {
    std::vector<layout::CacheLayer> out;
    const uint64_t per_slot = (kBytes[0] + kBytes[1] + kBytes[2]) * kBlocks;
    for (int l = 0; l < kLayers; ++l) {
      layout::CacheLayer layer{layer_name(l), {}, 2, true};
      uint64_t addr = base + static_cast<uint64_t>(l % slots) * per_slot;
      for (uint64_t b : kBytes) {
        layer.tensors.push_back({addr, b * kBlocks, b});
        addr += b * kBlocks;
      }
      out.push_back(std::move(layer));
    }
    return out;
  }
  static uint64_t block_addr(uint64_t base, int slot, size_t t, int64_t block) {
    uint64_t off = static_cast<uint64_t>(slot) * (kBytes[0] + kBytes[1] + kBytes[2]) * kBlocks;
    for (size_t k = 0; k < t; ++k) off += kBytes[k] * kBlocks;
    return base + off + static_cast<uint64_t>(block) * kBytes[t];
  }
  bool decode_holds(int layer, int64_t dst, uint64_t key_block) const {
    for (size_t t = 0; t < kBytes.size(); ++t) {
      if (find_pattern_mismatch(
              reinterpret_cast<const void*>(block_addr(decode_kv_.addr(), layer, t, dst)),
              kBytes[t], block_key(layer, t, static_cast<int64_t>(key_block)))) {
        return false;
      }
    }
    return true;
  }

  // One Prefill forward: the offload loads its blocks into each layer's slot (waiting on
  // rd2h's gate for the slot's previous owner), the compute writes `computed` blocks, both
  // connectors save the layer. The compute waits for the slot only after the load.
  void forward(const std::string& id, const std::vector<int64_t>& blocks,
               const std::vector<int64_t>& computed, const OffloadMetadata& offload) {
    ConnectorMetadata rd2h;
    rd2h.save.push_back({id, "127.0.0.1", kv_port_, 1, blocks, blocks, 0, 0, true, {}});
    const auto meta = encode_multi({encode(offload), encode(rd2h)});
    ASSERT_TRUE(prefill_->bind_connector_metadata(meta).is_ok());
    for (int l = 0; l < kLayers; ++l) {
      ASSERT_TRUE(prefill_->wait_for_layer_load(layer_name(l)).is_ok());
      ASSERT_TRUE(prefill_->wait_for_layer_send(layer_name(l)).is_ok());
      for (int64_t b : computed) {
        for (size_t t = 0; t < kBytes.size(); ++t) {
          fill_pattern(reinterpret_cast<void*>(block_addr(prefill_kv_, l % kSlots, t, b)),
                       kBytes[t], block_key(l, t, b));
        }
      }
      ASSERT_TRUE(prefill_->save_kv_layer(layer_name(l), nullptr).is_ok());
    }
    ASSERT_TRUE(prefill_->wait_for_save().is_ok());
    prefill_->clear_connector_metadata();
  }

  void decode_expects(const std::string& id, const std::vector<int64_t>& dst) {
    ConnectorMetadata m;
    m.load.push_back({id, id + "-internal", dst, dst});
    ASSERT_TRUE(decode_->bind_connector_metadata(m).is_ok());
    ASSERT_TRUE(decode_->start_load_kv().is_ok());
  }
  // What Decode reports once something ended, polled as vLLM polls it each step (a request
  // completes on Prefill's commit, which follows the step), for at most 10 s.
  std::vector<std::string> decode_finished() {
    const Deadline deadline(std::chrono::seconds(10));
    for (;;) {
      auto f = decode_->get_finished(
          [](const decode::RankTerminal& mine) -> Expected<std::vector<decode::RankTerminal>> {
            return std::vector<decode::RankTerminal>{mine};
          });
      EXPECT_TRUE(f);
      if (!f || !f->recving.empty() || deadline.expired()) {
        return f ? f->recving : std::vector<std::string>{};
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  std::shared_ptr<HostStore> store_ = std::make_shared<HostStore>();
  HostBuffer decode_kv_;
  std::shared_ptr<transfer::FaultInjectingEngine> decode_engine_;
  std::unique_ptr<ConnectorWorker> decode_;
  int kv_port_ = 0;
  uint64_t prefill_kv_ = 0;
  std::unique_ptr<MultiConnectorWorker> prefill_;
};

TEST_F(OffloadWithRd2h, AReusedPrefixIsLoadedIntoSharedSlotsOnlyAfterRd2hReleasedThem) {
  // Request a computes blocks 0..3; the offload stores them under keys p0..p3.
  decode_expects("a", {0, 1, 2, 3});
  forward("a", {0, 1, 2, 3}, {0, 1, 2, 3}, {{{"p0", 0}, {"p1", 1}, {"p2", 2}, {"p3", 3}}, {}});
  EXPECT_EQ(decode_finished(), std::vector<std::string>{"a-internal"});
  EXPECT_EQ(store_->size(), 4u * kLayers);

  // Request b shares a's first two blocks: the offload loads them into blocks 4 and 5 of
  // every layer's slot, the compute writes blocks 6 and 7.
  decode_expects("b", {4, 5, 6, 7});
  forward("b", {4, 5, 6, 7}, {6, 7}, {{}, {{"p0", 4}, {"p1", 5}}});
  EXPECT_EQ(decode_finished(), std::vector<std::string>{"b-internal"});
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_TRUE(decode_holds(l, 0, 0) && decode_holds(l, 3, 3)) << "request a, layer " << l;
    // Loaded prefix: the bytes a computed at blocks 0 and 1 of this very layer.
    EXPECT_TRUE(decode_holds(l, 4, 0)) << "request b, layer " << l << ", loaded block 4";
    EXPECT_TRUE(decode_holds(l, 5, 1)) << "request b, layer " << l << ", loaded block 5";
    EXPECT_TRUE(decode_holds(l, 6, 6) && decode_holds(l, 7, 7)) << "request b, layer " << l;
  }
  auto& offload = static_cast<HostOffloadWorker&>(prefill_->connector(0));
  EXPECT_EQ(offload.stats().blocks_loaded, 2u * kLayers);
  // The offload holds rd2h's waiter: it waits before every layer of both forwards.
  EXPECT_EQ(offload.stats().reuse_waits, 2u * kLayers);
}

// A connector that records the calls it gets, to check the composition's order.
class Recorder final : public KvConnectorWorker {
 public:
  Recorder(std::string name, std::vector<std::string>* log) : name_(std::move(name)), log_(log) {}
  std::string_view name() const override { return name_; }
  Status register_kv_caches(std::vector<layout::CacheLayer>, bool) override {
    return note("register");
  }
  Status bind_connector_metadata(std::span<const std::byte> m) override {
    return note("bind:" + std::string(reinterpret_cast<const char*>(m.data()), m.size()));
  }
  void clear_connector_metadata() override {}
  Status start_load_kv() override { return note("start_load"); }
  Status wait_for_layer_load(std::string_view) override {
    if (waiter_) RD2H_RETURN_IF_ERROR(waiter_("L"));
    return note("load");
  }
  Status save_kv_layer(std::string_view, std::shared_ptr<prefill::WriteEvent>) override {
    return note("save");
  }
  Status on_kv_cache_written(std::string_view) override { return note("written"); }
  Status wait_for_layer_send(std::string_view) override { return note("send_wait"); }
  Status wait_for_save() override { return note("wait_save"); }
  Expected<FinishedTransfers> get_finished(const decode::AllGather&) override {
    return FinishedTransfers{{name_ + "-sent"}, {}};
  }
  std::vector<int64_t> get_block_ids_with_load_errors() override { return {}; }
  void shutdown() override {}
  bool set_buffer_reuse_waiter(BufferReuseWaiter w) override {
    if (!takes_waiter_) return false;
    waiter_ = std::move(w);
    return true;
  }
  bool takes_waiter_ = true;

 private:
  Status note(const std::string& what) {
    log_->push_back(name_ + ":" + what);
    return Status::ok();
  }
  std::string name_;
  std::vector<std::string>* log_;
  BufferReuseWaiter waiter_;
};

TEST(MultiConnector, Rd2hRunsFirstAndIsTheOthersBufferReuseWaiter) {
  std::vector<std::string> log;
  std::vector<std::unique_ptr<KvConnectorWorker>> parts;
  parts.push_back(std::make_unique<Recorder>("store", &log));
  parts.push_back(std::make_unique<Recorder>("rd2h", &log));
  MultiConnectorWorker multi(std::move(parts));
  auto blob = [](const char* s) {
    return std::vector<std::byte>(reinterpret_cast<const std::byte*>(s),
                                  reinterpret_cast<const std::byte*>(s) + std::strlen(s));
  };
  ASSERT_TRUE(multi.bind_connector_metadata(encode_multi({blob("S"), blob("R")})).is_ok());
  ASSERT_TRUE(multi.wait_for_layer_load("L").is_ok());
  ASSERT_TRUE(multi.save_kv_layer("L", nullptr).is_ok());
  ASSERT_TRUE(multi.on_kv_cache_written("L").is_ok());
  // The store calls rd2h's wait itself: rd2h's own wait_for_layer_load is not called too.
  EXPECT_EQ(log, (std::vector<std::string>{"store:bind:S", "rd2h:bind:R",
                                           "rd2h:send_wait", "store:load", "rd2h:save",
                                           "store:save", "rd2h:written", "store:written"}));
  auto f = multi.get_finished({});
  ASSERT_TRUE(f);
  EXPECT_EQ(f->sending, (std::vector<std::string>{"rd2h-sent", "store-sent"}));
  EXPECT_FALSE(multi.bind_connector_metadata(encode_multi({blob("only one")})).is_ok());
}

TEST(MultiConnector, Rd2hsOwnLoadWaitRunsWhenNoOtherConnectorTookItsWaiter) {
  std::vector<std::string> log;
  auto store = std::make_unique<Recorder>("store", &log);
  store->takes_waiter_ = false;
  std::vector<std::unique_ptr<KvConnectorWorker>> parts;
  parts.push_back(std::move(store));
  parts.push_back(std::make_unique<Recorder>("rd2h", &log));
  MultiConnectorWorker multi(std::move(parts));
  ASSERT_TRUE(multi.wait_for_layer_load("L").is_ok());
  EXPECT_EQ(log, (std::vector<std::string>{"rd2h:load", "store:load"}));
}

TEST(MultiConnectorScheduler, TheOffloadLoadsAPrefixWhileRd2hSeesAndPublishesEveryBlock) {
  auto store = std::make_shared<HostStore>();
  const std::string probe = layer_name(kLayers - 1);
  std::vector<int64_t> tokens(50);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int64_t>(1000 + i);
  const auto keys = block_keys(tokens, 16);
  ASSERT_EQ(keys.size(), 3u);
  store->put(keys[0], probe, {});
  store->put(keys[1], probe, {});

  ConnectorConfig pc;
  pc.role = KvRole::kProducer;
  pc.kv_port = 1;
  auto rd2h = Scheduler::create(pc, {}, {{{layer_name(0)}, 16}});
  ASSERT_TRUE(rd2h);
  std::vector<std::unique_ptr<KvConnectorScheduler>> parts;
  parts.push_back(std::make_unique<HostOffloadScheduler>(store, probe, 16));  // lookup first
  parts.push_back(std::move(*rd2h));
  MultiConnectorScheduler multi(std::move(parts));
  EXPECT_TRUE(multi.requires_full_blocks_on_update_after_alloc());

  KvTransferParams params;
  params.do_remote_decode = true;
  params.remote_host = "127.0.0.1";
  params.remote_port = 30000;
  Request r{"cmpl-m-0-abcdefgh", 50, params, tokens};
  const auto matched = multi.get_num_new_matched_tokens(r, 0);
  EXPECT_EQ(matched.tokens, 32u) << "two stored blocks";
  ASSERT_TRUE(multi.update_state_after_alloc(r, {{10, 11, 12, 13}}, 32).is_ok());
  auto bytes = multi.build_connector_meta({{r.request_id, {}, 50}});
  ASSERT_TRUE(bytes) << bytes.status().to_string();
  auto blobs = decode_multi(*bytes);
  ASSERT_TRUE(blobs);
  ASSERT_EQ(blobs->size(), 2u);
  auto offload = decode_offload_metadata((*blobs)[0]);
  ASSERT_TRUE(offload);
  ASSERT_EQ(offload->load.size(), 2u);
  EXPECT_EQ(offload->load[0].key, keys[0]);
  EXPECT_EQ(offload->load[1].block_id, 11);
  ASSERT_EQ(offload->save.size(), 1u) << "the one newly computed full block";
  EXPECT_EQ(offload->save[0].block_id, 12);
  auto published = decode_metadata((*blobs)[1]);
  ASSERT_TRUE(published);
  ASSERT_EQ(published->save.size(), 1u);
  EXPECT_EQ(published->save[0].main_block_ids, (std::vector<int64_t>{10, 11, 12, 13}))
      << "rd2h publishes the loaded prefix too: Decode needs the whole prompt";
  EXPECT_TRUE(published->save[0].final_chunk);
  EXPECT_TRUE(multi.request_finished(r));
}

// A scheduler that returns kv_transfer_params when a request finishes.
class ParamsOnFinish final : public KvConnectorScheduler {
 public:
  explicit ParamsOnFinish(std::string name) : name_(std::move(name)) {}
  std::string_view name() const override { return name_; }
  MatchedTokens get_num_new_matched_tokens(const Request&, uint64_t) override { return {}; }
  Status update_state_after_alloc(Request&, const std::vector<std::vector<int64_t>>&,
                                  uint64_t) override {
    return Status::ok();
  }
  Expected<std::vector<std::byte>> build_connector_meta(
      const std::vector<ScheduledRequest>&) override {
    return std::vector<std::byte>{};
  }
  Expected<FinishedRequest> request_finished(const Request&) override {
    return FinishedRequest{false, KvTransferParams{}};
  }

 private:
  std::string name_;
};

// A scheduler that matches a fixed number of tokens and may report requests preempted.
class Matcher final : public KvConnectorScheduler {
 public:
  Matcher(std::string name, uint64_t tokens, std::string preempted = {})
      : name_(std::move(name)), tokens_(tokens), preempted_(std::move(preempted)) {}
  std::string_view name() const override { return name_; }
  MatchedTokens get_num_new_matched_tokens(const Request&, uint64_t) override {
    return {tokens_, false};
  }
  Status update_state_after_alloc(Request&, const std::vector<std::vector<int64_t>>& blocks,
                                  uint64_t external) override {
    if (external > 0) loaded_ = !blocks.empty();
    return Status::ok();
  }
  Expected<std::vector<std::byte>> build_connector_meta(
      const std::vector<ScheduledRequest>&) override {
    return std::vector<std::byte>{};
  }
  Expected<FinishedRequest> request_finished(const Request&) override { return FinishedRequest{}; }
  bool reports_preempted(const Request& r) const override { return r.request_id == preempted_; }
  bool loaded_ = false;

 private:
  std::string name_;
  uint64_t tokens_;
  std::string preempted_;
};

TEST(MultiConnectorScheduler, AConnectorReportingARequestPreemptedDecidesItsMatchFirst) {
  std::vector<std::unique_ptr<KvConnectorScheduler>> parts;
  parts.push_back(std::make_unique<Matcher>("first", 16));
  parts.push_back(std::make_unique<Matcher>("holder", 48, "p-abcdefgh"));
  MultiConnectorScheduler multi(std::move(parts));
  Request preempted{"p-abcdefgh", 64, std::nullopt, {}}, fresh{"f-abcdefgh", 64, std::nullopt, {}};
  EXPECT_EQ(multi.get_num_new_matched_tokens(preempted, 0).tokens, 48u)
      << "the connector holding the preempted request was not asked first";
  ASSERT_TRUE(multi.update_state_after_alloc(preempted, {{1, 2, 3}}, 48).is_ok());
  auto& first = static_cast<Matcher&>(multi.connector(0));
  auto& holder = static_cast<Matcher&>(multi.connector(1));
  EXPECT_TRUE(holder.loaded_);
  EXPECT_FALSE(first.loaded_);
  EXPECT_EQ(multi.get_num_new_matched_tokens(fresh, 0).tokens, 16u) << "composition order";
}

TEST(MultiConnectorScheduler, AtMostOneConnectorMayReturnKvTransferParams) {
  std::vector<std::unique_ptr<KvConnectorScheduler>> one;
  one.push_back(std::make_unique<ParamsOnFinish>("a"));
  MultiConnectorScheduler single(std::move(one));
  Request r{"r-abcdefgh", 1, std::nullopt, {}};
  auto f = single.request_finished(r);
  ASSERT_TRUE(f);
  EXPECT_TRUE(f->params.has_value());
  std::vector<std::unique_ptr<KvConnectorScheduler>> two;
  two.push_back(std::make_unique<ParamsOnFinish>("a"));
  two.push_back(std::make_unique<ParamsOnFinish>("b"));
  MultiConnectorScheduler both(std::move(two));
  auto g = both.request_finished(r);
  ASSERT_FALSE(g);
  EXPECT_NE(g.status().message().find("both a and b"), std::string::npos) << g.status().message();
}

}  // namespace
}  // namespace rd2h::connector
