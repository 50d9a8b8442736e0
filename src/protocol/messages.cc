// The decoders of the control-plane messages, every one a single pass of the in-place cursor
// over its bytes, each field checked; the ACK, and the version check of MF_META.
#include "protocol/messages.h"

#include <algorithm>
#include <cstring>

#include "protocol/message_tags.h"
#include "protocol/msgpack_cursor.h"

namespace rd2h::protocol {

namespace {

// ---- decoding ----

std::string at(size_t i) {
  return "message[" + std::to_string(i) + "]";
}

Expected<std::vector<uint64_t>> uints(Cursor& c, const std::string& path) {
  RD2H_TRY(n, c.array([&] { return path; }, 0, kMaxTensorsPerLayer));
  std::vector<uint64_t> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    RD2H_TRY(v, c.unsigned_int([&] { return path + "[" + std::to_string(i) + "]"; }));
    out.push_back(v);
  }
  return out;
}

// A layer's tensors agree with each other: as many entries in every array, main tensors
// and the indexer among them, bytes per block within bounds.
Status check_layer_meta(const std::string& path, const LayerMeta& m) {
  auto error = [&](const std::string& what) { return invalid_argument(path + ": " + what); };
  const size_t n = m.base_addrs.size();
  if (m.block_len.size() != n || m.block_size_scale.size() != n || m.tensor_group_idx.size() != n) {
    return error("base_addrs, block_len, block_size_scale and tensor_group_idx have " +
                 std::to_string(n) + ", " + std::to_string(m.block_len.size()) + ", " +
                 std::to_string(m.block_size_scale.size()) + " and " +
                 std::to_string(m.tensor_group_idx.size()) + " entries; they must match");
  }
  if (m.main_tensor_count == 0 || m.main_tensor_count > n) {
    return error("main_tensor_count " + std::to_string(m.main_tensor_count) + " with " +
                 std::to_string(n) + " tensors");
  }
  if (m.has_indexer && m.main_tensor_count == n) {
    return error("has_indexer is set but there is no tensor after the " +
                 std::to_string(m.main_tensor_count) + " main ones");
  }
  for (size_t i = 0; i < n; ++i) {
    if (m.block_len[i] == 0 || m.block_size_scale[i] == 0) {
      return error("tensor " + std::to_string(i) + " has zero bytes per block");
    }
    if (m.block_len[i] > (uint64_t{1} << 40) / m.block_size_scale[i]) {
      return error("tensor " + std::to_string(i) + " bytes per block overflow");
    }
  }
  return Status::ok();
}

// One layer's entry of MF_META's layer map (a map of named fields), at `path`.
Expected<LayerMeta> cursor_layer_meta(Cursor& c, const std::string& path) {
  RD2H_TRY(fields, c.map([&] { return path; }, 64));
  LayerMeta m;
  uint32_t seen = 0;
  for (size_t i = 0; i < fields; ++i) {
    RD2H_TRY(name_view, c.str([&] { return path + " key"; }, 64));
    const std::string name(name_view);
    const std::string where = path + "." + name;
    // The four per-tensor arrays, in wire order; each sets one bit of `seen`.
    static constexpr std::pair<std::string_view, std::vector<uint64_t> LayerMeta::*> kArrays[] = {
        {"base_addrs", &LayerMeta::base_addrs},
        {"block_len", &LayerMeta::block_len},
        {"block_size_scale", &LayerMeta::block_size_scale},
        {"tensor_group_idx", &LayerMeta::tensor_group_idx},
    };
    auto array = std::find_if(std::begin(kArrays), std::end(kArrays),
                              [&](const auto& a) { return a.first == name; });
    if (array != std::end(kArrays)) {
      RD2H_TRY(v, uints(c, where));
      m.*(array->second) = std::move(v);
      seen |= 1u << (array - std::begin(kArrays));
    } else if (name == "main_tensor_count") {
      RD2H_TRY(v, c.unsigned_int([&] { return where; }));
      m.main_tensor_count = v;
      seen |= 16;
    } else if (name == "has_indexer") {
      RD2H_TRY(v, c.boolean([&] { return where; }));
      m.has_indexer = v;
      seen |= 32;
    } else if (!c.skip_values(1)) {  // unknown keys: a newer peer's additions
      return c.truncated();
    }
  }
  if ((seen & 3) != 3) return invalid_argument(path + ": missing base_addrs or block_len");
  // The rest may be left out, as the existing connector reads them: no scaled blocks, one
  // group, K and V as the main tensors, an indexer if there are more tensors than those.
  const size_t n = m.base_addrs.size();
  if ((seen & 4) == 0) m.block_size_scale.assign(m.block_len.size(), 1);
  if ((seen & 8) == 0) m.tensor_group_idx.assign(n, 0);
  if ((seen & 16) == 0) m.main_tensor_count = 2;
  if ((seen & 32) == 0) m.has_indexer = n > m.main_tensor_count;
  RD2H_RETURN_IF_ERROR(check_layer_meta(path, m));
  return m;
}

// MF_META after its tag: the session, the layer map (a msgpack value of its own inside a
// bin), then the fields rd2h appends.
Expected<MfMeta> cursor_mf_meta(Cursor& c, size_t fields) {
  if (fields < 3) {
    return invalid_argument("MF_META: " + std::to_string(fields) +
                            " elements, expected at least 3");
  }
  MfMeta m;
  RD2H_TRY(session, c.str([] { return at(1); }, kMaxStringBytes));
  m.p_session = std::string(session);
  RD2H_TRY(map_bytes, c.bin([] { return at(2); }));
  const auto layer_map = std::as_bytes(std::span(map_bytes.data(), map_bytes.size()));
  const std::string what = "MF_META layer map";
  RD2H_RETURN_IF_ERROR(check_msgpack_bounds(layer_map, kTreeDepth, what));
  Cursor map(layer_map);
  map.set_what(what);
  RD2H_TRY(layers, map.map([&] { return what; }, kMaxLayers));
  for (size_t i = 0; i < layers; ++i) {
    RD2H_TRY(name, map.str([&] { return what + " key"; }, 1024));
    RD2H_TRY(meta, cursor_layer_meta(map, "MF_META layer " + std::string(name)));
    m.layers.emplace_back(std::string(name), std::move(meta));
  }
  if (fields > 3) {
    RD2H_TRY(v, c.unsigned_int([] { return at(3); }));
    m.protocol_version = v;
  }
  if (fields > 4) {
    RD2H_TRY(v, c.unsigned_int([] { return at(4); }));
    m.cache_layout_version = v;
  }
  if (fields > 5) {
    RD2H_TRY(v, c.str([] { return at(5); }, 256));
    m.backend_name = std::string(v);
  }
  if (fields > 6) {
    RD2H_TRY(v, c.bin([] { return at(6); }));
    const auto* p = reinterpret_cast<const std::byte*>(v.data());
    m.backend_metadata.assign(p, p + v.size());
  }
  if (fields > 7) {
    RD2H_TRY(v, c.unsigned_int([] { return at(7); }));
    m.control_link = v;
  }
  if (fields > 8 && !c.skip_values(fields - 8)) return c.truncated();
  return m;
}

// ---- streaming decoding ----

// Block ids of one list, counted against the readiness' total.
Expected<std::vector<int64_t>> cursor_block_ids(Cursor& c, size_t req, size_t field,
                                                size_t& total) {
  auto where = [&] {
    return at(3) + "[" + std::to_string(req) + "][" + std::to_string(field) + "]";
  };
  RD2H_TRY(n, c.array(where, 0, SIZE_MAX));
  if (n > kMaxBlockIdsPerRequest) {
    return invalid_argument(where() + ": " + std::to_string(n) + " block ids exceed the limit of " +
                            std::to_string(kMaxBlockIdsPerRequest) + " per request");
  }
  total += n;
  if (total > kMaxBlockIdsPerReadiness) {
    return invalid_argument(where() + ": more than " + std::to_string(kMaxBlockIdsPerReadiness) +
                            " block ids in one readiness (the limit)");
  }
  std::vector<int64_t> ids(n);
  for (size_t k = 0; k < n; ++k) {
    auto item = [&] { return where() + "[" + std::to_string(k) + "]"; };
    RD2H_TRY(id, c.integer(item, 0, kMaxBlockId));
    ids[k] = id;
  }
  return ids;
}

Expected<ReadReq> cursor_read_req(Cursor& c, size_t i, size_t& total) {
  auto where = [&] { return at(3) + "[" + std::to_string(i) + "]"; };
  RD2H_TRY(n, c.array(where, 2, 5));
  ReadReq r;
  RD2H_TRY(ext_id, c.str([&] { return where() + "[0]"; }, kMaxExtIdBytes));
  r.ext_id = std::string(ext_id);
  RD2H_TRY(main, cursor_block_ids(c, i, 1, total));
  r.main_block_ids = std::move(main);
  if (n == 2) {
    total += r.main_block_ids.size();  // legacy: one list for main and indexer
    if (total > kMaxBlockIdsPerReadiness) {
      return invalid_argument(where() + ": more than " + std::to_string(kMaxBlockIdsPerReadiness) +
                              " block ids in one readiness (the limit)");
    }
    r.indexer_block_ids = r.main_block_ids;
    return r;
  }
  RD2H_TRY(indexer, cursor_block_ids(c, i, 2, total));
  r.indexer_block_ids = std::move(indexer);
  if (n > 3) {  // a 4-field entry gives the main offset; the indexer's stays 0
    RD2H_TRY(start, c.integer([&] { return where() + "[3]"; }, 0, kMaxBlockId));
    r.main_start = start;
  }
  if (n > 4) {
    RD2H_TRY(start, c.integer([&] { return where() + "[4]"; }, 0, kMaxBlockId));
    r.indexer_start = start;
  }
  return r;
}

// READ_READY_BATCH after its tag, straight from the bytes: the one message that can be large
// (kMaxReadReqs requests, kMaxBlockIdsPerReadiness block ids), so it is decoded in one pass
// into its final form without an intermediate object per element.
Expected<ReadReadyBatch> cursor_read_ready_batch(Cursor& c, size_t fields) {
  if (fields < 4) {
    return invalid_argument("READ_READY_BATCH: " + std::to_string(fields) +
                            " elements, expected at least 4");
  }
  ReadReadyBatch m;
  RD2H_TRY(layer, c.integer([] { return at(1); }, 0, kMaxLayerIndex));
  m.layer_idx = layer;
  RD2H_TRY(name, c.str([] { return at(2); }, 1024));
  m.layer_name = std::string(name);
  RD2H_TRY(reqs, c.array([] { return at(3); }, 0, SIZE_MAX));
  if (reqs > kMaxReadReqs) {
    return invalid_argument(at(3) + ": " + std::to_string(reqs) +
                            " read requests exceed the limit of " + std::to_string(kMaxReadReqs) +
                            " per readiness");
  }
  // The smallest read request, [str "", []], is 3 bytes: a count the bytes left cannot hold
  // reserves no more than they can.
  m.read_reqs.reserve(std::min<size_t>(reqs, c.left() / 3));
  size_t total = 0;
  for (size_t i = 0; i < reqs; ++i) {
    RD2H_TRY(req, cursor_read_req(c, i, total));
    m.read_reqs.push_back(std::move(req));
  }
  if (fields > 4) {
    RD2H_TRY(done, c.array([] { return at(4); }, 0, SIZE_MAX));
    if (done > kMaxDoneExtIds) {
      return invalid_argument(at(4) + ": " + std::to_string(done) +
                              " done ext ids exceed the limit of " +
                              std::to_string(kMaxDoneExtIds) + " per readiness");
    }
    m.done_ext_ids.reserve(done);
    for (size_t k = 0; k < done; ++k) {
      RD2H_TRY(id, c.str([&] { return at(4) + "[" + std::to_string(k) + "]"; }, kMaxExtIdBytes));
      m.done_ext_ids.emplace_back(id);
    }
  }
  if (fields > 5) {
    RD2H_TRY(member, c.integer([] { return at(5); }, 0, kMaxTpRatio - 1));
    m.group_member_idx = member;
  }
  if (fields > 6) {  // 0 or less means 1, as the existing connector reads it
    RD2H_TRY(ratio, c.integer([] { return at(6); }, INT64_MIN, kMaxTpRatio));
    m.tp_ratio = std::max<int64_t>(1, ratio);
  }
  // Elements past the seventh are a newer sender's: skipped whole.
  if (fields > 7 && !c.skip_values(fields - 7)) return c.truncated();
  if (m.group_member_idx >= m.tp_ratio) {
    return invalid_argument(at(5) + ": group_member_idx " + std::to_string(m.group_member_idx) +
                            " is not below tp_ratio " + std::to_string(m.tp_ratio));
  }
  if (c.left() != 0) {
    return invalid_argument("message: " + std::to_string(c.left()) +
                            " trailing bytes after the message");
  }
  return m;
}

// Reads a message's array header and tag; nullopt when the payload does not start like a
// protocol message.
std::optional<std::pair<size_t, std::string_view>> cursor_tag(Cursor& c) {
  Header h;
  if (!c.header(h) || h.kind != Header::kArray || h.n < 1 || h.n > 64) return std::nullopt;
  const size_t fields = h.n;
  if (!c.header(h) || h.kind != Header::kBin || h.n > 64) return std::nullopt;
  const char* body = c.here();
  if (!c.skip(h.n)) return std::nullopt;
  return std::make_pair(fields, std::string_view(body, h.n));
}

}  // namespace

