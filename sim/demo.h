// rd2h demo: a whole prefill/decode-disaggregated deployment on this machine, driven through
// the proxy's OpenAI-style API; Decode verifies every byte of every prompt's KV. Exits non-zero
// on any mismatch, error, hang or unclean shutdown.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "rd2h/common/status.h"
#include "sim/demo_report.h"

namespace rd2h::sim {

struct DemoOptions {
  // Deployment
  int prefill_tp = 4;
  int decode_tp = 2;
  int dp = 1;  // Prefill and Decode instances behind the proxy
  std::string host = "127.0.0.1";
  std::string prefill_host;  // default: host
  std::string decode_host;   // default: host; Decode's kv_ip too
  int proxy_port = 0;        // 0: any free port
  int metaserver_port = 0;
  int kv_port = 0;  // Decode instance i uses kv_port + i * decode_tp; 0: a random free range
  std::string transport = "auto";
  // Wrappers put in front of the Prefill and Decode commands (for example
  // "ip netns exec ns1"), split on spaces.
  std::string prefill_wrapper, decode_wrapper;
  // Model
  int layers = 61;
  uint64_t block_size = 128;
  std::vector<uint64_t> bytes_per_token{1024, 128, 128, 4};
  uint64_t num_blocks = 320;  // per rank; Decode's main pool holds this many blocks per layer
  int slots = 3;
  uint64_t token_budget = 2048;
  uint64_t compute_ns_per_token = 1000;
  uint64_t compute_min_layer_us = 0;
  // Workload
  uint32_t requests = 24;
  uint64_t min_tokens = 100;
  uint64_t max_tokens = 16384;
  uint32_t concurrency = 4;
  double prompt_list_share = 0.25;  // requests that carry a list of prompts
  uint32_t prompt_list_size = 3;
  uint32_t output_tokens = 8;
  uint64_t seed = 1;
  uint32_t timeout_s = 600;
  // Output
  std::string trace_file;
  // The engines record their timeline, which the summary's transfer figures come from; off,
  // the summary has the client's figures only.
  bool timeline = true;
  bool quiet = false;
  int test_corrupt_layer = -1;  // test only: see sim::EngineConfig
};

// One setting of rd2h demo as the command line (--name) and a config file (the key name,
// with - or _) both take it: the field its value goes to and the values it may take. The
// one list of the demo's settings, so the two cannot disagree.
struct DemoSetting {
  using Field = std::variant<int*, uint32_t*, uint64_t*, double*, bool*, std::string*,
                             std::vector<uint64_t>*>;
  DemoSetting(std::string name, std::string help, Field field)
      : name(std::move(name)), help(std::move(help)), field(field) {}

  std::string name;
  std::string help;
  Field field;
  uint64_t lo = 0, hi = 0;              // a whole number, or each item of a list; a double: 0 to 1
  size_t min_items = 0, max_items = 0;  // a list
  std::vector<std::string> choices;     // a string: one of these, when there are any
  bool negatable = false;               // a switch: --no-<name> turns it off
  bool in_config = true;                // false: the command line only
  bool hidden = false;                  // test only: left out of --help
};

// The settings of `o`, each pointing into it, in --help order.
std::vector<DemoSetting> demo_settings(DemoOptions& o);

// Reads a JSON config (keys are the long flag names, with - or _) into `options`, skipping
// keys for which `given_on_command_line` is true. Unknown keys are refused, naming them, and
// so is a value of the wrong type or out of its range (numbers are whole where the flag's
// is, nothing negative, fractional or too large is narrowed), naming the key.
Status apply_demo_config(const std::string& path, DemoOptions& options,
                         const std::function<bool(const std::string&)>& given_on_command_line);
// The same for the file's text; `source` names it in errors.
Status apply_demo_config_text(const std::string& text, const std::string& source,
                              DemoOptions& options,
                              const std::function<bool(const std::string&)>& given_on_command_line);

// One run; its summary, or why it failed.
Expected<DemoSummary> run_demo_once(const DemoOptions& options);
int run_demo(const DemoOptions& options);

// rd2h bench demo: the same workload over several Prefill:Decode TP pairs, one table.
struct BenchDemoOptions {
  DemoOptions demo;
  std::vector<std::string> topologies{"4:2", "2:2", "1:1"};
};
int run_bench_demo(const BenchDemoOptions& options);

}  // namespace rd2h::sim
