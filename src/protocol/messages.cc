#include "protocol/messages.h"

#include <algorithm>
#include <cstring>
#include <msgpack.hpp>

namespace rd2h::protocol {

namespace {

constexpr std::string_view kTagMfMeta = "mf_meta";
constexpr std::string_view kTagReadReadyBatch = "read_ready_batch";
constexpr std::string_view kTagReadDone = "read_done";
constexpr std::string_view kTagReadFailed = "read_failed";

// ---- encoding ----

using Packer = msgpack::packer<msgpack::sbuffer>;

void pack_bin(Packer& pk, std::string_view s) {
  pk.pack_bin(static_cast<uint32_t>(s.size()));
  pk.pack_bin_body(s.data(), static_cast<uint32_t>(s.size()));
}
void pack_bin(Packer& pk, std::span<const std::byte> b) {
  pk.pack_bin(static_cast<uint32_t>(b.size()));
  pk.pack_bin_body(reinterpret_cast<const char*>(b.data()), static_cast<uint32_t>(b.size()));
}
void pack_str(Packer& pk, std::string_view s) {
  pk.pack_str(static_cast<uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}
template <typename T>
void pack_ints(Packer& pk, const std::vector<T>& v) {
  pk.pack_array(static_cast<uint32_t>(v.size()));
  for (T x : v) {
    if constexpr (std::is_signed_v<T>) {
      pk.pack_int64(x);
    } else {
      pk.pack_uint64(x);
    }
  }
}

std::vector<std::byte> bytes_of(const msgpack::sbuffer& buf) {
  const auto* p = reinterpret_cast<const std::byte*>(buf.data());
  return {p, p + buf.size()};
}

// Runs `body` on a fresh packer and returns what it packed.
template <typename F>
std::vector<std::byte> packed(F&& body) {
  msgpack::sbuffer buf;
  Packer pk(&buf);
  body(pk);
  return bytes_of(buf);
}

std::vector<std::byte> encode_layer_map(
    const std::vector<std::pair<std::string, LayerMeta>>& layers) {
  msgpack::sbuffer buf;
  Packer pk(&buf);
  pk.pack_map(static_cast<uint32_t>(layers.size()));
  for (const auto& [name, meta] : layers) {
    pack_str(pk, name);
    pk.pack_map(6);
    pack_str(pk, "base_addrs");
    pack_ints(pk, meta.base_addrs);
    pack_str(pk, "block_len");
    pack_ints(pk, meta.block_len);
    pack_str(pk, "block_size_scale");
    pack_ints(pk, meta.block_size_scale);
    pack_str(pk, "tensor_group_idx");
    pack_ints(pk, meta.tensor_group_idx);
    pack_str(pk, "main_tensor_count");
    pk.pack_uint64(meta.main_tensor_count);
    pack_str(pk, "has_indexer");
    if (meta.has_indexer) {
      pk.pack_true();
    } else {
      pk.pack_false();
    }
  }
  return bytes_of(buf);
}

// ---- decoding ----

// A bounded view of one msgpack object, with the path that led to it for error messages.
class Field {
 public:
  Field(const msgpack::object& o, std::string path) : o_(o), path_(std::move(path)) {}

  const std::string& path() const { return path_; }
  Status error(const std::string& what) const { return invalid_argument(path_ + ": " + what); }

  Expected<std::vector<Field>> array(size_t min_items, size_t max_items) const {
    if (o_.type != msgpack::type::ARRAY) return error("expected an array, got " + type_name());
    const size_t n = o_.via.array.size;
    if (n < min_items || n > max_items) {
      return error(std::to_string(n) + " elements, expected " +
                   (min_items == max_items
                        ? std::to_string(min_items)
                        : std::to_string(min_items) + " to " + std::to_string(max_items)));
    }
    std::vector<Field> items;
    items.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      items.emplace_back(o_.via.array.ptr[i], path_ + "[" + std::to_string(i) + "]");
    }
    return items;
  }

  Expected<std::string> str(size_t max_bytes = kMaxStringBytes) const {
    if (o_.type != msgpack::type::STR) return error("expected a str, got " + type_name());
    if (o_.via.str.size > max_bytes) {
      return error("string of " + std::to_string(o_.via.str.size) + " bytes exceeds " +
                   std::to_string(max_bytes));
    }
    return std::string(o_.via.str.ptr, o_.via.str.size);
  }

  Expected<std::string_view> bin() const {
    if (o_.type != msgpack::type::BIN) return error("expected bin, got " + type_name());
    return std::string_view(o_.via.bin.ptr, o_.via.bin.size);
  }

  // An integer in [min, max].
  Expected<int64_t> integer(int64_t min, int64_t max) const {
    int64_t v = 0;
    if (o_.type == msgpack::type::POSITIVE_INTEGER) {
      if (o_.via.u64 > static_cast<uint64_t>(max)) {
        return error(std::to_string(o_.via.u64) + " exceeds the limit of " + std::to_string(max));
      }
      v = static_cast<int64_t>(o_.via.u64);
    } else if (o_.type == msgpack::type::NEGATIVE_INTEGER) {
      v = o_.via.i64;
    } else {
      return error("expected an integer, got " + type_name());
    }
    if (v < min) {
      return error(std::to_string(v) +
                   (min == 0 ? " is negative" : " is below " + std::to_string(min)));
    }
    if (v > max) return error(std::to_string(v) + " exceeds the limit of " + std::to_string(max));
    return v;
  }

  Expected<uint64_t> unsigned_int() const {
    if (o_.type != msgpack::type::POSITIVE_INTEGER) {
      if (o_.type == msgpack::type::NEGATIVE_INTEGER) {
        return error(std::to_string(o_.via.i64) + " is negative");
      }
      return error("expected an unsigned integer, got " + type_name());
    }
    return o_.via.u64;
  }

  Expected<bool> boolean() const {
    if (o_.type != msgpack::type::BOOLEAN) return error("expected a bool, got " + type_name());
    return o_.via.boolean;
  }

  bool is_map() const { return o_.type == msgpack::type::MAP; }
  const msgpack::object& raw() const { return o_; }

  std::string type_name() const {
    switch (o_.type) {
      case msgpack::type::NIL:
        return "nil";
      case msgpack::type::BOOLEAN:
        return "bool";
      case msgpack::type::POSITIVE_INTEGER:
      case msgpack::type::NEGATIVE_INTEGER:
        return "int";
      case msgpack::type::FLOAT32:
      case msgpack::type::FLOAT64:
        return "float";
      case msgpack::type::STR:
        return "str";
      case msgpack::type::BIN:
        return "bin";
      case msgpack::type::ARRAY:
        return "array";
      case msgpack::type::MAP:
        return "map";
      case msgpack::type::EXT:
        return "ext";
    }
    return "unknown";
  }

 private:
  const msgpack::object& o_;
  std::string path_;
};

#define RD2H_TRY(var, expr)                        \
  auto var##_result = (expr);                      \
  if (!var##_result) return var##_result.status(); \
  auto var = std::move(*var##_result)

// Parses one msgpack value that must span all of `bytes`. Container sizes are bounded by
// the byte count, so a forged header cannot make the parser allocate beyond the input.
Expected<msgpack::object_handle> parse(std::span<const std::byte> bytes, const std::string& what) {
  if (bytes.size() > kMaxMessageBytes) {
    return invalid_argument(what + ": " + std::to_string(bytes.size()) +
                            " bytes exceed the limit of " + std::to_string(kMaxMessageBytes));
  }
  if (bytes.empty()) return invalid_argument(what + ": empty");
  const size_t items = std::min(bytes.size(), kMaxArrayItems);
  msgpack::unpack_limit limit(items, items, kMaxMessageBytes, kMaxMessageBytes, 0, 16);
  size_t offset = 0;
  try {
    auto oh = msgpack::unpack(reinterpret_cast<const char*>(bytes.data()), bytes.size(), offset,
                              nullptr, nullptr, limit);
    if (offset != bytes.size()) {
      return invalid_argument(what + ": " + std::to_string(bytes.size() - offset) +
                              " trailing bytes after the message");
    }
    return oh;
  } catch (const msgpack::insufficient_bytes&) {
    return invalid_argument(what + ": truncated");
  } catch (const std::exception& e) {
    return invalid_argument(what + ": not valid msgpack (" + e.what() + ")");
  }
}

Expected<std::vector<int64_t>> block_ids(const Field& f) {
  RD2H_TRY(items, f.array(0, kMaxArrayItems));
  std::vector<int64_t> ids;
  ids.reserve(items.size());
  for (const auto& item : items) {
    RD2H_TRY(id, item.integer(0, kMaxBlockId));
    ids.push_back(id);
  }
  return ids;
}

Expected<std::vector<uint64_t>> uints(const Field& f) {
  RD2H_TRY(items, f.array(0, kMaxArrayItems));
  std::vector<uint64_t> out;
  out.reserve(items.size());
  for (const auto& item : items) {
    RD2H_TRY(v, item.unsigned_int());
    out.push_back(v);
  }
  return out;
}

Expected<LayerMeta> decode_layer_meta(const Field& f) {
  if (!f.is_map()) return f.error("expected a map, got " + f.type_name());
  const auto& map = f.raw().via.map;
  LayerMeta m;
  uint32_t seen = 0;
  for (uint32_t i = 0; i < map.size; ++i) {
    Field key(map.ptr[i].key, f.path() + " key");
    RD2H_TRY(name, key.str(64));
    Field value(map.ptr[i].val, f.path() + "." + name);
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
      RD2H_TRY(v, uints(value));
      m.*(array->second) = std::move(v);
      seen |= 1u << (array - std::begin(kArrays));
    } else if (name == "main_tensor_count") {
      RD2H_TRY(v, value.unsigned_int());
      m.main_tensor_count = v;
      seen |= 16;
    } else if (name == "has_indexer") {
      RD2H_TRY(v, value.boolean());
      m.has_indexer = v;
      seen |= 32;
    }  // unknown keys: a newer peer's additions
  }
  if (seen != 63)
    return f.error(
        "missing one of base_addrs, block_len, block_size_scale, "
        "tensor_group_idx, main_tensor_count, has_indexer");
  const size_t n = m.base_addrs.size();
  if (m.block_len.size() != n || m.block_size_scale.size() != n || m.tensor_group_idx.size() != n) {
    return f.error("base_addrs, block_len, block_size_scale and tensor_group_idx have " +
                   std::to_string(n) + ", " + std::to_string(m.block_len.size()) + ", " +
                   std::to_string(m.block_size_scale.size()) + " and " +
                   std::to_string(m.tensor_group_idx.size()) + " entries; they must match");
  }
  if (m.main_tensor_count == 0 || m.main_tensor_count > n) {
    return f.error("main_tensor_count " + std::to_string(m.main_tensor_count) + " with " +
                   std::to_string(n) + " tensors");
  }
  if (m.has_indexer && m.main_tensor_count == n) {
    return f.error("has_indexer is set but there is no tensor after the " +
                   std::to_string(m.main_tensor_count) + " main ones");
  }
  for (size_t i = 0; i < n; ++i) {
    if (m.block_len[i] == 0 || m.block_size_scale[i] == 0) {
      return f.error("tensor " + std::to_string(i) + " has zero bytes per block");
    }
    if (m.block_len[i] > (uint64_t{1} << 40) / m.block_size_scale[i]) {
      return f.error("tensor " + std::to_string(i) + " bytes per block overflow");
    }
  }
  return m;
}

Expected<MfMeta> decode_mf_meta(const std::vector<Field>& t) {
  if (t.size() < 3)
    return invalid_argument("MF_META: " + std::to_string(t.size()) +
                            " elements, expected at least 3");
  MfMeta m;
  RD2H_TRY(session, t[1].str());
  m.p_session = std::move(session);
  RD2H_TRY(map_bytes, t[2].bin());
  RD2H_TRY(
      oh, parse(std::as_bytes(std::span(map_bytes.data(), map_bytes.size())), "MF_META layer map"));
  Field map(oh.get(), "MF_META layer map");
  if (!map.is_map()) return map.error("expected a map, got " + map.type_name());
  const auto& mv = map.raw().via.map;
  for (uint32_t i = 0; i < mv.size; ++i) {
    Field key(mv.ptr[i].key, "MF_META layer map key");
    RD2H_TRY(name, key.str(1024));
    RD2H_TRY(meta, decode_layer_meta(Field(mv.ptr[i].val, "MF_META layer " + name)));
    m.layers.emplace_back(std::move(name), std::move(meta));
  }
  if (t.size() > 3) {
    RD2H_TRY(v, t[3].unsigned_int());
    m.protocol_version = v;
  }
  if (t.size() > 4) {
    RD2H_TRY(v, t[4].unsigned_int());
    m.cache_layout_version = v;
  }
  if (t.size() > 5) {
    RD2H_TRY(v, t[5].str(256));
    m.backend_name = std::move(v);
  }
  if (t.size() > 6) {
    RD2H_TRY(v, t[6].bin());
    const auto* p = reinterpret_cast<const std::byte*>(v.data());
    m.backend_metadata.assign(p, p + v.size());
  }
  return m;
}

Expected<ReadReq> decode_read_req(const Field& f) {
  RD2H_TRY(t, f.array(2, 5));
  ReadReq r;
  RD2H_TRY(ext_id, t[0].str(1024));
  r.ext_id = std::move(ext_id);
  RD2H_TRY(main, block_ids(t[1]));
  r.main_block_ids = std::move(main);
  if (t.size() == 2) {
    r.indexer_block_ids = r.main_block_ids;  // legacy: one list for main and indexer
    return r;
  }
  RD2H_TRY(indexer, block_ids(t[2]));
  r.indexer_block_ids = std::move(indexer);
  if (t.size() > 3) {
    RD2H_TRY(start, t[3].integer(0, kMaxBlockId));
    r.main_start = r.indexer_start = start;  // a 4-field entry has one offset for both
  }
  if (t.size() > 4) {
    RD2H_TRY(start, t[4].integer(0, kMaxBlockId));
    r.indexer_start = start;
  }
  return r;
}

Expected<ReadReadyBatch> decode_read_ready_batch(const std::vector<Field>& t) {
  if (t.size() < 4 || t.size() > 7) {
    return invalid_argument("READ_READY_BATCH: " + std::to_string(t.size()) +
                            " elements, expected 4 to 7");
  }
  ReadReadyBatch m;
  RD2H_TRY(layer, t[1].integer(0, kMaxLayerIndex));
  m.layer_idx = layer;
  RD2H_TRY(name, t[2].str(1024));
  m.layer_name = std::move(name);
  RD2H_TRY(reqs, t[3].array(0, kMaxArrayItems));
  m.read_reqs.reserve(reqs.size());
  for (const auto& r : reqs) {
    RD2H_TRY(req, decode_read_req(r));
    m.read_reqs.push_back(std::move(req));
  }
  if (t.size() > 4) {
    RD2H_TRY(done, t[4].array(0, kMaxArrayItems));
    m.done_ext_ids.reserve(done.size());
    for (const auto& d : done) {
      RD2H_TRY(id, d.str(1024));
      m.done_ext_ids.push_back(std::move(id));
    }
  }
  if (t.size() > 6) {
    RD2H_TRY(ratio, t[6].integer(1, kMaxTpRatio));
    m.tp_ratio = ratio;
  }
  if (t.size() > 5) {
    RD2H_TRY(member, t[5].integer(0, kMaxTpRatio - 1));
    if (member >= m.tp_ratio) {
      return t[5].error("group_member_idx " + std::to_string(member) + " is not below tp_ratio " +
                        std::to_string(m.tp_ratio));
    }
    m.group_member_idx = member;
  }
  return m;
}

}  // namespace

std::vector<std::byte> encode(const MfMeta& m) {
  return packed([&](Packer& pk) {
    pk.pack_array(7);
    pack_bin(pk, kTagMfMeta);
    pack_str(pk, m.p_session);
    pack_bin(pk, encode_layer_map(m.layers));
    pk.pack_uint64(m.protocol_version.value_or(kProtocolVersion));
    pk.pack_uint64(m.cache_layout_version.value_or(kCacheLayoutVersion));
    pack_str(pk, m.backend_name);
    pack_bin(pk, m.backend_metadata);
  });
}

std::vector<std::byte> encode(const ReadReadyBatch& m) {
  return packed([&](Packer& pk) {
    pk.pack_array(7);
    pack_bin(pk, kTagReadReadyBatch);
    pk.pack_int64(m.layer_idx);
    pack_str(pk, m.layer_name);
    pk.pack_array(static_cast<uint32_t>(m.read_reqs.size()));
    for (const auto& r : m.read_reqs) {
      pk.pack_array(5);
      pack_str(pk, r.ext_id);
      pack_ints(pk, r.main_block_ids);
      pack_ints(pk, r.indexer_block_ids);
      pk.pack_int64(r.main_start);
      pk.pack_int64(r.indexer_start);
    }
    pk.pack_array(static_cast<uint32_t>(m.done_ext_ids.size()));
    for (const auto& id : m.done_ext_ids) pack_str(pk, id);
    pk.pack_int64(m.group_member_idx);
    pk.pack_int64(m.tp_ratio);
  });
}

std::vector<std::byte> encode(const ReadDone& m) {
  return packed([&](Packer& pk) {
    pk.pack_array(2);
    pack_bin(pk, kTagReadDone);
    pk.pack_int64(m.layer_idx);
  });
}

std::vector<std::byte> encode(const ReadFailed& m) {
  return packed([&](Packer& pk) {
    pk.pack_array(3);
    pack_bin(pk, kTagReadFailed);
    pk.pack_int64(m.layer_idx);
    pack_str(pk, m.error);
  });
}

bool is_ack(std::span<const std::byte> payload) {
  return payload.size() == kAckPayload.size() &&
         std::memcmp(payload.data(), kAckPayload.data(), kAckPayload.size()) == 0;
}

Expected<Message> decode_message(std::span<const std::byte> payload) {
  RD2H_TRY(oh, parse(payload, "message"));
  Field top(oh.get(), "message");
  if (top.raw().type != msgpack::type::ARRAY) {
    return invalid_argument("message: top level is " + top.type_name() + ", not an array");
  }
  RD2H_TRY(t, top.array(1, 64));
  RD2H_TRY(tag, t[0].bin());
  if (tag == kTagReadReadyBatch) {
    RD2H_TRY(m, decode_read_ready_batch(t));
    return Message(std::move(m));
  }
  if (tag == kTagReadDone) {
    if (t.size() != 2)
      return invalid_argument("READ_DONE: " + std::to_string(t.size()) + " elements, expected 2");
    RD2H_TRY(layer, t[1].integer(0, kMaxLayerIndex));
    return Message(ReadDone{layer});
  }
  if (tag == kTagReadFailed) {
    if (t.size() != 2 && t.size() != 3) {
      return invalid_argument("READ_FAILED: " + std::to_string(t.size()) +
                              " elements, expected 2 or 3");
    }
    RD2H_TRY(layer, t[1].integer(0, kMaxLayerIndex));
    ReadFailed m{layer, {}};
    if (t.size() == 3) {
      RD2H_TRY(error, t[2].str());
      m.error = std::move(error);
    }
    return Message(std::move(m));
  }
  if (tag == kTagMfMeta) {
    RD2H_TRY(m, decode_mf_meta(t));
    return Message(std::move(m));
  }
  std::string shown(tag.substr(0, 32));
  return invalid_argument("message: unknown tag '" + shown + "'");
}

std::optional<int64_t> salvage_layer_index(std::span<const std::byte> payload) {
  auto oh = parse(payload, "message");
  if (!oh) return std::nullopt;
  Field top(oh->get(), "message");
  auto t = top.array(2, 64);
  if (!t) return std::nullopt;
  auto tag = (*t)[0].bin();
  if (!tag || *tag != kTagReadReadyBatch) return std::nullopt;
  auto layer = (*t)[1].integer(0, kMaxLayerIndex);
  if (!layer) return std::nullopt;
  return *layer;
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
