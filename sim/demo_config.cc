#include <algorithm>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "sim/demo_parts.h"
#include "util/openai_body.h"

namespace rd2h::sim {

using nlohmann::json;

namespace demo {

Status check_options(const DemoOptions& o) {
  if (o.layers < 1 || o.block_size == 0 || o.num_blocks == 0 || o.bytes_per_token.size() < 2) {
    return invalid_argument(
        "model: layers, block size, blocks and K, V bytes per token are needed");
  }
  if (o.min_tokens == 0 || o.min_tokens > o.max_tokens) {
    return invalid_argument("workload: need 1 <= --min-tokens (" + std::to_string(o.min_tokens) +
                            ") <= --max-tokens (" + std::to_string(o.max_tokens) + ")");
  }
  const uint64_t need = demo::demo_blocks(o.max_tokens, o);
  if (need > o.num_blocks) {
    return invalid_argument("a " + std::to_string(o.max_tokens) + "-token prompt needs " +
                            std::to_string(need) + " blocks, and --num-blocks is " +
                            std::to_string(o.num_blocks));
  }
  const uint64_t list = std::max(2u, o.prompt_list_size);
  if (o.prompt_list_share > 0 && list * demo::demo_blocks(o.min_tokens, o) > o.num_blocks) {
    return invalid_argument(
        "a list of " + std::to_string(list) + " prompts of " + std::to_string(o.min_tokens) +
        " tokens needs " + std::to_string(list * demo::demo_blocks(o.min_tokens, o)) +
        " blocks at once on Decode, and --num-blocks is " + std::to_string(o.num_blocks));
  }
  if (!o.timeline && !o.trace_file.empty()) {
    return invalid_argument("--trace needs the timeline: drop --no-timeline or --trace");
  }
  if (o.requests == 0 || o.concurrency == 0) {
    return invalid_argument("workload: --requests and --concurrency must be at least 1");
  }
  if (o.dp < 1) return invalid_argument("--dp must be at least 1");
  if (o.token_budget == 0) return invalid_argument("--token-budget must be at least 1");
  return Status::ok();
}

}  // namespace demo

namespace {

// Levels of lists and objects a demo config value may nest: no setting takes more than a
// list of numbers, and a deeper value is refused before anything walks it recursively.
constexpr size_t kMaxConfigNesting = 4;

// `v` as a refusal shows it: a scalar as written (a long string cut), a list or object by
// its size, never its contents (which may be large or deeply nested).
std::string shown(const json& v) {
  if (v.is_array()) return "a list of " + std::to_string(v.size()) + " items";
  if (v.is_object()) return "an object of " + std::to_string(v.size()) + " keys";
  if (v.is_string() && v.get_ref<const std::string&>().size() > 64) {
    return json(v.get_ref<const std::string&>().substr(0, 64)).dump() + "...";
  }
  return v.dump();
}

// A whole number from `lo` to `hi` (JSON integers only: 1.5, 1e59, "7" and -1 for an
// unsigned setting are refused), or why not, naming the key.
template <typename T>
Status whole(const json& v, const std::string& key, uint64_t lo, uint64_t hi, T& out) {
  auto refuse = [&] {
    return invalid_argument("'" + key + "' must be a whole number from " + std::to_string(lo) +
                            " to " + std::to_string(hi) + ", not " + shown(v));
  };
  if (!v.is_number_integer()) return refuse();
  if (!v.is_number_unsigned() && v.get<int64_t>() < 0) return refuse();
  const uint64_t n = v.get<uint64_t>();
  if (n < lo || n > hi) return refuse();
  out = static_cast<T>(n);
  return Status::ok();
}

// What the config's value `v` of setting `s` (named `key` as the file has it) means for its
// field; the field is written only if the value is good.
Status take(const DemoSetting& s, const json& v, const std::string& key) {
  struct Take {
    const DemoSetting& s;
    const json& v;
    const std::string& key;
    Status operator()(int* f) const { return whole(v, key, s.lo, s.hi, *f); }
    Status operator()(uint32_t* f) const { return whole(v, key, s.lo, s.hi, *f); }
    Status operator()(uint64_t* f) const { return whole(v, key, s.lo, s.hi, *f); }
    Status operator()(double* f) const {
      if (!v.is_number() || !(v.get<double>() >= 0.0 && v.get<double>() <= 1.0)) {
        return invalid_argument("'" + key + "' must be a number from 0 to 1, not " + shown(v));
      }
      *f = v.get<double>();
      return Status::ok();
    }
    Status operator()(bool* f) const {
      if (!v.is_boolean()) return invalid_argument("'" + key + "' must be true or false");
      *f = v.get<bool>();
      return Status::ok();
    }
    Status operator()(std::string* f) const {
      const bool listed = s.choices.empty() ||
                          (v.is_string() && std::find(s.choices.begin(), s.choices.end(),
                                                      v.get<std::string>()) != s.choices.end());
      if (!v.is_string() || !listed) {
        std::string one_of;
        for (size_t i = 0; i < s.choices.size(); ++i) {
          one_of += (i == 0                      ? ""
                     : i + 1 == s.choices.size() ? " or "
                                                 : ", ") +
                    ("\"" + s.choices[i] + "\"");
        }
        return invalid_argument("'" + key + "' must be " +
                                (s.choices.empty() ? "a string" : one_of) + ", not " + shown(v));
      }
      *f = v.get<std::string>();
      return Status::ok();
    }
    Status operator()(std::vector<uint64_t>* f) const {
      if (!v.is_array() || v.size() < s.min_items || v.size() > s.max_items) {
        return invalid_argument("'" + key + "' must be a list of " + std::to_string(s.min_items) +
                                " to " + std::to_string(s.max_items) + " whole numbers (" + s.help +
                                "), not " + shown(v));
      }
      std::vector<uint64_t> items(v.size());
      for (size_t i = 0; i < v.size(); ++i) {
        RD2H_RETURN_IF_ERROR(
            whole(v[i], key + "[" + std::to_string(i) + "]", s.lo, s.hi, items[i]));
      }
      *f = std::move(items);
      return Status::ok();
    }
  };
  return std::visit(Take{s, v, key}, s.field);
}

DemoSetting number(std::string name, std::string help, DemoSetting::Field field, uint64_t lo,
                   uint64_t hi) {
  DemoSetting s{std::move(name), std::move(help), field};
  s.lo = lo;
  s.hi = hi;
  return s;
}

DemoSetting text(std::string name, std::string help, std::string* field,
                 std::vector<std::string> choices = {}) {
  DemoSetting s{std::move(name), std::move(help), field};
  s.choices = std::move(choices);
  return s;
}

DemoSetting command_line_only(DemoSetting s) {
  s.in_config = false;
  return s;
}

std::vector<DemoSetting> deployment_settings(DemoOptions& o) {
  return {
      number("prefill-tp", "Prefill TP size", &o.prefill_tp, 1, 64),
      number("decode-tp", "Decode TP size", &o.decode_tp, 1, 64),
      number("dp", "Prefill and Decode instances", &o.dp, 1, 16),
      text("host", "address of the proxy (and of the engines by default)", &o.host),
      text("prefill-host", "address Prefill binds", &o.prefill_host),
      text("decode-host", "address Decode binds and advertises", &o.decode_host),
      command_line_only(text("prefill-wrapper",
                             "command put before Prefill's (e.g. \"ip netns exec ns1\")",
                             &o.prefill_wrapper)),
      command_line_only(text("decode-wrapper", "command put before Decode's", &o.decode_wrapper)),
      number("proxy-port", "client API port (0: any)", &o.proxy_port, 0, 65535),
      number("metaserver-port", "rendezvous port (0: any)", &o.metaserver_port, 0, 65535),
      number("kv-port", "Decode's first kv port (0: a random free range)", &o.kv_port, 0, 65535),
      text("transport", "shm | tcp | auto", &o.transport, {"shm", "tcp", "auto"}),
  };
}

std::vector<DemoSetting> model_settings(DemoOptions& o) {
  DemoSetting bytes_per_token{"bytes-per-token", "K, V, indexer[, scale]", &o.bytes_per_token};
  bytes_per_token.lo = 1;
  bytes_per_token.hi = 1u << 24;
  bytes_per_token.min_items = 2;
  bytes_per_token.max_items = 4;
  DemoSetting corrupt = command_line_only({"test-corrupt-layer", "", &o.test_corrupt_layer});
  corrupt.hidden = true;
  return {
      number("layers", "attention layers", &o.layers, 1, 1024),
      number("block-size", "tokens per block", &o.block_size, 1, 1u << 20),
      number("num-blocks", "blocks per rank", &o.num_blocks, 1, 1u << 24),
      bytes_per_token,
      number("slots", "Prefill's physical layer buffers (0: one per layer)", &o.slots, 0, 1024),
      number("token-budget", "Prefill tokens per step (chunking)", &o.token_budget, 1, UINT32_MAX),
      number("compute-ns-per-token", "Prefill compute time per token per layer",
             &o.compute_ns_per_token, 0, 1'000'000'000),
      number("compute-min-layer-us", "least Prefill compute time per layer",
             &o.compute_min_layer_us, 0, 60'000'000),
      corrupt,
  };
}

std::vector<DemoSetting> workload_settings(DemoOptions& o) {
  return {
      number("requests", "requests in the workload", &o.requests, 1, 100'000'000),
      number("min-tokens", "shortest prompt", &o.min_tokens, 1, 1u << 30),
      number("max-tokens", "longest prompt", &o.max_tokens, 1, 1u << 30),
      number("concurrency", "requests in flight", &o.concurrency, 1, 65536),
      DemoSetting{"prompt-list-share", "share of requests with a list of prompts",
                  &o.prompt_list_share},
      number("prompt-list-size", "prompts in such a list", &o.prompt_list_size, 1, 65536),
      number("output-tokens", "tokens Decode generates per prompt", &o.output_tokens, 0, 1u << 20),
      number("seed", "workload seed", &o.seed, 0, UINT64_MAX),
      number("timeout", "seconds a request may take", &o.timeout_s, 1, 7 * 86400),
  };
}

std::vector<DemoSetting> output_settings(DemoOptions& o) {
  DemoSetting timeline{"timeline",
                       "the engines record their timeline (the transfer figures, --trace); off "
                       "for long runs",
                       &o.timeline};
  timeline.negatable = true;
  return {
      text("trace", "write a Chrome trace-event timeline here", &o.trace_file),
      timeline,
      command_line_only(DemoSetting{"quiet", "print only failures", &o.quiet}),
  };
}

}  // namespace

std::vector<DemoSetting> demo_settings(DemoOptions& o) {
  std::vector<DemoSetting> all;
  for (auto section : {deployment_settings, model_settings, workload_settings, output_settings}) {
    auto settings = section(o);
    std::move(settings.begin(), settings.end(), std::back_inserter(all));
  }
  return all;
}

Status apply_demo_config_text(const std::string& text, const std::string& source, DemoOptions& o,
                              const std::function<bool(const std::string&)>& given) {
  const json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return invalid_argument("demo config " + source + " is not a JSON object");
  }
  const std::vector<DemoSetting> settings = demo_settings(o);
  for (const auto& [raw, value] : j.items()) {
    std::string key = raw;
    std::replace(key.begin(), key.end(), '_', '-');
    auto it = std::find_if(settings.begin(), settings.end(),
                           [&](const DemoSetting& s) { return s.in_config && s.name == key; });
    if (it == settings.end()) {
      return invalid_argument("demo config " + source + ": '" + raw + "' is not a demo setting");
    }
    if (http::nests_deeper_than(value, kMaxConfigNesting)) {
      return invalid_argument("demo config " + source + ": '" + raw +
                              "' nests lists and objects more than " +
                              std::to_string(kMaxConfigNesting) + " levels deep");
    }
    if (given(key)) continue;  // the command line wins
    if (Status st = take(*it, value, raw); !st) {
      return invalid_argument("demo config " + source + ": " + st.message());
    }
  }
  return Status::ok();
}

Status apply_demo_config(const std::string& path, DemoOptions& o,
                         const std::function<bool(const std::string&)>& given) {
  std::ifstream in(path);
  if (!in) return not_found("demo config " + path + " cannot be read");
  std::stringstream text;
  text << in.rdbuf();
  return apply_demo_config_text(text.str(), path, o, given);
}

}  // namespace rd2h::sim
