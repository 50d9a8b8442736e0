#include "kv_pool.h"

#include <algorithm>
#include <string_view>

#include "common/msgpack_util.h"
#include "protocol/msgpack_field.h"
#include "util/pattern.h"

namespace rd2h::tools {

namespace {

constexpr uint32_t kMaxTensors = 64;

constexpr const char* kWhat = "pd-read handshake";
// What a foreign map (or another version of this one) is told apart by.
constexpr std::string_view kHandshakeFormat = "rd2h pd-read 1";

// The fields of a handshake, all required, in the order they are written.
enum HandshakeField : uint32_t {
  kFormat,
  kLayers,
  kBlocks,
  kTensorBytes,
  kSeed,
  kBase,
  kEngineMetadata,
  kFieldCount
};
constexpr std::string_view kFieldNames[kFieldCount] = {
    "format", "layers", "blocks", "tensor_bytes", "seed", "base", "engine_metadata"};

Expected<uint32_t> u32(const protocol::Field& f) {
  RD2H_TRY(v, f.integer(0, UINT32_MAX));
  return static_cast<uint32_t>(v);
}

Expected<std::vector<uint64_t>> tensor_bytes(const protocol::Field& f) {
  RD2H_TRY(items, f.array(0, kMaxTensors));
  std::vector<uint64_t> out;
  for (const auto& item : items) {
    RD2H_TRY(b, item.unsigned_int());
    out.push_back(b);
  }
  return out;
}

Expected<std::vector<std::byte>> engine_metadata(const protocol::Field& f) {
  RD2H_TRY(meta, f.bin());
  if (meta.size() > kMaxEngineMetadataBytes) {
    return f.error(std::to_string(meta.size()) + " bytes exceed the limit of " +
                   std::to_string(kMaxEngineMetadataBytes));
  }
  const auto* p = reinterpret_cast<const std::byte*>(meta.data());
  return std::vector<std::byte>(p, p + meta.size());
}

// Reads one field's value into `h`; ranges only, the layout's rules are validate()'s.
Status decode_field(HandshakeField which, const protocol::Field& value, SourceHandshake& h) {
  switch (which) {
    case kFormat: {
      RD2H_TRY(format, value.str(64));
      if (format != kHandshakeFormat) {
        return value.error("'" + format + "' is not '" + std::string(kHandshakeFormat) +
                           "' (not a pd-read source, or another version of rd2h)");
      }
      return Status::ok();
    }
    case kLayers: {
      RD2H_TRY(v, u32(value));
      h.layout.layers = v;
      return Status::ok();
    }
    case kBlocks: {
      RD2H_TRY(v, u32(value));
      h.layout.blocks = v;
      return Status::ok();
    }
    case kTensorBytes: {
      RD2H_TRY(v, tensor_bytes(value));
      h.layout.tensor_bytes = std::move(v);
      return Status::ok();
    }
    case kSeed: {
      RD2H_TRY(v, value.unsigned_int());
      h.seed = v;
      return Status::ok();
    }
    case kBase: {
      RD2H_TRY(v, value.unsigned_int());
      h.base = v;
      return Status::ok();
    }
    case kEngineMetadata: {
      RD2H_TRY(v, engine_metadata(value));
      h.engine_metadata = std::move(v);
      return Status::ok();
    }
    case kFieldCount:
      break;
  }
  return value.error("not a handshake field");
}

}  // namespace

Status KvPoolLayout::validate(uint64_t max_total) const {
  if (layers == 0) return invalid_argument("layers must be at least 1");
  if (blocks == 0) return invalid_argument("blocks must be at least 1");
  if (tensor_bytes.empty()) return invalid_argument("a layer needs at least one tensor");
  if (tensor_bytes.size() > kMaxTensors) {
    return invalid_argument(std::to_string(tensor_bytes.size()) + " tensors per layer; at most " +
                            std::to_string(kMaxTensors));
  }
  // Sizes are checked one product at a time against the cap, so nothing overflows.
  uint64_t per_block = 0;
  for (size_t t = 0; t < tensor_bytes.size(); ++t) {
    if (tensor_bytes[t] == 0) {
      return invalid_argument("tensor " + std::to_string(t) + " has 0 bytes per block");
    }
    if (tensor_bytes[t] > max_total || per_block + tensor_bytes[t] > max_total) {
      return invalid_argument("bytes per block exceed the limit of " + std::to_string(max_total));
    }
    per_block += tensor_bytes[t];
  }
  if (per_block > max_total / blocks || per_block * blocks > max_total / layers) {
    return invalid_argument("pool of " + std::to_string(layers) + " layers x " +
                            std::to_string(blocks) + " blocks x " + std::to_string(per_block) +
                            " bytes exceeds the limit of " + std::to_string(max_total) + " bytes");
  }
  return Status::ok();
}

uint64_t KvPoolLayout::bytes_per_block() const {
  uint64_t n = 0;
  for (auto b : tensor_bytes) n += b;
  return n;
}

uint64_t KvPoolLayout::offset(uint32_t layer, uint32_t tensor, uint32_t block) const {
  uint64_t off = static_cast<uint64_t>(layer) * layer_bytes();
  for (uint32_t t = 0; t < tensor; ++t) off += tensor_bytes[t] * blocks;
  return off + static_cast<uint64_t>(block) * tensor_bytes[tensor];
}

uint64_t block_pattern_key(uint64_t seed, uint32_t layer, uint32_t tensor, uint32_t block) {
  return splitmix64(seed) ^ (static_cast<uint64_t>(layer) << 40) ^
         (static_cast<uint64_t>(tensor) << 32) ^ block;
}

void fill_pool(std::byte* base, const KvPoolLayout& layout, uint64_t seed) {
  for (uint32_t l = 0; l < layout.layers; ++l) {
    for (uint32_t t = 0; t < layout.tensor_bytes.size(); ++t) {
      for (uint32_t b = 0; b < layout.blocks; ++b) {
        fill_pattern(base + layout.offset(l, t, b), layout.tensor_bytes[t],
                     block_pattern_key(seed, l, t, b));
      }
    }
  }
}

std::vector<std::byte> encode_handshake(const SourceHandshake& h) {
  std::vector<std::byte> out;
  msgpack_util::ByteSink sink{out};
  msgpack::packer<msgpack_util::ByteSink> pk(sink);
  auto str = [&](std::string_view s) { msgpack_util::pack_str(pk, s); };
  pk.pack_map(kFieldCount);
  str(kFieldNames[kFormat]);
  str(kHandshakeFormat);
  str(kFieldNames[kLayers]);
  pk.pack(h.layout.layers);
  str(kFieldNames[kBlocks]);
  pk.pack(h.layout.blocks);
  str(kFieldNames[kTensorBytes]);
  pk.pack(h.layout.tensor_bytes);
  str(kFieldNames[kSeed]);
  pk.pack(h.seed);
  str(kFieldNames[kBase]);
  pk.pack(h.base);
  str(kFieldNames[kEngineMetadata]);
  msgpack_util::pack_bin(pk, std::span<const std::byte>(h.engine_metadata));
  return out;
}

Expected<SourceHandshake> decode_handshake(std::span<const std::byte> bytes) {
  if (bytes.size() > kMaxHandshakeBytes) {
    return invalid_argument(std::string(kWhat) + ": " + std::to_string(bytes.size()) +
                            " bytes exceed the limit of " + std::to_string(kMaxHandshakeBytes));
  }
  RD2H_TRY(tree, protocol::parse(bytes, kWhat));
  const protocol::Field root(tree.get(), kWhat);
  if (!root.is_map()) return root.error("expected a map, got " + root.type_name());
  const auto& map = root.raw().via.map;
  SourceHandshake h;
  uint32_t seen = 0;
  for (uint32_t i = 0; i < map.size; ++i) {
    RD2H_TRY(name, protocol::Field(map.ptr[i].key, std::string(kWhat) + " key").str(64));
    const auto* known = std::find(std::begin(kFieldNames), std::end(kFieldNames), name);
    if (known == std::end(kFieldNames)) return root.error("unknown field '" + name + "'");
    const auto which = static_cast<HandshakeField>(known - std::begin(kFieldNames));
    if ((seen & (1u << which)) != 0) return root.error("field '" + name + "' appears twice");
    seen |= 1u << which;
    RD2H_RETURN_IF_ERROR(
        decode_field(which, protocol::Field(map.ptr[i].val, std::string(kWhat) + "." + name), h));
  }
  for (uint32_t f = 0; f < kFieldCount; ++f) {
    if ((seen & (1u << f)) == 0) {
      return root.error("missing field '" + std::string(kFieldNames[f]) + "'");
    }
  }
  return h;
}

}  // namespace rd2h::tools
