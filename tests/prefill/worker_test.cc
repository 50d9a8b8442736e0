// The Prefill worker on its own and against one Decode worker: registration, MF_META, step
// validation and the write event that gates publishing a layer.
#include "prefill/worker.h"

#include <gtest/gtest.h>

#include "e2e/pd_cluster.h"
#include "support/engines.h"

namespace rd2h::prefill {
namespace {

using namespace rd2h::testing;

// Three layers given out of order; layers 0 and 2 share one physical slot.
std::vector<layout::CacheLayer> layers(const HostBuffer& kv) {
  auto layer = [&](int index, uint64_t offset) {
    layout::CacheLayer l{layer_name(index), {}, 2, true};
    for (uint64_t t = 0; t < 3; ++t)
      l.tensors.push_back({kv.addr() + offset + t * 4096, 4096, 256});
    return l;
  };
  return {layer(2, 0), layer(1, 3 * 4096), layer(0, 0)};
}

TEST(PrefillWorker, PublishesItsLayersInOrderWithVersionsAndRegistersMergedRegions) {
  HostBuffer kv(6 * 4096);
  auto e = shm_engine();
  auto w = Worker::create({}, e, control::Context::create(), layers(kv));
  ASSERT_TRUE(w) << w.status().to_string();
  const auto& meta = (*w)->mf_meta();
  ASSERT_EQ(meta.layers.size(), 3u);
  for (int l = 0; l < 3; ++l) EXPECT_EQ(meta.layers[static_cast<size_t>(l)].first, layer_name(l));
  EXPECT_EQ(meta.protocol_version, protocol::kProtocolVersion);
  EXPECT_EQ(meta.cache_layout_version, protocol::kCacheLayoutVersion);
  EXPECT_EQ(meta.backend_name, "ucx");
  EXPECT_EQ(meta.p_session, e->session_id());
  EXPECT_EQ((*w)->slots().main_slot_count(), 2u) << "layers 0 and 2 share a slot";
  // One merged region: registering any part of it again overlaps.
  EXPECT_EQ(e->register_memory(kv.data() + 5 * 4096, 4096).code(), StatusCode::kAlreadyExists);
  w->reset();
  EXPECT_TRUE(e->register_memory(kv.data(), 6 * 4096).is_ok()) << "the worker unregistered it";
}

TEST(PrefillWorker, BadLayersAreRefusedByName) {
  HostBuffer kv(6 * 4096);
  auto bad_name = layers(kv);
  bad_name[1].name = "model.final_norm";
  auto w = Worker::create({}, shm_engine(), control::Context::create(), bad_name);
  ASSERT_FALSE(w);
  EXPECT_NE(w.status().message().find("model.final_norm"), std::string::npos);
  auto twice = layers(kv);
  twice[1].name = twice[0].name;
  w = Worker::create({}, shm_engine(), control::Context::create(), twice);
  ASSERT_FALSE(w);
  EXPECT_NE(w.status().message().find("same layer index 2"), std::string::npos)
      << w.status().message();
  WorkerConfig outside;
  outside.p_rank = 4;
  outside.p_tp = 4;
  w = Worker::create(outside, shm_engine(), control::Context::create(), layers(kv));
  ASSERT_FALSE(w);
  EXPECT_NE(w.status().message().find("rank 4"), std::string::npos) << w.status().message();
}

TEST(PrefillWorker, AWaitOnALayerThatWasNeverRegisteredIsAnErrorNotAnInstantSuccess) {
  HostBuffer kv(6 * 4096);
  auto w = Worker::create({}, shm_engine(), control::Context::create(), layers(kv));
  ASSERT_TRUE(w) << w.status().to_string();
  EXPECT_TRUE((*w)->wait_for_layer_reuse(2).is_ok()) << "nothing was sent: its slot is free";
  const Status st = (*w)->wait_for_layer_reuse(3);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("layer index 3 was never registered (3 layers were, 0 to 2)"),
            std::string::npos)
      << st.message();
}

TEST(PrefillWorker, AStepThatCannotBePublishedIsRefusedNamingTheRequest) {
  HostBuffer kv(6 * 4096);
  WorkerConfig config;
  config.p_rank = 1;
  config.p_tp = 2;
  config.raise_on_peer_failure = true;
  auto w = Worker::create(config, shm_engine(), control::Context::create(), layers(kv));
  ASSERT_TRUE(w);
  struct Case {
    const char* what;
    SendRequest request;
    const char* reason;
  };
  const std::vector<Case> cases = {
      {"block past the cache",
       {"r1", "127.0.0.1", 9000, 1, {0, 16}, {0}, 0, 0, false, {}},
       "main block 16 is outside the 16 blocks"},
      {"negative indexer block",
       {"r2", "127.0.0.1", 9000, 1, {0}, {-1}, 0, 0, false, {}},
       "indexer block -1"},
      {"Decode TP above Prefill TP", {"r3", "127.0.0.1", 9000, 4, {0}, {0}, 0, 0, false, {}}, "4"},
      {"port past 65535", {"r4", "127.0.0.1", 65535, 2, {0}, {0}, 0, 0, false, {}}, "65536"},
      {"negative offset", {"r5", "127.0.0.1", 9000, 1, {0}, {0}, -1, 0, false, {}}, "offset"},
  };
  for (const auto& c : cases) {
    Status st = (*w)->bind_step({c.request});
    ASSERT_FALSE(st.is_ok()) << c.what;
    EXPECT_NE(st.message().find(c.request.ext_id), std::string::npos)
        << c.what << ": " << st.message();
    EXPECT_NE(st.message().find(c.reason), std::string::npos) << c.what << ": " << st.message();
  }
  SendRequest r{"dup", "127.0.0.1", 9000, 1, {0}, {0}, 0, 0, false, {}};
  EXPECT_FALSE((*w)->bind_step({r, r}).is_ok()) << "one request twice in a step";
  EXPECT_EQ((*w)->save_kv_layer("model.layers.9.self_attn").code(), StatusCode::kNotFound);
}

TEST(PrefillWorker, ARequestThatCannotBeSentFailsAloneAndTheStepGoesOn) {
  HostBuffer kv(6 * 4096);
  WorkerConfig config;  // the default: a Decode's failure fails its requests only
  config.p_rank = 1;
  config.p_tp = 2;
  auto w = Worker::create(config, shm_engine(), control::Context::create(), layers(kv));
  ASSERT_TRUE(w);
  const SendRequest bad{"bad", "127.0.0.1", 65535, 2, {0}, {0}, 0, 0, true, {}};  // port 65536
  ASSERT_TRUE((*w)->bind_step({bad}).is_ok());
  EXPECT_EQ((*w)->stats().peer_failures, 1u);
  ASSERT_TRUE((*w)->save_kv_layer(layers(kv)[0].name).is_ok());
  EXPECT_EQ((*w)->stats().readiness_queued, 0u) << "a readiness went out for the refused request";
  SendRequest dup{"dup", "127.0.0.1", 9000, 1, {0}, {0}, 0, 0, false, {}};
  EXPECT_FALSE((*w)->bind_step({dup, dup}).is_ok()) << "a scheduler's error stays an error";
}

TEST(PrefillWorker, ALayerIsPublishedOnlyAfterItsWriteEventCompletes) {
  ClusterShape shape;
  shape.send_timeout = 1s;  // the first wait below is meant to run out
  Cluster c(shape);
  const PdRequest r{"r", 0, {1, 2}, {3, 4}, {5, 6}, {7, 8}};
  c.expect_request(r);
  auto& w = *c.prefill(0).worker;
  ASSERT_TRUE(
      w.bind_step({{"r", "127.0.0.1", c.decode().kv_port, 1, r.p_main, r.p_indexer, 0, 0, true, {}}})
          .is_ok());
  auto event = std::make_shared<HostWriteEvent>();
  ASSERT_TRUE(w.save_kv_layer(layer_name(0), event).is_ok());
  EXPECT_EQ(w.wait_for_layer_send(layer_name(0)).code(), StatusCode::kTimeout)
      << "a layer was answered before its write completed";
  EXPECT_EQ(c.decode_rank(0, 0).worker->reader().stats().layers_done, 0u);
  EXPECT_EQ(w.stats().sender.readiness_sent, 0u);
  event->complete();
  EXPECT_TRUE(w.wait_for_layer_send(layer_name(0)).is_ok());
  EXPECT_EQ(w.stats().sender.readiness_sent, 1u);

  // A write that failed is not published, and the compute path hears why.
  auto failed = std::make_shared<HostWriteEvent>();
  failed->complete(internal_error("device fault"));
  ASSERT_TRUE(w.save_kv_layer(layer_name(1), failed).is_ok());
  Status st = w.wait_for_layer_send(layer_name(1));
  EXPECT_NE(st.message().find("layer 1 was not published: device fault"), std::string::npos)
      << st.to_string();
  EXPECT_EQ(w.stats().sender.readiness_sent, 1u);
}

}  // namespace
}  // namespace rd2h::prefill

