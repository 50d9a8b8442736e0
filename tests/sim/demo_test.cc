// rd2h demo as a user runs it (the real binary, its proxy, Prefill and Decode processes and
// their TP rank processes), and the figures it derives from the engines' timelines.
#include "sim/demo.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "sim/demo_report.h"
#include "support/http_server.h"
#include "support/rd2h_run.h"
#include "util/subprocess.h"

namespace rd2h::sim {
namespace {

using nlohmann::json;

const std::string kSmall = std::string(RD2H_SOURCE_DIR) + "/examples/demo-small.json";

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "rd2h-" + std::to_string(getpid()) + "-" + name;
}

TEST(Demo, ASmallRunVerifiesEveryByteWritesItsTraceAndStopsCleanly) {
  const std::string trace = temp_path("trace.json");
  const ToolRun run = run_rd2h({"demo", "--config", kSmall, "--trace", trace});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("OK: every byte of every prompt's KV was verified"), std::string::npos)
      << run.output;
  EXPECT_NE(run.output.find("requests          12 ("), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("0 failed"), std::string::npos) << run.output;
  // The run made keys of its own: both engines' control channels are CURVE.
  EXPECT_NE(run.output.find("TP 2, control channels CURVE)"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("(TP 4, control channels CURVE)"), std::string::npos) << run.output;
  // And it reports each process's memory.
  EXPECT_NE(run.output.find("private memory"), std::string::npos) << run.output;

  std::ifstream in(trace);
  std::stringstream text;
  text << in.rdbuf();
  const json t = json::parse(text.str(), nullptr, false);
  ASSERT_TRUE(t.is_object() && t.contains("traceEvents")) << "the trace is not trace-event JSON";
  std::map<std::string, size_t> names;
  std::set<int> compute_ranks;
  for (const auto& e : t["traceEvents"]) {
    const std::string name = e.value("name", "");
    names[name.substr(0, name.find(" L"))]++;
    if (name.rfind("compute", 0) == 0) compute_ranks.insert(e.value("tid", -1));
  }
  // Every Prefill rank computed, published and heard back; Decode read and readied prompts.
  EXPECT_EQ(compute_ranks.size(), 4u);
  EXPECT_GT(names["readiness"], 0u);
  EXPECT_EQ(names["answer"], names["readiness"]) << "every readiness is answered";
  EXPECT_GT(names["read"], 0u);
  EXPECT_GT(names["kv complete"], 0u);
  EXPECT_GT(names["kv ready"], 0u);
  EXPECT_GT(names["first token"], 0u);
  std::remove(trace.c_str());
}

TEST(Demo, WithTwoInstancesEveryPairIsConnectedBeforeTheMeasuredRun) {
  // A connection's first message is MF_META, answered by an ACK: none may fall inside the
  // measured run, whichever Prefill/Decode pairs the proxy picks for it.
  const std::string trace = temp_path("dp-trace.json");
  const ToolRun run = run_rd2h({"demo", "--config", kSmall, "--dp", "2", "--trace", trace});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  std::ifstream in(trace);
  std::stringstream text;
  text << in.rdbuf();
  const json t = json::parse(text.str(), nullptr, false);
  ASSERT_TRUE(t.is_object() && t.contains("traceEvents"));
  size_t acks = 0, engines = 0;
  for (const auto& e : t["traceEvents"]) {
    if (e.value("name", "") == "mf_meta ack") ++acks;
    if (e.value("name", "") == "process_name") ++engines;
  }
  EXPECT_EQ(engines, 5u) << "the client, two Prefill and two Decode instances";
  EXPECT_EQ(acks, 0u) << "a connection was made during the measured run";
  std::remove(trace.c_str());
}

TEST(Demo, ACorruptedByteMakesTheRunFailNamingWhere) {
  const ToolRun run =
      run_rd2h({"demo", "--config", kSmall, "--requests", "3", "--test-corrupt-layer", "5"});
  EXPECT_NE(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("layer 5, tensor 0 in the shared main pool does not hold its KV"),
            std::string::npos)
      << run.output;
  // The first prompt Prefill finishes carries the corruption (the warm-up's, here).
  EXPECT_NE(run.output.find("rd2h demo: FAILED: "), std::string::npos) << run.output;
  EXPECT_EQ(run.output.find("rd2h demo: OK"), std::string::npos) << run.output;
}

std::string command_of(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/cmdline");
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::replace(s.begin(), s.end(), '\0', ' ');
  return s;
}

TEST(Demo, ADecodeRankKilledMidRunFailsTheRunInsteadOfHanging) {
  Subprocess::Options options;
  options.merge_stderr = true;
  auto demo = Subprocess::spawn(
      {RD2H_BINARY, "demo", "--config", kSmall, "--requests", "2000", "--timeout", "30"}, options);
  ASSERT_TRUE(demo) << demo.status().to_string();
  std::string output;
  // Once the workload runs (its first progress line), kill Decode's TP rank 1.
  for (;;) {
    auto line = demo->read_line(std::chrono::seconds(60));
    ASSERT_TRUE(line) << output;
    output += *line + "\n";
    if (line->find("requests") != std::string::npos && line->find(" s ") != std::string::npos)
      break;
  }
  pid_t victim = 0;
  for (pid_t engine : children_of(demo->pid())) {
    if (command_of(engine).find(" decode ") == std::string::npos) continue;
    for (pid_t rank : children_of(engine)) {
      if (command_of(rank).find("--rank 1 ") != std::string::npos) victim = rank;
    }
  }
  ASSERT_NE(victim, 0) << "no Decode rank 1 among the demo's processes";
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  auto rest = demo->read_all(std::chrono::seconds(120));
  ASSERT_TRUE(rest) << "the demo did not end: " << rest.status().to_string();
  output += *rest;
  auto status = demo->wait(std::chrono::seconds(30));
  ASSERT_TRUE(status);
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) != 0) << output;
  // Whichever side notices first names the dead rank: Decode's engine core (the rank's
  // process ended) or Prefill (its connection to that rank's port closed).
  const size_t at = output.find("kv base port ");
  ASSERT_NE(at, std::string::npos) << output;
  const int rank1_port = std::stoi(output.substr(at + 13)) + 1;
  EXPECT_TRUE(output.find("TP rank 1 (pid " + std::to_string(victim) +
                          ") was killed by signal 9") != std::string::npos ||
              output.find("the connection to tcp://127.0.0.1:" + std::to_string(rank1_port) +
                          " closed") != std::string::npos)
      << output;
  EXPECT_NE(output.find("rd2h demo: FAILED: "), std::string::npos) << output;
}