namespace {
bool equals(std::span<const std::byte> payload, std::string_view raw) {
  return payload.size() == raw.size() && std::memcmp(payload.data(), raw.data(), raw.size()) == 0;
}
}  // namespace

bool is_ack(std::span<const std::byte> payload) {
  return equals(payload, kAckPayload) || equals(payload, kAckCommitPayload);
}

bool is_commit_ack(std::span<const std::byte> payload) {
  return equals(payload, kAckCommitPayload);
}

Expected<Message> decode_message(std::span<const std::byte> payload) {
  if (payload.size() > kMaxMessageBytes) {
    return invalid_argument("message: " + std::to_string(payload.size()) +
                            " bytes exceed the limit of " + std::to_string(kMaxMessageBytes));
  }
  {
    Cursor c(payload);
    if (auto head = cursor_tag(c); head && head->second == kTagReadReadyBatch) {
      RD2H_TRY(m, cursor_read_ready_batch(c, head->first));
      return Message(std::move(m));
    }
  }
  // The other messages are small: checked whole for their bounds (nesting, declared items
  // present, nothing trailing), then read with the same cursor.
  RD2H_RETURN_IF_ERROR(check_msgpack_bounds(payload, kTreeDepth, "message"));
  Cursor c(payload);
  Header h;
  if (!c.header(h)) return c.truncated();
  if (h.kind != Header::kArray) {
    return invalid_argument(std::string("message: top level is ") + kind_name(h) +
                            ", not an array");
  }
  const size_t fields = h.n;
  if (fields < 1 || fields > 64) {
    return invalid_argument("message: " + std::to_string(fields) + " elements, expected 1 to 64");
  }
  RD2H_TRY(tag, c.bin([] { return at(0); }));
  // Elements past the ones read are accepted (a newer sender's), as the existing connector
  // does.
  auto rest = [&](size_t read) -> Status {
    if (fields > read && !c.skip_values(fields - read)) return c.truncated();
    return Status::ok();
  };
  if (tag == kTagReadDone) {
    if (fields < 2) {
      return invalid_argument("READ_DONE: " + std::to_string(fields) +
                              " elements, expected at least 2");
    }
    RD2H_TRY(layer, c.integer([] { return at(1); }, 0, kMaxLayerIndex));
    RD2H_RETURN_IF_ERROR(rest(2));
    return Message(ReadDone{layer});
  }
  if (tag == kTagReadFailed) {
    if (fields < 2) {
      return invalid_argument("READ_FAILED: " + std::to_string(fields) +
                              " elements, expected at least 2");
    }
    RD2H_TRY(layer, c.integer([] { return at(1); }, 0, kMaxLayerIndex));
    ReadFailed m{layer, {}};
    if (fields >= 3) {
      RD2H_TRY(error, c.str([] { return at(2); }, kMaxStringBytes));
      m.error = std::string(error);
    }
    RD2H_RETURN_IF_ERROR(rest(3));
    return Message(std::move(m));
  }
  if (tag == kTagMfMeta) {
    RD2H_TRY(m, cursor_mf_meta(c, fields));
    return Message(std::move(m));
  }
  if (tag == kTagKvCommit) {
    if (fields < 3) {
      return invalid_argument("KV_COMMIT: " + std::to_string(fields) +
                              " elements, expected at least 3");
    }
    RD2H_TRY(layer, c.integer([] { return at(1); }, 0, kMaxLayerIndex));
    RD2H_TRY(n, c.array([] { return at(2); }, 0, kMaxDoneExtIds));
    KvCommit m{layer, {}};
    m.ext_ids.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      RD2H_TRY(id, c.str([&] { return at(2) + "[" + std::to_string(i) + "]"; }, kMaxExtIdBytes));
      m.ext_ids.emplace_back(id);
    }
    RD2H_RETURN_IF_ERROR(rest(3));
    return Message(std::move(m));
  }
  std::string shown(tag.substr(0, 32));
  return invalid_argument("message: unknown tag '" + shown + "'");
}

