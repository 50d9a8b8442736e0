#include <algorithm>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "sim/demo_parts.h"

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

// A whole number from `lo` to `hi` (JSON integers only: 1.5, 1e59, "7" and -1 for an
// unsigned setting are refused), or why not, naming the key.
template <typename T>
Status whole(const json& v, const std::string& key, uint64_t lo, uint64_t hi, T& out) {
  auto refuse = [&] {
    return invalid_argument("'" + key + "' must be a whole number from " + std::to_string(lo) +
                            " to " + std::to_string(hi) + ", not " + v.dump());
  };
  if (!v.is_number_integer()) return refuse();
  if (!v.is_number_unsigned() && v.get<int64_t>() < 0) return refuse();
  const uint64_t n = v.get<uint64_t>();
  if (n < lo || n > hi) return refuse();
  out = static_cast<T>(n);
  return Status::ok();
}

Status string_value(const json& v, const std::string& key, std::string& out) {
  if (!v.is_string()) return invalid_argument("'" + key + "' must be a string, not " + v.dump());
  out = v.get<std::string>();
  return Status::ok();
}

}  // namespace

Status apply_demo_config_text(const std::string& text, const std::string& source, DemoOptions& o,
                              const std::function<bool(const std::string&)>& given) {
  const json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return invalid_argument("demo config " + source + " is not a JSON object");
  }
  constexpr uint64_t kU32 = UINT32_MAX;
  using Setter = std::function<Status(const json&, const std::string&)>;
  auto number = [](auto& field, uint64_t lo, uint64_t hi) -> Setter {
    return [&field, lo, hi](const json& v, const std::string& key) {
      return whole(v, key, lo, hi, field);
    };
  };
  auto str = [](std::string& field) -> Setter {
    return [&field](const json& v, const std::string& key) { return string_value(v, key, field); };
  };
  const std::map<std::string, Setter> setters = {
      {"prefill-tp", number(o.prefill_tp, 1, 64)},
      {"decode-tp", number(o.decode_tp, 1, 64)},
      {"dp", number(o.dp, 1, 16)},
      {"host", str(o.host)},
      {"prefill-host", str(o.prefill_host)},
      {"decode-host", str(o.decode_host)},
      {"proxy-port", number(o.proxy_port, 0, 65535)},
      {"metaserver-port", number(o.metaserver_port, 0, 65535)},
      {"kv-port", number(o.kv_port, 0, 65535)},
      {"transport",
       [&](const json& v, const std::string& key) {
         if (!v.is_string() || (v != "shm" && v != "tcp" && v != "auto")) {
           return invalid_argument("'" + key + "' must be \"shm\", \"tcp\" or \"auto\", not " +
                                   v.dump());
         }
         o.transport = v.get<std::string>();
         return Status::ok();
       }},
      {"layers", number(o.layers, 1, 1024)},
      {"block-size", number(o.block_size, 1, 1u << 20)},
      {"bytes-per-token",
       [&](const json& v, const std::string& key) {
         if (!v.is_array() || v.size() < 2 || v.size() > 4) {
           return invalid_argument("'" + key +
                                   "' must be a list of 2 to 4 whole numbers (K, V, indexer[, "
                                   "scale]), not " +
                                   v.dump());
         }
         std::vector<uint64_t> sizes(v.size());
         for (size_t i = 0; i < v.size(); ++i) {
           if (Status st = whole(v[i], key + "[" + std::to_string(i) + "]", 1, 1u << 24, sizes[i]);
               !st) {
             return st;
           }
         }
         o.bytes_per_token = std::move(sizes);
         return Status::ok();
       }},
      {"num-blocks", number(o.num_blocks, 1, 1u << 24)},
      {"slots", number(o.slots, 0, 1024)},
      {"token-budget", number(o.token_budget, 1, kU32)},
      {"compute-ns-per-token", number(o.compute_ns_per_token, 0, 1'000'000'000)},
      {"compute-min-layer-us", number(o.compute_min_layer_us, 0, 60'000'000)},
      {"requests", number(o.requests, 1, 100'000'000)},
      {"min-tokens", number(o.min_tokens, 1, 1u << 30)},
      {"max-tokens", number(o.max_tokens, 1, 1u << 30)},
      {"concurrency", number(o.concurrency, 1, 65536)},
      {"prompt-list-share",
       [&](const json& v, const std::string& key) {
         if (!v.is_number() || !(v.get<double>() >= 0.0 && v.get<double>() <= 1.0)) {
           return invalid_argument("'" + key + "' must be a number from 0 to 1, not " + v.dump());
         }
         o.prompt_list_share = v.get<double>();
         return Status::ok();
       }},
      {"prompt-list-size", number(o.prompt_list_size, 1, 65536)},
      {"output-tokens", number(o.output_tokens, 0, 1u << 20)},
      {"seed", number(o.seed, 0, UINT64_MAX)},
      {"timeout", number(o.timeout_s, 1, 7 * 86400)},
      {"trace", str(o.trace_file)},
      {"timeline",
       [&](const json& v, const std::string& key) {
         if (!v.is_boolean()) return invalid_argument("'" + key + "' must be true or false");
         o.timeline = v.get<bool>();
         return Status::ok();
       }},
  };
  for (const auto& [raw, value] : j.items()) {
    std::string key = raw;
    std::replace(key.begin(), key.end(), '_', '-');
    auto it = setters.find(key);
    if (it == setters.end()) {
      return invalid_argument("demo config " + source + ": '" + raw + "' is not a demo setting");
    }
    if (given(key)) continue;  // the command line wins
    if (Status st = it->second(value, raw); !st) {
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