TEST(Demo, APrefillEngineKilledMidRunIsNamedWithinASecondAndFailsTheRun) {
  Subprocess::Options options;
  options.merge_stderr = true;
  auto demo = Subprocess::spawn(
      {RD2H_BINARY, "demo", "--config", kSmall, "--requests", "2000", "--timeout", "60"}, options);
  ASSERT_TRUE(demo) << demo.status().to_string();
  std::string output;
  for (;;) {
    auto line = demo->read_line(std::chrono::seconds(60));
    ASSERT_TRUE(line) << output;
    output += *line + "\n";
    if (line->find("requests") != std::string::npos && line->find(" s ") != std::string::npos)
      break;
  }
  pid_t victim = 0;
  for (pid_t engine : children_of(demo->pid())) {
    if (command_of(engine).find(" prefill ") != std::string::npos) victim = engine;
  }
  ASSERT_NE(victim, 0) << "no Prefill engine among the demo's processes";
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  const auto killed = std::chrono::steady_clock::now();
  // The issue's bound is a second; the slack is for sanitizers on a loaded machine.
  const std::string notice = "Prefill 0 (pid " + std::to_string(victim) + ") ended with signal 9";
  for (;;) {
    auto line = demo->read_line(std::chrono::seconds(5));
    ASSERT_TRUE(line) << "the demo did not name the dead Prefill in time:\n" << output;
    output += *line + "\n";
    if (line->find(notice) != std::string::npos) break;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - killed, std::chrono::seconds(5)) << output;
  auto rest = demo->read_all(std::chrono::seconds(60));
  ASSERT_TRUE(rest) << "the demo did not end: " << rest.status().to_string();
  output += *rest;
  auto status = demo->wait(std::chrono::seconds(30));
  ASSERT_TRUE(status);
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) != 0) << output;
  EXPECT_NE(output.find("rd2h demo: FAILED: " + notice), std::string::npos) << output;
}

