#include "rd2h/connector/config.h"

#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <type_traits>

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

// How one key of kv_connector_extra_config is read into the config; `where` names the key
// in errors.
using ExtraReader =
    std::function<Status(const json& value, const std::string& where, ConnectorConfig& c)>;

template <typename Field>
ExtraReader into(Field ConnectorConfig::*field) {
  return [field](const json& value, const std::string& where, ConnectorConfig& c) -> Status {
    if constexpr (std::is_same_v<Field, bool>)
      return read_bool(value, where, c.*field);
    else if constexpr (std::is_same_v<Field, std::string>)
      return read_string(value, where, c.*field);
    else if constexpr (std::is_same_v<Field, std::chrono::milliseconds>)
      return read_ms(value, where, c.*field);
    else
      static_assert(sizeof(Field) == 0, "into() reads switches, strings and durations");
  };
}

template <typename Int>
ExtraReader integer(Int ConnectorConfig::*field, int64_t lo, int64_t hi) {
  return [field, lo, hi](const json& value, const std::string& where, ConnectorConfig& c) {
    int64_t v = 0;
    RD2H_RETURN_IF_ERROR(read_int(value, where, lo, hi, v));
    c.*field = static_cast<Int>(v);
    return Status::ok();
  };
}

const std::map<std::string, ExtraReader>& extra_readers() {
  static const std::map<std::string, ExtraReader> readers = {
      {"transfer_backend",
       [](const json& value, const std::string& where, ConnectorConfig& c) -> Status {
         RD2H_RETURN_IF_ERROR(read_string(value, where, c.transfer_backend));
         if (c.transfer_backend == "ucx") return Status::ok();
         return bad(where, "is '" + c.transfer_backend + "'; this build has the 'ucx' backend");
       }},
      {"transport",
       [](const json& value, const std::string& where, ConnectorConfig& c) -> Status {
         std::string t;
         RD2H_RETURN_IF_ERROR(read_string(value, where, t));
         auto parsed = transfer::parse_transport(t);
         if (!parsed) return bad(where, "is '" + t + "', expected shm, tcp or auto");
         c.transport = *parsed;
         return Status::ok();
       }},
      {"request_id_suffix_chars",
       [](const json& value, const std::string& where, ConnectorConfig& c) {
         int64_t v = 0;
         RD2H_RETURN_IF_ERROR(read_int(value, where, 0, 64, v));
         c.request_ids.suffix_chars = static_cast<size_t>(v);
         return Status::ok();
       }},
      {"curve_secret_key_file",
       [](const json& value, const std::string& where, ConnectorConfig& c) {
         return read_string(value, where, c.curve.secret_key_file);
       }},
      {"curve_trusted_keys_file",
       [](const json& value, const std::string& where, ConnectorConfig& c) {
         return read_string(value, where, c.curve.trusted_keys_file);
       }},
      {"use_layerwise", into(&ConnectorConfig::use_layerwise)},
      {"prefill_tp_size", integer(&ConnectorConfig::prefill_tp_size, 1, 4096)},
      {"metaserver_attempts", integer(&ConnectorConfig::metaserver_attempts, 1, 100)},
      {"busy_poll_us", integer(&ConnectorConfig::busy_poll_us, 0, 1000000)},
      {"on_peer_failure",
       [](const json& value, const std::string& where, ConnectorConfig& c) -> Status {
         std::string v;
         RD2H_RETURN_IF_ERROR(read_string(value, where, v));
         if (v != "fail" && v != "raise") return bad(where, "is '" + v + "', expected fail or raise");
         c.raise_on_peer_failure = v == "raise";
         return Status::ok();
       }},
      {"ack_timeout_ms", into(&ConnectorConfig::ack_timeout)},
      {"reply_timeout_ms", into(&ConnectorConfig::reply_timeout)},
      {"send_timeout_ms", into(&ConnectorConfig::send_timeout)},
      {"read_timeout_ms", into(&ConnectorConfig::read_timeout)},
      {"connect_timeout_ms", into(&ConnectorConfig::connect_timeout)},
      {"hold_timeout_ms", into(&ConnectorConfig::hold_timeout)},
      {"kv_arrival_timeout_ms", into(&ConnectorConfig::kv_arrival_timeout)},
      {"metaserver_timeout_ms", into(&ConnectorConfig::metaserver_timeout)},
      {"metaserver_resubmit_ms", into(&ConnectorConfig::metaserver_resubmit)},
      {"share_registered_memory", into(&ConnectorConfig::share_registered_memory)},
      {"control_link", into(&ConnectorConfig::control_link)},
      {"insecure", into(&ConnectorConfig::insecure)},
      {"metaserver_token_file", into(&ConnectorConfig::metaserver_token_file)},
      // vLLM 0.32's KVTransferConfig has no kv_ip field: there it is an extra setting.
      {"kv_ip",
       [](const json& value, const std::string& where, ConnectorConfig& c) {
         return read_string(value, where, c.host);
       }},
  };
  return readers;
}

