// The scheduler half of the connector on both roles, Decode's rendezvous over real HTTP.
#include "rd2h/connector/scheduler.h"

#include <gtest/gtest.h>

#include "connector/test_access.h"
#include "support/http_server.h"

namespace rd2h::connector {
namespace {

using rd2h::testing::eventually;
using rd2h::testing::MetaserverStub;

const std::string kMain = "model.layers.0.self_attn";
const std::string kIndexer = "model.layers.0.self_attn.indexer";

ConnectorConfig config(KvRole role) {
  ConnectorConfig c;
  c.role = role;
  c.kv_port = 30000;
  c.engine_id = role == KvRole::kConsumer ? "decode-0" : "prefill-0";
  c.host = "10.0.0.2";
  return c;
}

TEST(GroupRoles, FoundFromLayerNamesNotFromGroupOrder) {
  auto split = find_group_roles({{{kIndexer}, 64}, {{kMain}, 128}});
  ASSERT_TRUE(split);
  EXPECT_EQ(split->main, 1u);
  EXPECT_EQ(split->indexer, 0u);
  auto uniform = find_group_roles({{{kMain, kIndexer}, 128}});
  ASSERT_TRUE(uniform);
  EXPECT_EQ(uniform->main, 0u);
  EXPECT_EQ(uniform->indexer, 0u);
  EXPECT_FALSE(find_group_roles({{{kMain}, 0}})) << "block size 0";
}

TEST(GroupRoles, IndexerLayersAreFoundInAnyCase) {
  auto split = find_group_roles({{{kMain}, 128}, {{"model.layers.0.self_attn.INDEXER"}, 64}});
  ASSERT_TRUE(split);
  EXPECT_EQ(split->main, 0u);
  EXPECT_EQ(split->indexer, 1u) << "the upper-case indexer group was taken for main KV";
  EXPECT_TRUE(is_indexer_layer("model.layers.3.Indexer.k_cache"));
  EXPECT_FALSE(is_indexer_layer("model.layers.3.self_attn"));
}

TEST(GroupRoles, OnlyIndexerGroupsOrNoGroupsAreRefusedNamingTheProblem) {
  auto only_indexer = find_group_roles({{{kIndexer}, 64}});
  ASSERT_FALSE(only_indexer);
  EXPECT_NE(only_indexer.status().message().find(
                "group 0 holds indexer layers, but no group holds a main attention layer"),
            std::string::npos)
      << only_indexer.status().to_string();
  auto none = find_group_roles({});
  ASSERT_FALSE(none);
  EXPECT_NE(none.status().message().find("no KV-cache groups"), std::string::npos)
      << none.status().to_string();
  EXPECT_FALSE(Scheduler::create(config(KvRole::kConsumer), {}, {{{kIndexer}, 64}}))
      << "a scheduler over indexer layers only";
}

TEST(DecodeScheduler, MatchesAllocatesAndPostsTheRendezvousOnce) {
  MetaserverStub meta(200);
  auto s = Scheduler::create(config(KvRole::kConsumer), Parallel{2, 1, 1, 1},
                             {{{kIndexer}, 128}, {{kMain}, 128}});
  ASSERT_TRUE(s) << s.status().to_string();
  EXPECT_EQ((*s)->base_port(), 30002) << "kv_port + global_dp_rank * tp_size";
  KvTransferParams p;
  p.do_remote_prefill = true;
  p.metaserver = meta.url();
  Request r{"cmpl-x-0-abcdefgh", 300, p, {}};
  const auto matched = (*s)->get_num_new_matched_tokens(r, 128);
  EXPECT_EQ(matched.tokens, 172u);
  EXPECT_TRUE(matched.load_async);
  ASSERT_TRUE((*s)->update_state_after_alloc(r, {{20, 21, 22}, {1, 2, 3}}, 172).is_ok());
  EXPECT_FALSE(r.params->do_remote_prefill) << "do_remote_prefill stays set";
  EXPECT_EQ((*s)->get_num_new_matched_tokens(r, 128).tokens, 0u);

  ASSERT_TRUE(eventually([&] { return meta.bodies().size() == 1; }));
  EXPECT_EQ(meta.bodies()[0],
            R"({"request_id":"cmpl-x-0","do_remote_prefill":false,"do_remote_decode":true,)"
            R"("remote_engine_id":"decode-0","remote_host":"10.0.0.2","remote_port":30002,)"
            R"("remote_tp_size":2,"remote_pcp_size":1,"remote_dcp_size":1,)"
            R"("remote_cached_tokens":128})");
  EXPECT_EQ(meta.bodies()[0].find("[1,2,3]"), std::string::npos) << "block ids left Decode";

  auto m = testing::built(**s, {});
  ASSERT_TRUE(m);
  ASSERT_EQ(m->load.size(), 1u);
  EXPECT_EQ(m->load[0].ext_id, "cmpl-x-0");
  EXPECT_EQ(m->load[0].internal_id, "cmpl-x-0-abcdefgh");
  EXPECT_EQ(m->load[0].main_blocks, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(m->load[0].indexer_blocks, (std::vector<int64_t>{20, 21, 22}));
  EXPECT_TRUE(testing::built(**s, {})->empty()) << "a load is handed out once";

  (void)(*s)->request_finished(r);
  EXPECT_EQ(testing::built(**s, {})->abort, std::vector<std::string>{"cmpl-x-0"});
  EXPECT_EQ(testing::SchedulerAccess::tracked(**s), 0u);
}

// A Decode bound on a wildcard address tells Prefill the address it advertises.
TEST(DecodeScheduler, TheRendezvousNamesTheAdvertisedAddress) {
  MetaserverStub meta(200);
  ConnectorConfig c = config(KvRole::kConsumer);
  c.host = "0.0.0.0";
  c.advertise_host = "10.9.8.7";
  auto s = Scheduler::create(c, Parallel{1, 1, 1, 1}, {{{kMain}, 128}});
  ASSERT_TRUE(s) << s.status().to_string();
  KvTransferParams p;
  p.do_remote_prefill = true;
  p.metaserver = meta.url();
  Request r{"cmpl-y-0-abcdefgh", 300, p, {}};
  const auto matched = (*s)->get_num_new_matched_tokens(r, 0);
  ASSERT_TRUE(matched.load_async);
  ASSERT_TRUE((*s)->update_state_after_alloc(r, {{1, 2, 3}}, matched.tokens).is_ok());
  ASSERT_TRUE(eventually([&] { return meta.bodies().size() == 1; }));
  EXPECT_NE(meta.bodies()[0].find(R"("remote_host":"10.9.8.7")"), std::string::npos)
      << meta.bodies()[0];
}

TEST(DecodeScheduler, RequestsWithoutRemotePrefillAreLeftAlone) {
  auto s = Scheduler::create(config(KvRole::kConsumer), {}, {{{kMain}, 128}});
  ASSERT_TRUE(s);
  Request plain{"r-abcdefgh", 100, std::nullopt, {}};
  EXPECT_EQ((*s)->get_num_new_matched_tokens(plain, 0).tokens, 0u);
  EXPECT_TRUE((*s)->update_state_after_alloc(plain, {{1}}, 0).is_ok());
  EXPECT_TRUE(testing::built(**s, {})->empty());
}

TEST(DecodeScheduler, WithoutAMetaserverOrWhenVirtualNothingIsPostedButTheRequestIsTracked) {
  auto s = Scheduler::create(config(KvRole::kConsumer), {}, {{{kMain}, 128}});
  ASSERT_TRUE(s);
  const auto* client = testing::SchedulerAccess::metaserver(**s);
  // A metaserver nobody listens on: a post to it stays pending (retried) until cancelled.
  const std::string nowhere = "http://127.0.0.1:1/v1/metaserver";
  KvTransferParams none;
  none.do_remote_prefill = true;
  KvTransferParams virt = none;
  virt.metaserver = nowhere;
  virt.is_virtual = true;
  KvTransferParams posted = none;
  posted.metaserver = nowhere;
  Request a{"a-abcdefgh", 100, none, {}}, b{"b-abcdefgh", 100, virt, {}},
      c{"c-abcdefgh", 100, posted, {}};
  for (Request* r : {&a, &b, &c}) {
    ASSERT_TRUE((*s)->update_state_after_alloc(*r, {{1, 2}}, 100).is_ok()) << r->request_id;
    EXPECT_FALSE(r->params->do_remote_prefill) << r->request_id;
  }
  EXPECT_FALSE(client->pending("a")) << "posted without a metaserver";
  EXPECT_FALSE(client->pending("b")) << "a virtual request was posted";
  EXPECT_TRUE(client->pending("c")) << "the control request was not posted";
  auto m = testing::built(**s, {});
  ASSERT_TRUE(m);
  ASSERT_EQ(m->load.size(), 3u) << "every request is still expected";
  EXPECT_EQ(testing::SchedulerAccess::tracked(**s), 3u);
  for (Request* r : {&a, &b, &c}) (void)(*s)->request_finished(*r);
  EXPECT_EQ(testing::SchedulerAccess::tracked(**s), 0u);
}

KvTransferParams from_decode(uint64_t cached) {
  KvTransferParams p;
  p.do_remote_decode = true;
  p.request_id = "cmpl-x-0";
  p.remote_host = "10.0.0.2";
  p.remote_port = 30002;
  p.remote_tp_size = 2;
  p.remote_cached_tokens = cached;
  return p;
}

TEST(PrefillScheduler, EachChunkPublishesItsNewlyCompleteBlocksAndTheLastItsPartialBlock) {
  auto s = Scheduler::create(config(KvRole::kProducer), {4, 1, 1, 0}, {{{kMain, kIndexer}, 16}});
  ASSERT_TRUE(s);
  // 100 prompt tokens, of which Decode caches 32 (2 blocks); chunks of 64 and 36 tokens.
  Request r{"cmpl-x-0-abcdefgh", 100, from_decode(32), {}};
  EXPECT_EQ((*s)->get_num_new_matched_tokens(r, 0).tokens, 0u);
  ASSERT_TRUE((*s)->update_state_after_alloc(r, {{10, 11, 12, 13}}, 0).is_ok());
  auto first = testing::built(**s, {{r.request_id, {}, 64}});
  ASSERT_TRUE(first) << first.status().to_string();
  ASSERT_EQ(first->save.size(), 1u);
  const auto& a = first->save[0];
  EXPECT_EQ(a.ext_id, "cmpl-x-0");
  EXPECT_EQ(a.d_host, "10.0.0.2");
  EXPECT_EQ(a.d_base_port, 30002);
  EXPECT_EQ(a.d_tp, 2);
  EXPECT_EQ(a.main_block_ids, (std::vector<int64_t>{12, 13}));
  EXPECT_EQ(a.indexer_block_ids, (std::vector<int64_t>{12, 13}));
  EXPECT_EQ(a.main_start, 2);
  EXPECT_FALSE(a.final_chunk);

  auto last = testing::built(**s, {{r.request_id, {{14, 15, 16}}, 100}});
  ASSERT_TRUE(last);
  ASSERT_EQ(last->save.size(), 1u);
  EXPECT_EQ(last->save[0].main_block_ids, (std::vector<int64_t>{14, 15, 16}));
  EXPECT_EQ(last->save[0].main_start, 4);
  EXPECT_TRUE(last->save[0].final_chunk);
  (void)(*s)->request_finished(r);
  EXPECT_EQ(testing::SchedulerAccess::tracked(**s), 0u);
}

TEST(PrefillScheduler, ARequestIsForgottenOnceItsLastChunkIsPublished) {
  auto s = Scheduler::create(config(KvRole::kProducer), {}, {{{kMain, kIndexer}, 16}});
  ASSERT_TRUE(s);
  Request r{"cmpl-x-0-abcdefgh", 40, from_decode(0), {}};
  ASSERT_TRUE((*s)->update_state_after_alloc(r, {{10, 11, 12}}, 0).is_ok());
  auto last = testing::built(**s, {{r.request_id, {}, 40}});
  ASSERT_TRUE(last);
  ASSERT_EQ(last->save.size(), 1u);
  EXPECT_TRUE(last->save[0].final_chunk);
  EXPECT_EQ(testing::SchedulerAccess::tracked(**s), 0u);
  // A later step of the same request (its first decode step) publishes nothing.
  auto later = testing::built(**s, {{r.request_id, {{13}}, 41}});
  ASSERT_TRUE(later);
  EXPECT_TRUE(later->save.empty()) << "the last partial block was sent again";
}

TEST(PrefillScheduler, ADecodeEndpointWithoutHostOrPortHasNothingToSend) {
  auto s = Scheduler::create(config(KvRole::kProducer), {}, {{{kMain}, 16}});
  ASSERT_TRUE(s);
  auto no_port = from_decode(0);
  no_port.remote_port = 0;
  auto no_host = from_decode(0);
  no_host.remote_host.clear();
  Request a{"a-abcdefgh", 16, no_port, {}}, b{"b-abcdefgh", 16, no_host, {}};
  ASSERT_TRUE((*s)->update_state_after_alloc(a, {{1}}, 0).is_ok());
  ASSERT_TRUE((*s)->update_state_after_alloc(b, {{2}}, 0).is_ok());
  EXPECT_EQ(testing::SchedulerAccess::tracked(**s), 0u);
  auto m = testing::built(**s, {{a.request_id, {}, 16}, {b.request_id, {}, 16}});
  ASSERT_TRUE(m);
  EXPECT_TRUE(m->save.empty()) << "a readiness would go nowhere";
}

TEST(PrefillScheduler, AResumedRequestPublishesFromItsNewBlocks) {
  // Preempted after its first chunk was published, the request is recomputed into new
  // blocks; what Decode holds stays, the rest comes from the new list.
  auto s = Scheduler::create(config(KvRole::kProducer), {4, 1, 1, 0}, {{{kMain, kIndexer}, 16}});
  ASSERT_TRUE(s);
  Request r{"cmpl-x-0-abcdefgh", 64, from_decode(0), {}};
  ASSERT_TRUE((*s)->update_state_after_alloc(r, {{10, 11}}, 0).is_ok());
  auto first = testing::built(**s, {{r.request_id, {}, 32}});
  ASSERT_TRUE(first);
  ASSERT_EQ(first->save.size(), 1u);
  EXPECT_EQ(first->save[0].main_block_ids, (std::vector<int64_t>{10, 11}));
  auto resumed = testing::built(**s, {{r.request_id, {{20, 21, 22, 23}}, 64, true}});
  ASSERT_TRUE(resumed) << resumed.status().to_string();
  ASSERT_EQ(resumed->save.size(), 1u);
  EXPECT_EQ(resumed->save[0].main_block_ids, (std::vector<int64_t>{22, 23}));
  EXPECT_EQ(resumed->save[0].main_start, 2);
  EXPECT_TRUE(resumed->save[0].final_chunk);
}

TEST(PrefillScheduler, SeparateIndexerGroupsSliceByTheirOwnBlockSize) {
  auto s = Scheduler::create(config(KvRole::kProducer), {}, {{{kIndexer}, 32}, {{kMain}, 16}});
  ASSERT_TRUE(s);
  Request r{"cmpl-x-0-abcdefgh", 40, from_decode(0), {}};
  ASSERT_TRUE((*s)->update_state_after_alloc(r, {{7, 8}, {1, 2, 3}}, 0).is_ok());
  auto m = testing::built(**s, {{r.request_id, {}, 40}});
  ASSERT_TRUE(m);
  ASSERT_EQ(m->save.size(), 1u);
  EXPECT_EQ(m->save[0].main_block_ids, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(m->save[0].indexer_block_ids, (std::vector<int64_t>{7, 8}));
}

TEST(PrefillScheduler, APromptListChildIsFoundAndAMissingOneIsNamed) {
  auto s = Scheduler::create(config(KvRole::kProducer), {}, {{{kMain}, 16}});
  ASSERT_TRUE(s);
  KvTransferParams list = from_decode(0);
  auto child = from_decode(0);
  child.request_id = "cmpl-p-1";
  child.remote_port = 40000;
  list.batch = {{"cmpl-p-0", from_decode(0)}, {"cmpl-p-1", child}};
  Request second{"cmpl-p-1-abcdefgh", 16, list, {}};
  ASSERT_TRUE((*s)->update_state_after_alloc(second, {{5}}, 0).is_ok());
  auto m = testing::built(**s, {{second.request_id, {}, 16}});
  ASSERT_TRUE(m);
  ASSERT_EQ(m->save.size(), 1u);
  EXPECT_EQ(m->save[0].d_base_port, 40000) << "the child's own Decode endpoint";
  Request third{"cmpl-p-2-abcdefgh", 16, list, {}};
  Status st = (*s)->update_state_after_alloc(third, {{6}}, 0);
  EXPECT_NE(st.message().find("cmpl-p-2"), std::string::npos) << st.to_string();
}

}  // namespace
}  // namespace rd2h::connector
