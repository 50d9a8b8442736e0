#include "decode/completion_tracker.h"

#include <gtest/gtest.h>

namespace rd2h::decode {
namespace {

// The TP group as seen by one rank: the other ranks' terminal sets are fixed by the test.
AllGather group_with(std::vector<RankTerminal> others) {
  return [others](const RankTerminal& mine) -> Expected<std::vector<RankTerminal>> {
    std::vector<RankTerminal> all{mine};
    all.insert(all.end(), others.begin(), others.end());
    return all;
  };
}

const AllGather kAlone = group_with({});

// What the reader's get_finished does: every rank's terminal states gathered, then finished.
Expected<Finished> finished_of(CompletionTracker& t, const AllGather& all_gather) {
  auto ranks = all_gather(t.terminal(std::chrono::steady_clock::now()));
  if (!ranks) return ranks.status();
  return t.finish(*ranks);
}

TEST(CompletionTracker, CompletesAfterEveryContributorReportsTheFinalLayer) {
  CompletionTracker t;
  ASSERT_TRUE(t.add_request("ext-1", "int-1").is_ok());
  for (int member : {0, 2, 3}) {
    ASSERT_TRUE(t.on_final_layer("ext-1", member, 4).is_ok());
    EXPECT_TRUE(finished_of(t, kAlone)->finished.empty()) << "after member " << member;
  }
  ASSERT_TRUE(t.on_final_layer("ext-1", 1, 4).is_ok());
  auto done = finished_of(t, kAlone);
  ASSERT_TRUE(done);
  EXPECT_EQ(done->finished, std::vector<std::string>{"int-1"});
  EXPECT_TRUE(done->failed.empty());
  EXPECT_EQ(t.tracked(), 0u) << "state is freed once reported";
}

TEST(CompletionTracker, OwnsARequestsDestinationsAndGivesItUpAtItsArrivalDeadline) {
  CompletionTracker t;
  const auto now = std::chrono::steady_clock::now();
  ASSERT_TRUE(t.add_request("late", "i-late", {{1, 2}, {3}, now}).is_ok());
  ASSERT_TRUE(t.add_request("timely", "i-timely", {{4}, {5}, now + std::chrono::hours(1)}).is_ok());
  ASSERT_NE(t.destinations("late"), nullptr);
  EXPECT_EQ(t.destinations("late")->main, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(t.destinations("unknown"), nullptr);
  const Finished ended = t.finish({t.terminal(now)});
  EXPECT_EQ(ended.failed, std::vector<std::string>{"i-late"});
  EXPECT_TRUE(ended.finished.empty()) << "the request with time left ended too";
  EXPECT_EQ(ended.invalid_main_blocks, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(ended.invalid_indexer_blocks, std::vector<int64_t>{3});
  EXPECT_EQ(ended.ended_ext_ids, std::vector<std::string>{"late"});
  EXPECT_EQ(t.destinations("late"), nullptr) << "an ended request's state stays";
  EXPECT_EQ(t.remove_request("timely"), std::optional<std::string>("i-timely"));
  EXPECT_EQ(t.remove_request("timely"), std::nullopt);
  EXPECT_EQ(t.tracked(), 0u);
}

TEST(CompletionTracker, AFinishedRequestHandsOverTheBlocksItsKvWasReadInto) {
  CompletionTracker t;
  ASSERT_TRUE(t.add_request("r", "i", {{7, 8}, {9}}).is_ok());
  ASSERT_TRUE(t.on_final_layer("r", 0, 1).is_ok());
  auto done = finished_of(t, kAlone);
  ASSERT_TRUE(done);
  EXPECT_EQ(done->finished, std::vector<std::string>{"i"});
  EXPECT_EQ(done->loaded_main_blocks, (std::vector<int64_t>{7, 8}));
  EXPECT_EQ(done->loaded_indexer_blocks, std::vector<int64_t>{9});
  EXPECT_TRUE(done->invalid_main_blocks.empty());
}

TEST(CompletionTracker, AContributorOnASecondConnectionFailsItsRequest) {
  CompletionTracker t;
  ASSERT_TRUE(t.add_request("r", "i").is_ok());
  EXPECT_TRUE(t.read_on("r", "conn-1", 0, true));
  EXPECT_TRUE(t.read_on("r", "conn-1", 0, true)) << "the same connection again";
  EXPECT_TRUE(t.read_on("r", "conn-2", 1, true)) << "another contributor's own connection";
  EXPECT_FALSE(t.read_on("r", "conn-2", 0, true)) << "contributor 0 moved connections";
  EXPECT_EQ(finished_of(t, kAlone)->failed, std::vector<std::string>{"i"});
}

TEST(CompletionTracker, ALostConnectionFailsWhatItOwedAndNothingElse) {
  CompletionTracker t;
  ASSERT_TRUE(t.add_request("a", "ia").is_ok());
  ASSERT_TRUE(t.add_request("b", "ib").is_ok());
  ASSERT_TRUE(t.add_request("c", "ic").is_ok());
  t.read_on("a", "conn-1", 0, true);
  t.read_on("b", "conn-2", 0, true);
  t.read_on("c", "conn-1", 0, true);
  ASSERT_TRUE(t.on_final_layer("c", 0, 1, "conn-1").is_ok());  // owed no more
  EXPECT_TRUE(t.owes_any());
  EXPECT_EQ(t.connection_lost("conn-1"), 1u);
  EXPECT_EQ(t.connection_lost("conn-1"), 0u) << "lost twice";
  ASSERT_TRUE(t.on_final_layer("b", 0, 1, "conn-2").is_ok());
  EXPECT_FALSE(t.owes_any());
  auto done = finished_of(t, kAlone);
  ASSERT_TRUE(done);
  EXPECT_EQ(done->failed, std::vector<std::string>{"ia"});
  EXPECT_EQ(done->finished, (std::vector<std::string>{"ib", "ic"}));
}

TEST(CompletionTracker, AFailedRequestsBlocksAreHandedBackOnlyOnceNoReadWritesThem) {
  CompletionTracker t;
  ASSERT_TRUE(t.add_request("r", "i", {{1, 2}, {3}}).is_ok());
  const uint64_t a = t.read_started(), b = t.read_started();  // its two contributors' reads
  t.read_into("r", a);
  t.read_into("r", b);
  t.read_ended(a);
  t.on_failed("r");  // contributor 0's read failed; contributor 1's still writes
  auto early = finished_of(t, kAlone);
  ASSERT_TRUE(early);
  EXPECT_TRUE(early->failed.empty()) << "blocks handed back while a read writes them";
  EXPECT_TRUE(early->invalid_main_blocks.empty());
  t.read_ended(b);
  auto done = finished_of(t, kAlone);
  ASSERT_TRUE(done);
  EXPECT_EQ(done->failed, std::vector<std::string>{"i"});
  EXPECT_EQ(done->invalid_main_blocks, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(done->invalid_indexer_blocks, std::vector<int64_t>{3});
  EXPECT_EQ(done->ended_ext_ids, std::vector<std::string>{"r"});
}

TEST(CompletionTracker, ARemovedRequestIsReportedOnlyOnceTheReadsInFlightEnded) {
  CompletionTracker t;
  ASSERT_TRUE(t.add_request("r", "i", {{1}, {2}}).is_ok());
  ASSERT_TRUE(t.add_request("q", "iq").is_ok());
  const uint64_t first = t.read_started(), second = t.read_started();
  t.remove_request("r");                    // either read may be writing its blocks
  const uint64_t third = t.read_started();  // begun after: no reason to wait for it
  t.read_ended(second);
  EXPECT_TRUE(finished_of(t, kAlone)->finished.empty());
  t.read_ended(first);
  t.remove_request("q");  // read `third` may write its blocks
  auto done = finished_of(t, kAlone);
  ASSERT_TRUE(done);
  EXPECT_EQ(done->finished, std::vector<std::string>{"i"});
  EXPECT_TRUE(done->loaded_main_blocks.empty()) << "a removed request's blocks hold no KV";
  t.read_ended(third);
  EXPECT_EQ(finished_of(t, kAlone)->finished, std::vector<std::string>{"iq"});
  EXPECT_TRUE(finished_of(t, kAlone)->finished.empty()) << "reported twice";
}

TEST(CompletionTracker, DuplicateFinalSignalDoesNotAdvance) {
  CompletionTracker t;
  ASSERT_TRUE(t.add_request("r", "i").is_ok());
  ASSERT_TRUE(t.on_final_layer("r", 0, 2).is_ok());
  ASSERT_TRUE(t.on_final_layer("r", 0, 2).is_ok());
  EXPECT_TRUE(finished_of(t, kAlone)->finished.empty());
  ASSERT_TRUE(t.on_final_layer("r", 1, 2).is_ok());
  EXPECT_EQ(finished_of(t, kAlone)->finished, std::vector<std::string>{"i"});
}

TEST(CompletionTracker, AFailedReadMakesTheRequestTerminalAndFailed) {
  CompletionTracker t;
  ASSERT_TRUE(t.add_request("r", "i").is_ok());
  t.on_failed("r");
  auto done = finished_of(t, kAlone);
  EXPECT_TRUE(done->finished.empty());
  EXPECT_EQ(done->failed, std::vector<std::string>{"i"});
}

TEST(CompletionTracker, EveryDecodeRankMustBeTerminal) {
  CompletionTracker t;
  ASSERT_TRUE(t.add_request("r", "i").is_ok());
  ASSERT_TRUE(t.on_final_layer("r", 0, 1).is_ok());
  // Another rank has not finished "r": nothing is reported and the state stays.
  EXPECT_TRUE(finished_of(t, group_with({RankTerminal{}}))->finished.empty());
  EXPECT_EQ(t.tracked(), 1u);
  // Another rank finished but failed: failed everywhere.
  auto done = finished_of(t, group_with({RankTerminal{{"r", true}}}));
  EXPECT_EQ(done->failed, std::vector<std::string>{"i"});
  EXPECT_TRUE(done->finished.empty());
}

TEST(CompletionTracker, ACompletionBeforeTheRequestIsKnownIsKept) {
  CompletionTracker t;
  ASSERT_TRUE(t.on_final_layer("r", 1, 2).is_ok());
  ASSERT_TRUE(t.on_final_layer("r", 0, 2).is_ok());
  EXPECT_TRUE(finished_of(t, kAlone)->finished.empty());
  ASSERT_TRUE(t.add_request("r", "i").is_ok());
  EXPECT_EQ(finished_of(t, kAlone)->finished, std::vector<std::string>{"i"});
}

TEST(CompletionTracker, EarlyCompletionsAreBounded) {
  CompletionTracker t(/*max_early=*/2);
  ASSERT_TRUE(t.on_final_layer("a", 0, 1).is_ok());
  ASSERT_TRUE(t.on_final_layer("b", 0, 1).is_ok());
  Status st = t.on_final_layer("c", 0, 1);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("request c"), std::string::npos) << st.message();
  EXPECT_EQ(t.tracked(), 2u);
}

TEST(CompletionTracker, AbortedRequestsIgnoreLateSignalsAndAreForgotten) {
  CompletionTracker t(/*max_early=*/3);
  ASSERT_TRUE(t.add_request("r", "i").is_ok());
  t.remove_request("r");
  ASSERT_TRUE(t.on_final_layer("r", 0, 1).is_ok());
  t.on_failed("r");
  EXPECT_EQ(t.tracked(), 0u);
  auto removed = finished_of(t, kAlone);
  EXPECT_EQ(removed->finished, std::vector<std::string>{"i"}) << "removed: reported once";
  EXPECT_TRUE(removed->failed.empty()) << "a late failure counted";
  // Re-adding the same id starts afresh.
  ASSERT_TRUE(t.add_request("r", "i2").is_ok());
  ASSERT_TRUE(t.on_final_layer("r", 0, 1).is_ok());
  EXPECT_EQ(finished_of(t, kAlone)->finished, std::vector<std::string>{"i2"});
}

TEST(CompletionTracker, ContributorOutsideTheRatioIsRejected) {
  CompletionTracker t;
  ASSERT_TRUE(t.add_request("r", "i").is_ok());
  EXPECT_EQ(t.on_final_layer("r", 2, 2).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t.on_final_layer("r", -1, 2).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t.add_request("r", "again").code(), StatusCode::kAlreadyExists);
}

TEST(CompletionTracker, TheContributorCountComesWithEachRequestsSignals) {
  CompletionTracker t;
  ASSERT_TRUE(t.add_request("two", "i2").is_ok());
  ASSERT_TRUE(t.add_request("one", "i1").is_ok());
  ASSERT_TRUE(t.on_final_layer("two", 0, 2).is_ok());
  ASSERT_TRUE(t.on_final_layer("one", 0, 1).is_ok());
  EXPECT_EQ(finished_of(t, kAlone)->finished, std::vector<std::string>{"i1"});
  ASSERT_TRUE(t.on_final_layer("two", 1, 2).is_ok());
  EXPECT_EQ(finished_of(t, kAlone)->finished, std::vector<std::string>{"i2"});
}

TEST(CompletionTracker, ContributorsDisagreeingOnTheirCountFailTheRequest) {
  CompletionTracker t;
  ASSERT_TRUE(t.add_request("r", "i").is_ok());
  ASSERT_TRUE(t.on_final_layer("r", 0, 4).is_ok());
  Status st = t.on_final_layer("r", 1, 2);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("says tp_ratio 2, an earlier one said 4"), std::string::npos)
      << st.message();
  auto done = finished_of(t, kAlone);
  EXPECT_EQ(done->failed, std::vector<std::string>{"i"});
  // Before the request is known as well.
  ASSERT_TRUE(t.on_final_layer("early", 0, 2).is_ok());
  EXPECT_FALSE(t.on_final_layer("early", 0, 1).is_ok());
  ASSERT_TRUE(t.add_request("early", "ie").is_ok());
  EXPECT_EQ(finished_of(t, kAlone)->failed, std::vector<std::string>{"ie"});
}

TEST(CompletionTracker, AFailingGatherIsReportedAndLosesNothing) {
  CompletionTracker t;
  ASSERT_TRUE(t.add_request("r", "i").is_ok());
  ASSERT_TRUE(t.on_final_layer("r", 0, 1).is_ok());
  AllGather broken = [](const RankTerminal&) -> Expected<std::vector<RankTerminal>> {
    return timeout_error("rank 1 did not answer");
  };
  auto st = finished_of(t, broken);
  ASSERT_FALSE(st);
  EXPECT_NE(st.status().message().find("rank 1 did not answer"), std::string::npos);
  EXPECT_EQ(finished_of(t, kAlone)->finished, std::vector<std::string>{"i"});
}

TEST(Combine, AllRanksAgreeOnTheSameAnswer) {
  std::vector<RankTerminal> ranks{{{"a", false}, {"b", false}, {"c", true}},
                                  {{"a", false}, {"c", false}},
                                  {{"a", false}, {"b", false}, {"c", false}}};
  const Combined f = combine(ranks);
  EXPECT_EQ(f.finished, std::vector<std::string>{"a"});
  EXPECT_EQ(f.failed, std::vector<std::string>{"c"});
}

}  // namespace
}  // namespace rd2h::decode