std::optional<int64_t> salvage_layer_index(std::span<const std::byte> payload) {
  Cursor c(payload);
  auto head = cursor_tag(c);
  if (!head || head->first < 2 || head->second != kTagReadReadyBatch) return std::nullopt;
  auto layer = c.integer([] { return at(1); }, 0, kMaxLayerIndex);
  if (!layer) return std::nullopt;
  return *layer;
}

std::optional<std::string> peek_tag(std::span<const std::byte> payload, bool* as_str) {
  Cursor c(payload);
  Header h;
  if (!c.header(h) || h.kind != Header::kArray || h.n < 1) return std::nullopt;
  if (!c.header(h) || (h.kind != Header::kBin && h.kind != Header::kStr) || h.n > 64) {
    return std::nullopt;
  }
  const char* body = c.here();
  if (!c.skip(h.n)) return std::nullopt;
  if (as_str != nullptr) *as_str = h.kind == Header::kStr;
  return std::string(body, h.n);
}

Status check_compatible(const MfMeta& peer) {
  if (peer.protocol_version && *peer.protocol_version != kProtocolVersion) {
    return failed_precondition("peer " + peer.p_session + " speaks protocol version " +
                               std::to_string(*peer.protocol_version) + ", this build speaks " +
                               std::to_string(kProtocolVersion));
  }
  if (peer.cache_layout_version && *peer.cache_layout_version != kCacheLayoutVersion) {
    return failed_precondition("peer " + peer.p_session + " uses cache-layout version " +
                               std::to_string(*peer.cache_layout_version) + ", this build uses " +
                               std::to_string(kCacheLayoutVersion));
  }
  return Status::ok();
}

}  // namespace rd2h::protocol
