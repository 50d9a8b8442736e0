// A request's whole life through the connector's public facade: Decode's scheduler
// allocates and posts its rendezvous over HTTP, Prefill's scheduler turns it into per-step
// metadata (serialized, as a host sends it to its workers), Prefill's workers publish each
// layer of each chunk, Decode's workers read them and report the request finished across
// their TP group. Real UCX (shm), ZeroMQ and HTTP on loopback; ranks are workers in one
// process. The proxy's part (passing the rendezvous on to Prefill) is played by the test.
#include <gtest/gtest.h>

#include <random>

#include "connector/test_access.h"
#include "e2e/pd_cluster.h"
#include "rd2h/connector/scheduler.h"
#include "rd2h/connector/worker.h"
#include "support/engines.h"
#include "support/http_server.h"

namespace rd2h::connector {
namespace {

using namespace rd2h::testing;

constexpr int kLayers = 3;
constexpr uint64_t kBlocks = 16;
constexpr uint64_t kBlockSize = 16;  // tokens
const std::vector<uint64_t> kBytes = {512, 64, 128};

std::vector<KvCacheGroup> groups() {
  KvCacheGroup g{{}, kBlockSize};
  for (int l = 0; l < kLayers; ++l) g.layer_names.push_back(layer_name(l));
  return {g};
}

// Every rank's metadata arrives as bytes, as from a host's scheduler process.
ConnectorMetadata over_the_wire(const ConnectorMetadata& m) {
  auto back = decode_metadata(encode(m));
  EXPECT_TRUE(back) << back.status().to_string();
  return back ? *back : ConnectorMetadata{};
}

class Lifecycle : public ::testing::Test {
 protected:
  static constexpr int kPrefillTp = 4;
  static constexpr int kDecodeTp = 2;

  void SetUp() override {
    // Decode: a main pool shared by its ranks, an indexer per rank.
    main_pool_ = HostBuffer((kBytes[0] + kBytes[1]) * kBlocks * kLayers);
    std::mt19937 rng(std::random_device{}());
    for (int attempt = 0; attempt < 20 && decode_.size() < kDecodeTp; ++attempt) {
      decode_config_ = base_config(KvRole::kConsumer);
      decode_config_.kv_port = std::uniform_int_distribution<int>(20000, 60000)(rng);
      decode_.clear();
      for (int r = 0; r < kDecodeTp; ++r) {
        if (indexers_.size() <= static_cast<size_t>(r))
          indexers_.emplace_back(kBytes[2] * kBlocks * kLayers);
        auto w = ConnectorWorker::create(decode_config_, {kDecodeTp, 1, 1, 0}, r,
                                         shm_engine(transfer::Role::kDecode));
        ASSERT_TRUE(w) << w.status().to_string();
        if (!(*w)->register_kv_caches(decode_layers(r)).is_ok()) break;  // port taken: retry
        decode_.push_back(std::move(*w));
      }
    }
    ASSERT_EQ(decode_.size(), static_cast<size_t>(kDecodeTp));
    auto ds = Scheduler::create(decode_config_, {kDecodeTp, 1, 1, 0}, groups());
    ASSERT_TRUE(ds) << ds.status().to_string();
    decode_scheduler_ = std::move(*ds);

    prefill_config_ = base_config(KvRole::kProducer);
    for (int r = 0; r < kPrefillTp; ++r) {
      auto e = shm_engine(transfer::Role::kPrefill);
      auto region = e->allocate_memory((kBytes[0] + kBytes[1] + kBytes[2]) * kBlocks * kLayers);
      ASSERT_TRUE(region);
      prefill_kv_.push_back(static_cast<std::byte*>(region->addr));
      auto w = ConnectorWorker::create(prefill_config_, {kPrefillTp, 1, 1, 0}, r, e);
      ASSERT_TRUE(w);
      ASSERT_TRUE((*w)->register_kv_caches(prefill_layers(r), /*engine_allocated=*/true).is_ok());
      prefill_.push_back(std::move(*w));
    }
    auto ps = Scheduler::create(prefill_config_, {kPrefillTp, 1, 1, 0}, groups());
    ASSERT_TRUE(ps);
    prefill_scheduler_ = std::move(*ps);
  }