// Whether `pid` has ended (it no longer exists, or it is a zombie nobody reaped yet).
bool ended_process(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return true;
  const size_t close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'Z';
}

// Starts a long demo and returns it once its workload runs, with every process it started
// (the proxy, the engines and their TP ranks).
struct RunningDemo {
  Subprocess demo;
  std::vector<pid_t> processes;
};
std::optional<RunningDemo> running_demo(std::string& output) {
  Subprocess::Options options;
  options.merge_stderr = true;
  auto demo = Subprocess::spawn(
      {RD2H_BINARY, "demo", "--config", kSmall, "--requests", "100000", "--timeout", "60"},
      options);
  EXPECT_TRUE(demo) << demo.status().to_string();
  if (!demo) return std::nullopt;
  for (;;) {
    auto line = demo->read_line(std::chrono::seconds(60));
    if (!line) {
      ADD_FAILURE() << output;
      return std::nullopt;
    }
    output += *line + "\n";
    if (line->find("requests") != std::string::npos && line->find(" s ") != std::string::npos)
      break;
  }
  std::vector<pid_t> all;
  for (pid_t child : children_of(demo->pid())) {
    all.push_back(child);
    for (pid_t rank : children_of(child)) all.push_back(rank);
  }
  return RunningDemo{std::move(*demo), all};
}

TEST(Demo, SigtermStopsEveryProcessOfTheRunAndTheDemo) {
  std::string output;
  auto run = running_demo(output);
  ASSERT_TRUE(run);
  auto& [demo, processes] = *run;
  ASSERT_GE(processes.size(), 3u + 4u + 2u) << "proxy, engines and ranks:\n" << output;
  ASSERT_EQ(::kill(demo.pid(), SIGTERM), 0);
  auto rest = demo.read_all(std::chrono::seconds(90));
  ASSERT_TRUE(rest) << "the demo did not end: " << rest.status().to_string();
  output += *rest;
  auto status = demo.wait(std::chrono::seconds(30));
  ASSERT_TRUE(status);
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 128 + SIGTERM) << output;
  EXPECT_NE(output.find("rd2h demo: stopped by signal 15"), std::string::npos) << output;
  for (pid_t p : processes) {
    EXPECT_TRUE(rd2h::testing::eventually([&] { return ended_process(p); }))
        << "pid " << p << " (" << command_of(p) << ") outlived the demo";
  }
}

TEST(Demo, WhenTheDemoIsKilledItsProcessesStopToo) {
  std::string output;
  auto run = running_demo(output);
  ASSERT_TRUE(run);
  auto& [demo, processes] = *run;
  ASSERT_GE(processes.size(), 3u + 4u + 2u) << output;
  ASSERT_EQ(::kill(demo.pid(), SIGKILL), 0);
  ASSERT_TRUE(demo.wait(std::chrono::seconds(30)));
  for (pid_t p : processes) {
    EXPECT_TRUE(rd2h::testing::eventually([&] { return ended_process(p); }))
        << "pid " << p << " (" << command_of(p) << ") outlived the killed demo";
  }
}

TEST(Demo, BadSettingsAreRefusedBeforeAnythingStarts) {
  ToolRun run = run_rd2h({"demo", "--max-tokens", "20000", "--num-blocks", "64"});
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.output.find("a 20000-token prompt needs 157 blocks, and --num-blocks is 64"),
            std::string::npos)
      << run.output;
  EXPECT_EQ(run.output.find("Decode 0 at"), std::string::npos) << "nothing was started";
}

TEST(RankWorker, AWorkerWhoseCoreIsNotItsParentExitsAtOnce) {
  // A rank whose engine core died before it could arrange to die with it must not linger.
  const ToolRun run =
      run_rd2h({"worker", "--core", "tcp://127.0.0.1:9", "--rank", "0", "--core-pid", "1"},
               std::chrono::seconds(10));
  EXPECT_EQ(run.exit_code, 1) << run.output;
}

