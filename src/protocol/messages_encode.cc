// The encoders of the control-plane messages: MF_META, READ_READY_BATCH (whole, or its
// body once for every layer), READ_DONE and READ_FAILED, in msgpack.
#include <msgpack.hpp>

#include "common/msgpack_util.h"
#include "protocol/message_tags.h"
#include "protocol/messages.h"

namespace rd2h::protocol {

namespace {

using Packer = msgpack::packer<msgpack_util::ByteSink>;

using msgpack_util::pack_bin;
using msgpack_util::pack_str;
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

// Runs `body` on a fresh packer and returns what it packed.
template <typename F>
std::vector<std::byte> packed(F&& body) {
  std::vector<std::byte> out;
  msgpack_util::ByteSink sink{out};
  Packer pk(sink);
  body(pk);
  return out;
}

std::vector<std::byte> encode_layer_map(
    const std::vector<std::pair<std::string, LayerMeta>>& layers) {
  return packed([&](Packer& pk) {
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
  });
}

}  // namespace

std::vector<std::byte> encode(const MfMeta& m) {
  return packed([&](Packer& pk) {
    pk.pack_array(m.control_link ? 8 : 7);
    pack_bin(pk, kTagMfMeta);
    pack_str(pk, m.p_session);
    pack_bin(pk, encode_layer_map(m.layers));
    pk.pack_uint64(m.protocol_version.value_or(kProtocolVersion));
    pk.pack_uint64(m.cache_layout_version.value_or(kCacheLayoutVersion));
    pack_str(pk, m.backend_name);
    pack_bin(pk, m.backend_metadata);
    if (m.control_link) pk.pack_uint64(*m.control_link);
  });
}

std::vector<std::byte> encode(const ReadReadyBatch& m) {
  return encode_readiness(m.layer_idx, m.layer_name, encode_readiness_body(m));
}

std::vector<std::byte> encode_readiness(int64_t layer_idx, std::string_view layer_name,
                                        std::span<const std::byte> body) {
  std::vector<std::byte> out;
  out.reserve(32 + layer_name.size() + body.size());
  msgpack_util::ByteSink sink{out};
  Packer pk(sink);
  pk.pack_array(7);
  pack_bin(pk, kTagReadReadyBatch);
  pk.pack_int64(layer_idx);
  pack_str(pk, layer_name);
  out.insert(out.end(), body.begin(), body.end());
  return out;
}

std::vector<std::byte> encode_readiness_body(const ReadReadyBatch& m) {
  return packed([&](Packer& pk) {
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

std::vector<std::byte> encode(const KvCommit& m) {
  return packed([&](Packer& pk) {
    pk.pack_array(3);
    pack_bin(pk, kTagKvCommit);
    pk.pack_int64(m.layer_idx);
    pk.pack_array(static_cast<uint32_t>(m.ext_ids.size()));
    for (const auto& id : m.ext_ids) pack_str(pk, id);
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
}  // namespace rd2h::protocol