  ConnectorConfig base_config(KvRole role) {
    ConnectorConfig c;
    c.role = role;
    c.engine_id = role == KvRole::kConsumer ? "decode-0" : "prefill-0";
    c.kv_port = 1;
    c.prefill_tp_size = kPrefillTp;
    c.kv_arrival_timeout = 60s;
    return c;
  }
  uint64_t main_addr(int l, size_t t, int64_t b) const {
    return main_pool_.addr() + static_cast<uint64_t>(l) * (kBytes[0] + kBytes[1]) * kBlocks +
           (t == 0 ? 0 : kBytes[0] * kBlocks) + static_cast<uint64_t>(b) * kBytes[t];
  }
  uint64_t indexer_addr(int rank, int l, int64_t b) const {
    return indexers_[static_cast<size_t>(rank)].addr() +
           static_cast<uint64_t>(l) * kBytes[2] * kBlocks + static_cast<uint64_t>(b) * kBytes[2];
  }
  uint64_t prefill_addr(int rank, int l, size_t t, int64_t b) const {
    uint64_t off = static_cast<uint64_t>(l) * (kBytes[0] + kBytes[1] + kBytes[2]) * kBlocks;
    for (size_t k = 0; k < t; ++k) off += kBytes[k] * kBlocks;
    return reinterpret_cast<uint64_t>(prefill_kv_[static_cast<size_t>(rank)]) + off +
           static_cast<uint64_t>(b) * kBytes[t];
  }
  std::vector<layout::CacheLayer> decode_layers(int rank) const {
    std::vector<layout::CacheLayer> out;
    for (int l = 0; l < kLayers; ++l) {
      out.push_back({layer_name(l),
                     {{main_addr(l, 0, 0), kBytes[0] * kBlocks, kBytes[0]},
                      {main_addr(l, 1, 0), kBytes[1] * kBlocks, kBytes[1]},
                      {indexer_addr(rank, l, 0), kBytes[2] * kBlocks, kBytes[2]}},
                     2,
                     true});
    }
    return out;
  }
  std::vector<layout::CacheLayer> prefill_layers(int rank) const {
    std::vector<layout::CacheLayer> out;
    for (int l = 0; l < kLayers; ++l) {
      layout::CacheLayer layer{layer_name(l), {}, 2, true};
      for (size_t t = 0; t < 3; ++t) {
        layer.tensors.push_back({prefill_addr(rank, l, t, 0), kBytes[t] * kBlocks, kBytes[t]});
      }
      out.push_back(std::move(layer));
    }
    return out;
  }

  // One forward pass on every Prefill rank: bind the metadata, write and save each layer.
  void prefill_step(const ConnectorMetadata& meta) {
    std::vector<std::thread> ranks;
    std::vector<Status> results(prefill_.size());
    for (size_t r = 0; r < prefill_.size(); ++r) {
      ranks.emplace_back([&, r] {
        auto& w = *prefill_[r];
        Status st = w.bind_connector_metadata(over_the_wire(meta));
        for (int l = 0; l < kLayers && st.is_ok(); ++l) {
          for (size_t t = 0; t < 3; ++t) {
            for (uint64_t b = 0; b < kBlocks; ++b) {
              const auto block = static_cast<int64_t>(b);
              fill_pattern(reinterpret_cast<void*>(prefill_addr(static_cast<int>(r), l, t, block)),
                           kBytes[t], block_key(l, t, block));
            }
          }
          st = w.save_kv_layer(layer_name(l));
        }
        if (st.is_ok()) st = w.wait_for_save();
        w.clear_connector_metadata();
        results[r] = st;
      });
    }
    for (auto& t : ranks) t.join();
    for (size_t r = 0; r < results.size(); ++r) {
      EXPECT_TRUE(results[r].is_ok()) << "Prefill rank " << r << ": " << results[r].to_string();
    }
  }

  void decode_start(const ConnectorMetadata& meta) {
    for (auto& w : decode_) {
      ASSERT_TRUE(w->bind_connector_metadata(over_the_wire(meta)).is_ok());
      ASSERT_TRUE(w->start_load_kv().is_ok());
      w->clear_connector_metadata();
    }
  }