class DemoConfig : public ::testing::Test {
 protected:
  std::string write(const std::string& text) {
    path_ = temp_path("demo-config.json");
    std::ofstream(path_) << text;
    return path_;
  }
  void TearDown() override { std::remove(path_.c_str()); }
  std::string path_;
};

TEST_F(DemoConfig, KeysSetOptionsAndTheCommandLineWins) {
  DemoOptions o;
  const auto path = write(R"({"prefill_tp": 2, "decode-tp": 1, "bytes-per-token": [8, 4],
                              "requests": 7, "trace": "t.json"})");
  Status st = apply_demo_config(path, o, [](const std::string& key) { return key == "requests"; });
  ASSERT_TRUE(st) << st.to_string();
  EXPECT_EQ(o.prefill_tp, 2);
  EXPECT_EQ(o.decode_tp, 1);
  EXPECT_EQ(o.bytes_per_token, (std::vector<uint64_t>{8, 4}));
  EXPECT_EQ(o.requests, DemoOptions{}.requests) << "given on the command line";
  EXPECT_EQ(o.trace_file, "t.json");
}

TEST_F(DemoConfig, AnUnknownKeyOrAWrongTypeIsRefusedNamingIt) {
  DemoOptions o;
  auto none = [](const std::string&) { return false; };
  Status st = apply_demo_config(write(R"({"prefil-tp": 2})"), o, none);
  EXPECT_FALSE(st);
  EXPECT_NE(st.message().find("'prefil-tp' is not a demo setting"), std::string::npos)
      << st.to_string();
  st = apply_demo_config(write(R"({"layers": "many"})"), o, none);
  EXPECT_FALSE(st);
  EXPECT_NE(st.message().find("'layers' must be a whole number"), std::string::npos)
      << st.to_string();
  st = apply_demo_config(write("[1, 2]"), o, none);
  EXPECT_FALSE(st);
  st = apply_demo_config(temp_path("missing.json"), o, none);
  EXPECT_FALSE(st);
}

TEST(DemoConfigText, ADeeplyNestedValueIsRefusedNamingTheKeyAndTheDepthNotPrintingIt) {
  auto none = [](const std::string&) { return false; };
  // 200,000 levels: far past what printing the value recursively survives.
  const size_t levels = 200000;
  const std::string text =
      "{\"layers\": " + std::string(levels, '[') + std::string(levels, ']') + "}";
  DemoOptions o;
  const Status st = apply_demo_config_text(text, "t.json", o, none);
  ASSERT_FALSE(st);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(),
            "demo config t.json: 'layers' nests lists and objects more than 4 "
            "levels deep");
  // A value within the depth is refused by what it is, not printed.
  const Status list = apply_demo_config_text(R"({"layers": [[1, 2], [3]]})", "t.json", o, none);
  EXPECT_NE(list.message().find("'layers' must be a whole number from 1 to"), std::string::npos)
      << list.message();
  EXPECT_NE(list.message().find("not a list of 2 items"), std::string::npos) << list.message();
  const Status text_value = apply_demo_config_text(
      "{\"transport\": \"" + std::string(10000, 'x') + "\"}", "t.json", o, none);
  EXPECT_LT(text_value.message().size(), 300u) << "a long value is printed whole";
}

