#include "rd2h/connector/metadata.h"

#include <cstring>
#include <nlohmann/json.hpp>
#include <type_traits>
#include <utility>

#include "protocol/messages.h"
#include "util/json_number.h"

namespace rd2h::connector {

using nlohmann::ordered_json;

namespace {

// A list of integers, each an int64.
bool whole_list(const ordered_json& v, std::vector<int64_t>& out) {
  if (!v.is_array()) return false;
  out.resize(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    if (!whole_number(v[i], out[i])) return false;
  }
  return true;
}

// Reads `key` of `j` into `out` when present (and not null); a wrong type names the key.
template <typename T>
Status field(const ordered_json& j, const char* key, T& out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::ok();
  auto wrong = [&] {
    return invalid_argument(std::string("kv_transfer_params: '") + key + "' has the wrong type");
  };
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    if (!it->is_number_integer()) return wrong();
    if (!whole_number(*it, out)) {
      return invalid_argument(std::string("kv_transfer_params: '") + key + "' " + it->dump() +
                              " is out of range");
    }
  } else {
    try {
      out = it->get<T>();
    } catch (const std::exception&) {
      return wrong();
    }
  }
  return Status::ok();
}

Expected<KvTransferParams> from_object(const ordered_json& j, int depth) {
  if (!j.is_object()) return invalid_argument("kv_transfer_params must be a JSON object");
  KvTransferParams p;
  RD2H_RETURN_IF_ERROR(field(j, "do_remote_prefill", p.do_remote_prefill));
  RD2H_RETURN_IF_ERROR(field(j, "do_remote_decode", p.do_remote_decode));
  RD2H_RETURN_IF_ERROR(field(j, "metaserver", p.metaserver));
  RD2H_RETURN_IF_ERROR(field(j, "virtual", p.is_virtual));
  // The existing connector's spelling: either one set makes the request virtual.
  bool do_virtual = false;
  RD2H_RETURN_IF_ERROR(field(j, "do_virtual", do_virtual));
  p.is_virtual = p.is_virtual || do_virtual;
  RD2H_RETURN_IF_ERROR(field(j, "request_id", p.request_id));
  RD2H_RETURN_IF_ERROR(field(j, "remote_engine_id", p.remote_engine_id));
  RD2H_RETURN_IF_ERROR(field(j, "remote_host", p.remote_host));
  RD2H_RETURN_IF_ERROR(field(j, "remote_port", p.remote_port));
  RD2H_RETURN_IF_ERROR(field(j, "remote_tp_size", p.remote_tp_size));
  RD2H_RETURN_IF_ERROR(field(j, "remote_pcp_size", p.remote_pcp_size));
  RD2H_RETURN_IF_ERROR(field(j, "remote_dcp_size", p.remote_dcp_size));
  RD2H_RETURN_IF_ERROR(field(j, "remote_cached_tokens", p.remote_cached_tokens));
  RD2H_RETURN_IF_ERROR(field(j, "remote_public_key", p.remote_public_key));
  if (p.remote_port < 0 || p.remote_port > 65535) {
    return invalid_argument("kv_transfer_params: 'remote_port' " + std::to_string(p.remote_port) +
                            " is outside 0..65535");
  }
  for (int* size : {&p.remote_tp_size, &p.remote_pcp_size, &p.remote_dcp_size}) {
    if (*size < 1) return invalid_argument("kv_transfer_params: a remote parallel size is below 1");
  }
  auto batch = j.find("batch_kv_transfer_params");
  if (batch != j.end() && !batch->is_null()) {
    if (depth > 0 || !batch->is_object()) {
      return invalid_argument(
          "kv_transfer_params: 'batch_kv_transfer_params' must be an object "
          "of child ids at the top level");
    }
    for (const auto& [child, params] : batch->items()) {
      auto c = from_object(params, depth + 1);
      if (!c) return c.status().with_context("child " + child);
      p.batch.push_back({child, std::move(*c)});
    }
  }
  return p;
}

}  // namespace

Expected<KvTransferParams> KvTransferParams::from_json(std::string_view text) {
  auto j = ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return invalid_argument("kv_transfer_params is not valid JSON");
  return from_object(j, 0);
}