namespace rd2h::prefill {
namespace {

TEST(PrefillWorker, AStepRaisesOnceAndItsLeftoverFailuresDoNotFailTheNextStep) {
  ClusterShape shape;
  shape.layers = 4;
  shape.prefill_slots = 2;  // layers 0 and 2 share a slot, as do 1 and 3
  Cluster c(shape);
  const PdRequest bad{"bad", 0, {0, 1}, {0, 1}, {0, 1}, {0, 1}};
  c.expect_request(bad);
  c.decode_rank(0, 0).engine->fail_next_reads(100, transport_error("injected"));
  const auto failed = c.run_step({{&bad, {0, 2}, true}});
  ASSERT_FALSE(failed[0].is_ok()) << "the step did not raise";
  EXPECT_NE(failed[0].message().find("injected"), std::string::npos) << failed[0].message();

  // Layers 1 (and maybe more) of the failed step also failed, unseen: they must not fail
  // the next step, which reuses their slots.
  c.decode_rank(0, 0).engine->fail_next_reads(0, Status::ok());
  const PdRequest good{"good", 0, {4, 5}, {4, 5}, {4, 5}, {4, 5}};
  c.expect_request(good);
  const auto next = c.run_step({{&good, {0, 2}, true}});
  EXPECT_TRUE(next[0].is_ok()) << next[0].to_string();
  // Decode reports (through its reader's lock) before its bytes are checked; "good"
  // completes when Prefill's commit arrives, which may be after its step returned.
  auto done = c.ended(0, 2);
  ASSERT_TRUE(done) << done.status().to_string();
  EXPECT_EQ(done->failed, std::vector<std::string>{"internal-bad"});
  EXPECT_EQ(done->finished, std::vector<std::string>{"internal-good"});
  for (int l = 0; l < shape.layers; ++l) EXPECT_TRUE(c.holds(good, l)) << "layer " << l;
}

}  // namespace
}  // namespace rd2h::prefill