TEST(DemoConfigText, NegativeFractionalHugeOrStringNumbersAreRefusedNamingTheKey) {
  auto none = [](const std::string&) { return false; };
  // Each bad value, for a few keys of each kind (unsigned 32 and 64 bit, int, a list).
  for (const std::string key : {"requests", "num-blocks", "prefill_tp", "layers", "timeout"}) {
    for (const std::string value : {"-1", "1.5", "1e59", "\"7\"", "18446744073709551616"}) {
      DemoOptions o;
      const DemoOptions before;
      const std::string text = "{\"" + key + "\": " + value + "}";
      Status st = apply_demo_config_text(text, "t.json", o, none);
      ASSERT_FALSE(st) << text;
      EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << text;
      EXPECT_NE(st.message().find("'" + key + "' must be a whole number from"), std::string::npos)
          << text << ": " << st.to_string();
      EXPECT_EQ(o.requests, before.requests) << text;
      EXPECT_EQ(o.num_blocks, before.num_blocks) << text;
      EXPECT_EQ(o.prefill_tp, before.prefill_tp) << text;
    }
  }
  // Out of range: zero where at least one is needed, a TP beyond the command line's limit.
  DemoOptions o;
  Status st = apply_demo_config_text(R"({"concurrency": 0})", "t.json", o, none);
  EXPECT_NE(st.message().find("'concurrency' must be a whole number from 1 to"), std::string::npos)
      << st.to_string();
  st = apply_demo_config_text(R"({"decode-tp": 65})", "t.json", o, none);
  EXPECT_NE(st.message().find("'decode-tp' must be a whole number from 1 to 64, not 65"),
            std::string::npos)
      << st.to_string();
  st = apply_demo_config_text(R"({"bytes-per-token": [64, -8]})", "t.json", o, none);
  EXPECT_NE(st.message().find("'bytes-per-token[1]' must be a whole number"), std::string::npos)
      << st.to_string();
  st = apply_demo_config_text(R"({"bytes-per-token": [64]})", "t.json", o, none);
  EXPECT_NE(st.message().find("'bytes-per-token' must be a list"), std::string::npos)
      << st.to_string();
  st = apply_demo_config_text(R"({"prompt-list-share": 1.5})", "t.json", o, none);
  EXPECT_NE(st.message().find("'prompt-list-share' must be a number from 0 to 1"),
            std::string::npos)
      << st.to_string();
  st = apply_demo_config_text(R"({"transport": "carrier pigeon"})", "t.json", o, none);
  EXPECT_NE(st.message().find("'transport' must be"), std::string::npos) << st.to_string();
  st = apply_demo_config_text(R"({"host": 7})", "t.json", o, none);
  EXPECT_NE(st.message().find("'host' must be a string"), std::string::npos) << st.to_string();
  // The edges of a range are accepted, exactly.
  st = apply_demo_config_text(
      R"({"requests": 1, "seed": 18446744073709551615, "proxy-port": 65535, "slots": 0,
          "prompt-list-share": 1})",
      "t.json", o, none);
  ASSERT_TRUE(st) << st.to_string();
  EXPECT_EQ(o.requests, 1u);
  EXPECT_EQ(o.seed, UINT64_MAX);
  EXPECT_EQ(o.proxy_port, 65535);
  EXPECT_EQ(o.slots, 0);
  EXPECT_EQ(o.prompt_list_share, 1.0);
}

TEST(DemoSettings, EveryConfigKeyTakesItsDefaultNamesAreUniqueAndFlagsOnlyAreRefused) {
  DemoOptions o;
  const auto settings = demo_settings(o);
  std::set<std::string> names;
  for (const auto& s : settings) {
    EXPECT_TRUE(names.insert(s.name).second) << s.name << " is listed twice";
    if (!s.in_config) {
      const Status st = apply_demo_config_text("{\"" + s.name + "\": 1}", "t.json", o,
                                               [](const std::string&) { return false; });
      EXPECT_NE(st.message().find("'" + s.name + "' is not a demo setting"), std::string::npos)
          << st.to_string();
      continue;
    }
    const nlohmann::json value =
        std::visit([](auto* field) { return nlohmann::json(*field); }, s.field);
    const Status st = apply_demo_config_text(nlohmann::json{{s.name, value}}.dump(), "t.json", o,
                                             [](const std::string&) { return false; });
    EXPECT_TRUE(st) << s.name << " = " << value.dump() << ": " << st.to_string();
  }
  EXPECT_TRUE(names.count("timeline") && names.count("bytes-per-token") && names.count("quiet"));
}

TEST(DemoConfigText, TheShippedExampleIsAccepted) {
  std::ifstream in(kSmall);
  std::stringstream text;
  text << in.rdbuf();
  DemoOptions o;
  Status st =
      apply_demo_config_text(text.str(), kSmall, o, [](const std::string&) { return false; });
  ASSERT_TRUE(st) << st.to_string();
  EXPECT_EQ(o.requests, 12u);
  EXPECT_EQ(o.bytes_per_token, (std::vector<uint64_t>{64, 8, 16, 4}));
}