std::string KvTransferParams::rendezvous_json() const {
  ordered_json j;
  j["request_id"] = request_id;
  j["do_remote_prefill"] = false;
  j["do_remote_decode"] = true;
  j["remote_engine_id"] = remote_engine_id;
  j["remote_host"] = remote_host;
  j["remote_port"] = remote_port;
  j["remote_tp_size"] = remote_tp_size;
  j["remote_pcp_size"] = remote_pcp_size;
  j["remote_dcp_size"] = remote_dcp_size;
  j["remote_cached_tokens"] = remote_cached_tokens;
  if (!remote_public_key.empty()) j["remote_public_key"] = remote_public_key;
  return j.dump();
}

Expected<KvTransferParams> KvTransferParams::for_request(const std::string& ext_id) const {
  if (batch.empty()) return *this;
  for (const auto& [child, params] : batch) {
    if (child == ext_id) return params;
  }
  return not_found("prompt list child '" + ext_id + "' is missing from batch_kv_transfer_params (" +
                   std::to_string(batch.size()) + " children)");
}

std::vector<std::byte> encode(const ConnectorMetadata& m) {
  ordered_json j;
  j["load"] = ordered_json::array();
  for (const auto& r : m.load) {
    j["load"].push_back({r.ext_id, r.internal_id, r.main_blocks, r.indexer_blocks});
  }
  j["abort"] = m.abort;
  j["save"] = ordered_json::array();
  for (const auto& s : m.save) {
    j["save"].push_back({s.ext_id, s.d_host, s.d_base_port, s.d_tp, s.main_block_ids,
                         s.indexer_block_ids, s.main_start, s.indexer_start, s.final_chunk,
                         s.d_public_key});
  }
  const auto bytes = ordered_json::to_msgpack(j);
  std::vector<std::byte> out(bytes.size());
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

Expected<ConnectorMetadata> decode_metadata(std::span<const std::byte> bytes) {
  // nlohmann's msgpack reader recurses once per level: the nesting is checked first.
  RD2H_RETURN_IF_ERROR(
      protocol::check_msgpack_bounds(bytes, protocol::kMaxNestingDepth, "connector metadata"));
  auto j = ordered_json::from_msgpack(reinterpret_cast<const uint8_t*>(bytes.data()),
                                      reinterpret_cast<const uint8_t*>(bytes.data()) + bytes.size(),
                                      /*strict=*/true, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return invalid_argument("connector metadata: not a msgpack map");
  }
  ConnectorMetadata m;
  try {
    for (const auto& r : j.at("load")) {
      if (!r.is_array() || r.size() != 4)
        return invalid_argument("connector metadata: a load entry is not 4 fields");
      LoadRequest l{r[0].get<std::string>(), r[1].get<std::string>(), {}, {}};
      if (!whole_list(r[2], l.main_blocks) || !whole_list(r[3], l.indexer_blocks)) {
        return invalid_argument("connector metadata: load " + l.ext_id +
                                ": block ids are not a list of integers");
      }
      m.load.push_back(std::move(l));
    }
    m.abort = j.at("abort").get<std::vector<std::string>>();
    for (const auto& s : j.at("save")) {
      if (!s.is_array() || s.size() != 10)
        return invalid_argument("connector metadata: a save entry is not 10 fields");
      prefill::SendRequest q;
      q.ext_id = s[0].get<std::string>();
      q.d_host = s[1].get<std::string>();
      if (!whole_number(s[2], q.d_base_port) || !whole_number(s[3], q.d_tp) ||
          !whole_list(s[4], q.main_block_ids) || !whole_list(s[5], q.indexer_block_ids) ||
          !whole_number(s[6], q.main_start) || !whole_number(s[7], q.indexer_start)) {
        return invalid_argument("connector metadata: save " + q.ext_id +
                                ": a port, size, block id or start is not an integer in range");
      }
      q.final_chunk = s[8].get<bool>();
      q.d_public_key = s[9].get<std::string>();
      m.save.push_back(std::move(q));
    }
  } catch (const std::exception& e) {
    return invalid_argument(std::string("connector metadata: ") + e.what());
  }
  return m;
}

}  // namespace rd2h::connector