Status read_extra(const json& extra, ConnectorConfig& c) {
  if (!extra.is_object()) return bad("kv_connector_extra_config", "must be an object");
  const auto& readers = extra_readers();
  for (const auto& [key, value] : extra.items()) {
    const std::string where = "kv_connector_extra_config." + key;
    auto reader = readers.find(key);
    if (reader == readers.end()) return bad(where, "is not a setting of this connector");
    RD2H_RETURN_IF_ERROR(reader->second(value, where, c));
  }
  return Status::ok();
}

}  // namespace

Expected<ConnectorConfig> ConnectorConfig::from_json(std::string_view text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return invalid_argument("kv_transfer_config is not valid JSON");
  if (!j.is_object()) return invalid_argument("kv_transfer_config must be a JSON object");
  ConnectorConfig c;
  std::string connector;
  if (!j.contains("kv_connector")) return bad("kv_connector", "is missing");
  RD2H_RETURN_IF_ERROR(read_string(j["kv_connector"], "kv_connector", connector));
  if (connector != "SfaRemoteD2HConnector" && connector != "Rd2hConnector" && connector != "rd2h") {
    return bad("kv_connector",
               "is '" + connector + "', expected Rd2hConnector, SfaRemoteD2HConnector or rd2h");
  }
  std::string role;
  if (!j.contains("kv_role")) return bad("kv_role", "is missing");
  RD2H_RETURN_IF_ERROR(read_string(j["kv_role"], "kv_role", role));
  if (role == "kv_producer") {
    c.role = KvRole::kProducer;
  } else if (role == "kv_consumer") {
    c.role = KvRole::kConsumer;
  } else {
    return bad("kv_role", "is '" + role + "', expected kv_producer or kv_consumer");
  }
  if (!j.contains("kv_port")) return bad("kv_port", "is missing");
  int64_t port = 0;
  RD2H_RETURN_IF_ERROR(read_int(j["kv_port"], "kv_port", 1, 65535, port));
  c.kv_port = static_cast<int>(port);
  if (j.contains("engine_id") && !j["engine_id"].is_null()) {
    RD2H_RETURN_IF_ERROR(read_string(j["engine_id"], "engine_id", c.engine_id));
  }
  if (j.contains("kv_ip") && !j["kv_ip"].is_null()) {
    RD2H_RETURN_IF_ERROR(read_string(j["kv_ip"], "kv_ip", c.host));
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
  json extra = {{"transfer_backend", transfer_backend},
                {"transport", std::string(transfer::to_string(transport))},
                {"use_layerwise", use_layerwise},
                {"request_id_suffix_chars", request_ids.suffix_chars},
                {"metaserver_attempts", metaserver_attempts},
                {"busy_poll_us", busy_poll_us},
                {"ack_timeout_ms", ack_timeout.count()},
                {"reply_timeout_ms", reply_timeout.count()},
                {"send_timeout_ms", send_timeout.count()},
                {"read_timeout_ms", read_timeout.count()},
                {"connect_timeout_ms", connect_timeout.count()},
                {"hold_timeout_ms", hold_timeout.count()},
                {"kv_arrival_timeout_ms", kv_arrival_timeout.count()},
                {"metaserver_timeout_ms", metaserver_timeout.count()},
                {"metaserver_resubmit_ms", metaserver_resubmit.count()}};
  if (prefill_tp_size > 0) extra["prefill_tp_size"] = prefill_tp_size;
  if (!curve.secret_key_file.empty()) extra["curve_secret_key_file"] = curve.secret_key_file;
  if (!curve.trusted_keys_file.empty()) extra["curve_trusted_keys_file"] = curve.trusted_keys_file;
  if (insecure) extra["insecure"] = true;
  if (!share_registered_memory) extra["share_registered_memory"] = false;
  if (!control_link) extra["control_link"] = false;
  if (raise_on_peer_failure) extra["on_peer_failure"] = "raise";
  if (!metaserver_token_file.empty()) extra["metaserver_token_file"] = metaserver_token_file;
  json j = {{"kv_connector", "rd2h"},
            {"kv_role", role == KvRole::kProducer ? "kv_producer" : "kv_consumer"},
            {"kv_port", kv_port},
            {"engine_id", engine_id},
            {"kv_ip", host},
            {"kv_connector_extra_config", extra}};
  return j.dump();
}

}  // namespace rd2h::connector