TEST(DemoReport, HiddenFractionCountsOnlyReadTimeUnderCompute) {
  // Compute [0, 100) and [90, 150) merge into [0, 150); a read [140, 160) is half hidden,
  // a read [200, 210) not at all, a read [10, 30) wholly.
  const std::vector<Interval> compute = {{90, 150}, {0, 100}};
  EXPECT_DOUBLE_EQ(hidden_fraction({{140, 160}}, compute), 0.5);
  EXPECT_DOUBLE_EQ(hidden_fraction({{200, 210}}, compute), 0.0);
  EXPECT_DOUBLE_EQ(hidden_fraction({{10, 30}}, compute), 1.0);
  EXPECT_DOUBLE_EQ(hidden_fraction({{140, 160}, {200, 210}, {10, 30}}, compute), 30.0 / 50.0);
  EXPECT_DOUBLE_EQ(hidden_fraction({}, compute), 0.0);
}

TEST(DemoReport, ReadyDelayIsMeasuredFromPrefillsLastLayerToTheLastDecodeRank) {
  using trace::Event;
  EngineTrace prefill{"prefill", 0, 2, {}};
  prefill.events = {{"compute", "compute", 1000, 100, 0, 3, 0, ""},
                    {"prefill done", "core", 1100, -1, -1, -1, 0, "a"}};
  EngineTrace decode{"decode", 0, 2, {}};
  decode.events = {{"read", "reader", 1110, 40, 0, 3, 4096, "a,b"},
                   {"read", "reader", 1120, 50, 1, 3, 4096, "a"},
                   {"kv complete", "reader", 1160, -1, 0, 3, 0, "a"},
                   {"kv complete", "reader", 1200, -1, 1, 3, 0, "a"},
                   {"kv ready", "core", 2100, -1, -1, -1, 0, "a"}};
  const DemoSummary s = summarize({prefill, decode}, {});
  EXPECT_EQ(s.reads, 2u);
  EXPECT_EQ(s.bytes, 8192u);
  EXPECT_EQ(s.ready_matched, 1u);
  EXPECT_DOUBLE_EQ(s.ready_delay_p50_us, 100) << "to the later of the two ranks";
  EXPECT_DOUBLE_EQ(s.last_layer_read_p50_us, 50) << "the slower rank's read of layer 3";
  EXPECT_DOUBLE_EQ(s.ready_ratio_p50, 2.0);
  EXPECT_DOUBLE_EQ(s.pickup_delay_p50_us, 1000);
  EXPECT_DOUBLE_EQ(s.hidden, 0.0) << "both reads ran after compute ended";
}

// The summary shows each goal beside its figure and whether the run met it.
TEST(DemoReport, TheSummaryShowsEachGoalAndWhetherItWasMet) {
  DemoSummary s;
  s.requests = 4;
  s.reads = 8;
  s.hidden = 0.95;
  s.ready_ratio_p50 = 2.0;
  const std::string text = format_summary(s);
  EXPECT_NE(text.find("in 0.0 s  [goal: none failed, met]"), std::string::npos) << text;
  EXPECT_NE(text.find("(layer compute p50 0 us)  [goal: at least 90%, met]"), std::string::npos)
      << text;
  EXPECT_NE(text.find("p99 0.0x  [goal: p50 at most 1.5x, MISSED]"), std::string::npos) << text;
  s.failed = 1;
  s.hidden = 0.5;
  s.ready_ratio_p50 = 1.5;
  const std::string missed = format_summary(s);
  EXPECT_NE(missed.find("[goal: none failed, MISSED]"), std::string::npos) << missed;
  EXPECT_NE(missed.find("[goal: at least 90%, MISSED]"), std::string::npos) << missed;
  EXPECT_NE(missed.find("[goal: p50 at most 1.5x, met]"), std::string::npos) << missed;
}

}  // namespace
}  // namespace rd2h::sim