  // One get_finished round on every Decode rank; rank 0's answer.
  FinishedTransfers decode_finished() {
    std::vector<FinishedTransfers> out(decode_.size());
    std::vector<std::thread> ranks;
    for (size_t r = 0; r < decode_.size(); ++r) {
      ranks.emplace_back([&, r] {
        auto f = decode_[r]->get_finished(gather_.for_rank(static_cast<int>(r)));
        EXPECT_TRUE(f) << f.status().to_string();
        if (f) out[r] = *f;
      });
    }
    for (auto& t : ranks) t.join();
    return out[0];
  }

  HostBuffer main_pool_;
  std::vector<HostBuffer> indexers_;
  std::vector<std::byte*> prefill_kv_;
  ConnectorConfig decode_config_, prefill_config_;
  std::vector<std::unique_ptr<ConnectorWorker>> decode_, prefill_;
  std::unique_ptr<Scheduler> decode_scheduler_, prefill_scheduler_;
  ThreadAllGather gather_{kDecodeTp};
  MetaserverStub metaserver_{200};
};

TEST_F(Lifecycle, AChunkedRequestWithACachedPrefixGoesFromRendezvousToDecodeReady) {
  // Decode: 100 prompt tokens, the first 32 (two blocks) already cached locally.
  KvTransferParams to_decode;
  to_decode.do_remote_prefill = true;
  to_decode.metaserver = metaserver_.url();
  Request d{"cmpl-a-0-d0d0d0d0", 100, to_decode, {}};
  ASSERT_EQ(decode_scheduler_->get_num_new_matched_tokens(d, 32).tokens, 68u);
  const std::vector<int64_t> d_blocks = {9, 3, 14, 0, 7, 11, 5};
  ASSERT_TRUE(decode_scheduler_->update_state_after_alloc(d, {d_blocks}, 68).is_ok());
  auto dmeta = testing::built(*decode_scheduler_, {});
  ASSERT_TRUE(dmeta);
  decode_start(*dmeta);

  // The proxy hands Decode's rendezvous to Prefill.
  ASSERT_TRUE(eventually([&] { return metaserver_.bodies().size() == 1; }));
  auto to_prefill = KvTransferParams::from_json(metaserver_.bodies()[0]);
  ASSERT_TRUE(to_prefill) << to_prefill.status().to_string();
  EXPECT_EQ(to_prefill->remote_cached_tokens, 32u);
  Request p{"cmpl-a-0-p1p1p1p1", 100, *to_prefill, {}};  // Prefill names it its own way
  const std::vector<int64_t> p_blocks = {2, 6, 1, 12, 8, 15, 4};
  ASSERT_TRUE(prefill_scheduler_->update_state_after_alloc(p, {{2, 6, 1, 12}}, 0).is_ok());

  auto chunk1 = testing::built(*prefill_scheduler_, {{p.request_id, {}, 64}});
  ASSERT_TRUE(chunk1);
  prefill_step(*chunk1);
  EXPECT_TRUE(decode_finished().recving.empty()) << "ready before the final chunk";
  auto chunk2 = testing::built(*prefill_scheduler_, {{p.request_id, {{8, 15, 4}}, 100}});
  ASSERT_TRUE(chunk2);
  prefill_step(*chunk2);

  FinishedTransfers done;
  ASSERT_TRUE(eventually([&] {
    done = decode_finished();
    return !done.recving.empty();
  }));
  EXPECT_EQ(done.recving, std::vector<std::string>{"cmpl-a-0-d0d0d0d0"});
  for (auto& w : decode_) EXPECT_TRUE(w->get_block_ids_with_load_errors().empty());
  // Blocks 2..6 came from Prefill into Decode's blocks 2..6; the cached prefix was not
  // touched.
  for (int l = 0; l < kLayers; ++l) {
    for (size_t i = 0; i < d_blocks.size(); ++i) {
      const bool sent = i >= 2;
      for (size_t t = 0; t < 2; ++t) {
        const bool holds =
            !find_pattern_mismatch(reinterpret_cast<const void*>(main_addr(l, t, d_blocks[i])),
                                   kBytes[t], block_key(l, t, p_blocks[i]));
        EXPECT_EQ(holds, sent) << "layer " << l << " tensor " << t << " block " << i;
      }
      for (int r = 0; r < kDecodeTp; ++r) {
        const bool holds =
            !find_pattern_mismatch(reinterpret_cast<const void*>(indexer_addr(r, l, d_blocks[i])),
                                   kBytes[2], block_key(l, 2, p_blocks[i]));
        EXPECT_EQ(holds, sent) << "layer " << l << " indexer on rank " << r << " block " << i;
      }
    }
  }
  (void)decode_scheduler_->request_finished(d);
  (void)prefill_scheduler_->request_finished(p);
  EXPECT_EQ(testing::SchedulerAccess::tracked(*decode_scheduler_), 0u);
  EXPECT_EQ(testing::SchedulerAccess::tracked(*prefill_scheduler_), 0u);
}

TEST_F(Lifecycle, WithoutLayerwiseEveryLayerIsPublishedInWaitForSave) {
  ConnectorConfig at_end = prefill_config_;
  at_end.use_layerwise = false;
  for (size_t r = 0; r < prefill_.size(); ++r) {
    auto engine = testing::WorkerAccess::engine(*prefill_[r]);
    prefill_[r].reset();
    auto w = ConnectorWorker::create(at_end, {kPrefillTp, 1, 1, 0}, static_cast<int>(r), engine);
    ASSERT_TRUE(w);
    ASSERT_TRUE((*w)->register_kv_caches(prefill_layers(static_cast<int>(r)), true).is_ok());
    prefill_[r] = std::move(*w);
  }
  ConnectorMetadata d;
  d.load.push_back({"cmpl-c-0", "cmpl-c-0-d0d0d0d0", {1, 2}, {1, 2}});
  decode_start(d);
  ConnectorMetadata p;
  p.save.push_back({"cmpl-c-0",
                    "127.0.0.1",
                    decode_scheduler_->base_port(),
                    kDecodeTp,
                    {3, 4},
                    {3, 4},
                    0,
                    0,
                    true,
                    {}});
  auto& w0 = *prefill_[0];
  ASSERT_TRUE(w0.bind_connector_metadata(p).is_ok());
  for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(w0.save_kv_layer(layer_name(l)).is_ok());
  EXPECT_EQ(testing::WorkerAccess::prefill(w0)->stats().readiness_queued, 0u)
      << "published before wait_for_save";
  ASSERT_TRUE(w0.wait_for_save().is_ok());
  EXPECT_EQ(testing::WorkerAccess::prefill(w0)->stats().readiness_queued,
            static_cast<uint64_t>(kLayers));

  // Layers sharing a buffer cannot wait until the end of the pass.
  auto shared = ConnectorWorker::create(at_end, {kPrefillTp, 1, 1, 0}, 0,
                                        testing::WorkerAccess::engine(*prefill_[0]));
  ASSERT_TRUE(shared);
  auto layers = prefill_layers(0);
  layers[2].tensors = layers[0].tensors;
  Status st = (*shared)->register_kv_caches(layers, true);
  EXPECT_NE(st.message().find("needs one buffer per layer"), std::string::npos) << st.to_string();
}

TEST_F(Lifecycle, KvThatNeverArrivesFailsTheRequestAfterItsDeadlineAndReportsItsBlocks) {
  for (auto& w : decode_) w.reset();
  decode_.clear();
  // Rebuild Decode with a short arrival deadline; no Prefill will ever publish.
  decode_config_.kv_arrival_timeout = 200ms;
  for (int r = 0; r < kDecodeTp; ++r) {
    auto w = ConnectorWorker::create(decode_config_, {kDecodeTp, 1, 1, 0}, r,
                                     shm_engine(transfer::Role::kDecode));
    ASSERT_TRUE(w);
    ASSERT_TRUE((*w)->register_kv_caches(decode_layers(r)).is_ok());
    decode_.push_back(std::move(*w));
  }
  ConnectorMetadata meta;
  meta.load.push_back({"cmpl-b-0", "cmpl-b-0-d0d0d0d0", {4, 5}, {4, 5}});
  decode_start(meta);
  FinishedTransfers done;
  ASSERT_TRUE(eventually([&] {
    done = decode_finished();
    return !done.recving.empty();
  }));
  EXPECT_EQ(done.recving, std::vector<std::string>{"cmpl-b-0-d0d0d0d0"});
  auto errors = decode_[0]->get_block_ids_with_load_errors();
  std::sort(errors.begin(), errors.end());
  errors.erase(std::unique(errors.begin(), errors.end()), errors.end());
  EXPECT_EQ(errors, (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(testing::WorkerAccess::decode(*decode_[0])->reader().tracked_requests(), 0u)
      << "its state outlived it";
}

}  // namespace
}  // namespace rd2h::connector
