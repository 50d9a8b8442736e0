#include "rd2h/connector/config.h"

#include <algorithm>
#include <functional>
#include <nlohmann/json.hpp>
#include <type_traits>
#include <vector>

#include "control/curve.h"

namespace rd2h::connector {

using nlohmann::json;

Expected<std::string> RequestIdRule::to_external(std::string_view internal_id) const {
  if (suffix_chars == 0) return std::string(internal_id);
  if (internal_id.size() <= suffix_chars ||
      internal_id[internal_id.size() - suffix_chars] != separator) {
    return invalid_argument("request id '" + std::string(internal_id) + "' does not end in '" +
                            std::string(1, separator) + "' and " +
                            std::to_string(suffix_chars - 1) +
                            " characters, so it has no external id under the configured rule");
  }
  return std::string(internal_id.substr(0, internal_id.size() - suffix_chars));
}

namespace {

Status bad(const std::string& key, const std::string& why) {
  return invalid_argument("kv_transfer_config: '" + key + "' " + why);
}

Status read_string(const json& j, const std::string& key, std::string& out) {
  if (!j.is_string()) return bad(key, "must be a string");
  out = j.get<std::string>();
  return Status::ok();
}

Status read_int(const json& j, const std::string& key, int64_t lo, int64_t hi, int64_t& out) {
  if (!j.is_number_integer()) return bad(key, "must be an integer");
  out = j.get<int64_t>();
  if (out < lo || out > hi) {
    return bad(key, "is " + std::to_string(out) + ", outside " + std::to_string(lo) + ".." +
                        std::to_string(hi));
  }
  return Status::ok();
}

Status read_ms(const json& j, const std::string& key, std::chrono::milliseconds& out) {
  int64_t v = 0;
  RD2H_RETURN_IF_ERROR(read_int(j, key, 1, 24LL * 3600 * 1000, v));
  out = std::chrono::milliseconds(v);
  return Status::ok();
}

Status read_bool(const json& j, const std::string& key, bool& out) {
  if (!j.is_boolean()) return bad(key, "must be true or false");
  out = j.get<bool>();
  return Status::ok();
}

// How one setting is read into the config (`where` names it in errors), what type it
// takes, and how the config shows it (empty: to_json does not write it back).
struct Access {
  std::string type;
  std::function<Status(const json& value, const std::string& where, ConnectorConfig& c)> read;
  std::function<json(const ConnectorConfig& c)> show;
};

template <typename Field>
Access field(Field ConnectorConfig::*member) {
  Access a;
  if constexpr (std::is_same_v<Field, bool>) {
    a.type = "boolean";
    a.read = [member](const json& v, const std::string& where, ConnectorConfig& c) {
      return read_bool(v, where, c.*member);
    };
    a.show = [member](const ConnectorConfig& c) { return json(c.*member); };
  } else if constexpr (std::is_same_v<Field, std::string>) {
    a.type = "string";
    a.read = [member](const json& v, const std::string& where, ConnectorConfig& c) {
      return read_string(v, where, c.*member);
    };
    a.show = [member](const ConnectorConfig& c) { return json(c.*member); };
  } else if constexpr (std::is_same_v<Field, std::chrono::milliseconds>) {
    a.type = "milliseconds, 1 to 86400000";
    a.read = [member](const json& v, const std::string& where, ConnectorConfig& c) {
      return read_ms(v, where, c.*member);
    };
    a.show = [member](const ConnectorConfig& c) { return json((c.*member).count()); };
  } else {
    static_assert(sizeof(Field) == 0, "field() reads switches, strings and durations");
  }
  return a;
}

template <typename Int>
Access integer(Int ConnectorConfig::*member, int64_t lo, int64_t hi) {
  return {"integer, " + std::to_string(lo) + " to " + std::to_string(hi),
          [member, lo, hi](const json& v, const std::string& where, ConnectorConfig& c) {
            int64_t n = 0;
            RD2H_RETURN_IF_ERROR(read_int(v, where, lo, hi, n));
            c.*member = static_cast<Int>(n);
            return Status::ok();
          },
          [member](const ConnectorConfig& c) { return json(c.*member); }};
}

// "a, b or c", each choice between `quote`s.
std::string one_of(const std::vector<std::string>& choices, const std::string& quote) {
  std::string text;
  for (size_t i = 0; i < choices.size(); ++i) {
    text += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + quote + choices[i] + quote;
  }
  return text;
}

// A string setting that takes one of `choices`, read with `set` and shown with `get`.
Access choice(std::vector<std::string> choices,
              std::function<void(ConnectorConfig&, const std::string&)> set,
              std::function<std::string(const ConnectorConfig&)> get) {
  return {one_of(choices, "\""),
          [choices, set](const json& v, const std::string& where, ConnectorConfig& c) {
            std::string s;
            RD2H_RETURN_IF_ERROR(read_string(v, where, s));
            if (std::find(choices.begin(), choices.end(), s) == choices.end()) {
              return bad(where, "is '" + s + "', expected " + one_of(choices, ""));
            }
            set(c, s);
            return Status::ok();
          },
          [get](const ConnectorConfig& c) { return json(get(c)); }};
}

struct Setting {
  const char* name;
  const char* who;  // "Prefill", "Decode" or "both"
  const char* doc;
  Access access;
  bool required = false;
};

// The top-level keys the connector reads (vLLM's kv_transfer_config has many more, which it
// leaves to vLLM).
const std::vector<Setting>& top_settings() {
  static const std::vector<Setting> table = {
      {"kv_connector", "both",
       "The connector's name: \"Rd2hConnector\" (vLLM loads it from "
       "kv_connector_module_path \"rd2h.vllm\"); \"SfaRemoteD2HConnector\" and \"rd2h\" "
       "are accepted as the same.",
       choice(
           {"Rd2hConnector", "SfaRemoteD2HConnector", "rd2h"},
           [](ConnectorConfig&, const std::string&) {},
           [](const ConnectorConfig&) { return std::string("rd2h"); }),
       /*required=*/true},
      {"kv_role", "both", "\"kv_producer\" on Prefill, \"kv_consumer\" on Decode.",
       choice(
           {"kv_producer", "kv_consumer"},
           [](ConnectorConfig& c, const std::string& s) {
             c.role = s == "kv_producer" ? KvRole::kProducer : KvRole::kConsumer;
           },
           [](const ConnectorConfig& c) {
             return std::string(c.role == KvRole::kProducer ? "kv_producer" : "kv_consumer");
           }),
       /*required=*/true},
      {"kv_port", "both",
       "Decode binds kv_port + data_parallel_rank * tp_size + tp_rank on kv_ip, one port per "
       "rank. Required on Prefill too, where it is unused.",
       integer(&ConnectorConfig::kv_port, 1, 65535), /*required=*/true},
      {"engine_id", "both", "This engine's name in logs and messages.",
       field(&ConnectorConfig::engine_id)},
      {"kv_ip",
       "both",
       "The address Decode binds its control and data ports on and, unless kv_advertise_ip "
       "names another, advertises to Prefill. Off loopback the connector needs CURVE keys (or "
       "insecure).",
       {"string",
        [](const json& v, const std::string& where, ConnectorConfig& c) {
          return read_string(v, where, c.host);
        },
        [](const ConnectorConfig& c) { return json(c.host); }}},
  };
  return table;
}

// Every key of kv_connector_extra_config: the one table the connector reads, writes back
// and documents (config_reference()).
const std::vector<Setting>& settings() {
  static const std::vector<Setting> table = {
      {"kv_ip",
       "both",
       "The same as the top-level kv_ip, for hosts whose kv_transfer_config has no such field "
       "(vLLM 0.32). Given in both places, the two must agree.",
       {"string",
        [](const json& v, const std::string& where, ConnectorConfig& c) {
          return read_string(v, where, c.host);
        },
        nullptr}},
      {"transfer_backend", "both", "The transfer engine; this build has \"ucx\".",
       choice(
           {"ucx"}, [](ConnectorConfig& c, const std::string& s) { c.transfer_backend = s; },
           [](const ConnectorConfig& c) { return c.transfer_backend; })},
      {"transport", "both",
       "How KV bytes move: \"shm\" (shared memory, one host), \"tcp\", or \"auto\" (UCX "
       "picks: shared memory between processes of one host, else the network).",
       choice(
           {"shm", "tcp", "auto"},
           [](ConnectorConfig& c, const std::string& s) {
             c.transport = *transfer::parse_transport(s);
           },
           [](const ConnectorConfig& c) { return std::string(transfer::to_string(c.transport)); })},
      {"use_layerwise", "Prefill",
       "true: each layer is published the moment it is saved, and Decode reads it while later "
       "layers compute. false: every layer at once in wait_for_save (needs one physical buffer "
       "per layer).",
       field(&ConnectorConfig::use_layerwise)},
      {"request_id_suffix_chars",
       "both",
       "Characters the host engine appends to the request id it shares with the proxy "
       "(vLLM: \"-\" and 8 characters, so 9); 0: the ids are equal. An id without the suffix is "
       "an error, never cut blindly.",
       {"integer, 0 to 64",
        [](const json& v, const std::string& where, ConnectorConfig& c) {
          int64_t n = 0;
          RD2H_RETURN_IF_ERROR(read_int(v, where, 0, 64, n));
          c.request_ids.suffix_chars = static_cast<size_t>(n);
          return Status::ok();
        },
        [](const ConnectorConfig& c) { return json(c.request_ids.suffix_chars); }}},
      {"prefill_tp_size", "Decode",
       "The TP size of the Prefill instances this Decode serves, checked at start to be a "
       "multiple of Decode's; 0: not checked (each readiness carries its own count).",
       integer(&ConnectorConfig::prefill_tp_size, 0, 4096)},
      {"curve_secret_key_file",
       "both",
       "This engine's CURVE secret key file (`rd2h keygen STEM` writes STEM.key_secret). With "
       "keys the control channels are encrypted and admit only trusted peers; without them "
       "the connector runs on loopback addresses only.",
       {"string",
        [](const json& v, const std::string& where, ConnectorConfig& c) {
          return read_string(v, where, c.curve.secret_key_file);
        },
        [](const ConnectorConfig& c) { return json(c.curve.secret_key_file); }}},
      {"curve_trusted_keys_file",
       "both",
       "The public keys (STEM.key files' lines, one per line) of the peers this engine trusts: "
       "a Decode lists its Prefills, a Prefill its Decodes.",
       {"string",
        [](const json& v, const std::string& where, ConnectorConfig& c) {
          return read_string(v, where, c.curve.trusted_keys_file);
        },
        [](const ConnectorConfig& c) { return json(c.curve.trusted_keys_file); }}},
      {"kv_advertise_ip", "Decode",
       "The address Prefill is told to reach this Decode at (in its rendezvous), when that is "
       "not kv_ip: kv_ip a wildcard (0.0.0.0, ::) or an address behind NAT. Empty: kv_ip.",
       field(&ConnectorConfig::advertise_host)},
      {"insecure", "both",
       "true: run without CURVE keys on a non-loopback kv_ip (warned at start). For isolated "
       "networks only.",
       field(&ConnectorConfig::insecure)},
      {"metaserver_token_file", "Decode",
       "A file holding the bearer token Decode's rendezvous posts to the proxy carry (the "
       "proxy's --token-file); empty: the environment variable RD2H_TOKEN, if set.",
       field(&ConnectorConfig::metaserver_token_file)},
      {"on_peer_failure", "Prefill",
       "What a failing Decode (dead, stalled past reply_timeout_ms, refusing, unreachable) does "
       "to Prefill: \"fail\" fails only that Decode's requests and the engine serves on; "
       "\"raise\" makes wait_for_save raise, which ends a vLLM engine.",
       choice(
           {"fail", "raise"},
           [](ConnectorConfig& c, const std::string& s) { c.raise_on_peer_failure = s == "raise"; },
           [](const ConnectorConfig& c) {
             return std::string(c.raise_on_peer_failure ? "raise" : "fail");
           })},
      {"busy_poll_us", "Decode",
       "While a request is owed layers, Decode polls for the next one for up to this many "
       "microseconds after each layer instead of sleeping, so Prefill's compute thread does not "
       "pay for waking it. Costs Decode a CPU thread while transfers run; 0: Decode sleeps.",
       integer(&ConnectorConfig::busy_poll_us, 0, 1000000)},
      {"share_registered_memory", "Prefill",
       "true: registered KV memory moves into shared memory that Decode processes on the same "
       "host map and read without Prefill's help. false: it stays private, and such reads are "
       "answered by the Prefill process.",
       field(&ConnectorConfig::share_registered_memory)},
      {"control_link", "both",
       "true: readiness and answers travel on the transfer engine's own connection where both "
       "ends are rd2h. false: they stay on ZeroMQ.",
       field(&ConnectorConfig::control_link)},
      {"ack_timeout_ms", "Prefill",
       "How long Prefill waits for a Decode to connect and acknowledge a request's first "
       "message (MF_META). On a host that can freeze for seconds, raise it with "
       "connect_timeout_ms.",
       field(&ConnectorConfig::ack_timeout)},
      {"reply_timeout_ms", "Prefill",
       "How long Prefill waits for a Decode's answer to published layers before it counts that "
       "Decode as failed (on_peer_failure).",
       field(&ConnectorConfig::reply_timeout)},
      {"send_timeout_ms", "Prefill",
       "Bound on wait_for_layer_send, wait_for_save and the buffer-reuse wait of save_kv_layer.",
       field(&ConnectorConfig::send_timeout)},
      {"read_timeout_ms", "Decode", "Bound on one batched read of KV from a Prefill.",
       field(&ConnectorConfig::read_timeout)},
      {"connect_timeout_ms", "Decode", "Bound on a Decode's first connection to a Prefill.",
       field(&ConnectorConfig::connect_timeout)},
      {"hold_timeout_ms", "Decode",
       "How long a readiness naming a request Decode has not registered yet is held before it "
       "is refused.",
       field(&ConnectorConfig::hold_timeout)},
      {"event_timeout_ms", "Prefill",
       "How long Prefill waits for a layer's write event (the device copy into the buffer "
       "Decode reads) before the layer's requests fail.",
       field(&ConnectorConfig::event_timeout)},
      {"max_held", "Decode",
       "Readiness messages Decode holds, in all, for requests it has not registered yet (see "
       "hold_timeout_ms); a connection whose message finds no room is dropped.",
       integer(&ConnectorConfig::max_held, 1, 1 << 20)},
      {"max_held_per_peer", "Decode",
       "Of those, held for one Prefill connection, so that one Prefill cannot take every "
       "place.",
       integer(&ConnectorConfig::max_held_per_peer, 1, 1 << 20)},
      {"read_path", "both",
       "How the transfer engine reads: \"rma\" (one-sided gets), \"am\" (active messages "
       "the serving side answers), or \"auto\" (one-sided where the transport reads "
       "one-sided, else active messages).",
       choice(
           {"auto", "rma", "am"},
           [](ConnectorConfig& c, const std::string& s) {
             c.read_path = *transfer::parse_read_path(s);
           },
           [](const ConnectorConfig& c) { return std::string(transfer::to_string(c.read_path)); })},
      {"kv_arrival_timeout_ms", "Decode",
       "How long a Decode request waits for all of its KV; then its load fails (vLLM's "
       "kv_load_failure_policy decides what follows).",
       field(&ConnectorConfig::kv_arrival_timeout)},
      {"metaserver_timeout_ms", "Decode", "Bound on one rendezvous post to the proxy.",
       field(&ConnectorConfig::metaserver_timeout)},
      {"metaserver_attempts", "Decode",
       "Rendezvous posts tried (with a short backoff) before the post waits to be resubmitted.",
       integer(&ConnectorConfig::metaserver_attempts, 1, 100)},
      {"metaserver_resubmit_ms", "Decode",
       "How often an undelivered rendezvous post is resubmitted, until it is delivered, the "
       "request is cancelled or its KV arrival deadline passes.",
       field(&ConnectorConfig::metaserver_resubmit)},
  };
  return table;
}

Status read_extra(const json& extra, ConnectorConfig& c) {
  if (!extra.is_object()) return bad("kv_connector_extra_config", "must be an object");
  const auto& table = settings();
  for (const auto& item : extra.items()) {
    const std::string& key = item.key();
    const std::string where = "kv_connector_extra_config." + key;
    auto s =
        std::find_if(table.begin(), table.end(), [&](const Setting& s) { return s.name == key; });
    if (s == table.end()) return bad(where, "is not a setting of this connector");
    RD2H_RETURN_IF_ERROR(s->access.read(item.value(), where, c));
  }
  return Status::ok();
}

}  // namespace

Expected<ConnectorConfig> ConnectorConfig::from_json(std::string_view text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return invalid_argument("kv_transfer_config is not valid JSON");
  if (!j.is_object()) return invalid_argument("kv_transfer_config must be a JSON object");
  ConnectorConfig c;
  for (const Setting& s : top_settings()) {
    auto v = j.find(s.name);
    if (v == j.end() || v->is_null()) {
      if (s.required) return bad(s.name, "is missing");
      continue;
    }
    RD2H_RETURN_IF_ERROR(s.access.read(*v, s.name, c));
  }
  if (j.contains("kv_connector_extra_config") && !j["kv_connector_extra_config"].is_null()) {
    const json& extra = j["kv_connector_extra_config"];
    if (extra.is_object() && extra.contains("kv_ip") && j.contains("kv_ip") &&
        !j["kv_ip"].is_null() && extra["kv_ip"] != j["kv_ip"]) {
      return bad("kv_connector_extra_config.kv_ip",
                 "is " + extra["kv_ip"].dump() + " but kv_ip is " + j["kv_ip"].dump() +
                     ": give one");
    }
    RD2H_RETURN_IF_ERROR(read_extra(extra, c));
  }
  if (!c.curve.secret_key_file.empty() || !c.curve.trusted_keys_file.empty()) {
    RD2H_RETURN_IF_ERROR(c.load_curve_keys(c.curve.secret_key_file, c.curve.trusted_keys_file));
  }
  if (!c.advertise_host.empty() && control::is_wildcard_host(c.advertise_host)) {
    return bad("kv_connector_extra_config.kv_advertise_ip",
               "is '" + c.advertise_host +
                   "', a wildcard address: give the address Prefill reaches this Decode at");
  }
  if (c.role == KvRole::kConsumer && c.advertise_host.empty() &&
      control::is_wildcard_host(c.host)) {
    return bad("kv_ip", "is '" + c.host +
                            "', a wildcard address, which Prefill cannot be told to reach: give "
                            "kv_connector_extra_config.kv_advertise_ip, the address Prefill "
                            "reaches this Decode at");
  }
  if (!c.curve.enabled() && !c.insecure && !control::is_loopback_host(c.host)) {
    return bad("kv_ip", "is " + c.host +
                            ", not a loopback address: without CURVE keys "
                            "(kv_connector_extra_config.curve_secret_key_file and "
                            "curve_trusted_keys_file) the connector runs on loopback only; "
                            "\"insecure\": true runs it without them");
  }
  return c;
}

Status ConnectorConfig::load_curve_keys(std::string secret_key_file,
                                        std::string trusted_keys_file) {
  const std::string where = "kv_connector_extra_config.";
  if (secret_key_file.empty() || trusted_keys_file.empty()) {
    return bad(
        where + (secret_key_file.empty() ? "curve_secret_key_file" : "curve_trusted_keys_file"),
        "is missing: CURVE needs this engine's secret key file and its peers' public keys");
  }
  auto pair = control::read_secret_key_file(secret_key_file);
  if (!pair) return bad(where + "curve_secret_key_file", pair.status().message());
  auto trusted = control::read_public_keys_file(trusted_keys_file);
  if (!trusted) return bad(where + "curve_trusted_keys_file", trusted.status().message());
  curve.secret_key_file = std::move(secret_key_file);
  curve.trusted_keys_file = std::move(trusted_keys_file);
  curve.public_key = pair->public_key;
  curve.secret_key = pair->secret_key;
  curve.trusted = std::move(*trusted);
  return Status::ok();
}

std::string ConnectorConfig::to_json() const {
  json j = json::object();
  for (const Setting& s : top_settings()) j[s.name] = s.access.show(*this);
  json extra = json::object();
  for (const Setting& s : settings()) {
    if (s.access.show) extra[s.name] = s.access.show(*this);
  }
  j["kv_connector_extra_config"] = std::move(extra);
  return j.dump();
}

transfer::EngineConfig ConnectorConfig::engine_config(int device_id) const {
  transfer::EngineConfig ec;
  ec.role = role == KvRole::kProducer ? transfer::Role::kPrefill : transfer::Role::kDecode;
  ec.device_id = device_id;
  ec.transport = transport;
  ec.read_timeout = read_timeout;
  ec.connect_timeout = connect_timeout;
  ec.read_path = read_path;
  ec.listen_host = host;
  ec.share_registered = share_registered_memory;
  return ec;
}

std::vector<ConfigKey> config_reference() {
  const ConnectorConfig defaults;
  std::vector<ConfigKey> keys;
  auto add = [&](const Setting& s, const std::string& section) {
    // A key without a value of its own (the extra kv_ip) follows the top-level one.
    const bool literal = !s.required && s.access.show;
    const std::string value = s.required ? "required"
                              : literal  ? s.access.show(defaults).dump()
                                         : "the top-level " + std::string(s.name);
    keys.push_back({s.name, section, s.access.type, value, literal, s.who, s.doc});
  };
  for (const Setting& s : top_settings()) add(s, "");
  for (const Setting& s : settings()) add(s, "kv_connector_extra_config");
  return keys;
}

}  // namespace rd2h::connector
