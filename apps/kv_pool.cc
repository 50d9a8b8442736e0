#include "kv_pool.h"

#include <cstring>

#include "common/bytes.h"
#include "util/pattern.h"

namespace rd2h::tools {

namespace {
constexpr char kHandshakeMagic[8] = {'R', 'D', '2', 'H', 'P', 'D', 'R', '1'};
constexpr uint32_t kMaxTensors = 64;
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
  ByteWriter w;
  w.raw(kHandshakeMagic, sizeof(kHandshakeMagic));
  w.u32(h.layout.layers);
  w.u32(h.layout.blocks);
  w.u32(static_cast<uint32_t>(h.layout.tensor_bytes.size()));
  for (auto b : h.layout.tensor_bytes) w.u64(b);
  w.u64(h.seed);
  w.u64(h.base);
  w.bytes(h.engine_metadata);
  return w.take();
}

Expected<SourceHandshake> decode_handshake(std::span<const std::byte> bytes) {
  ByteReader r(bytes);
  auto magic = r.raw("magic", sizeof(kHandshakeMagic));
  if (!magic || std::memcmp(magic->data(), kHandshakeMagic, sizeof(kHandshakeMagic)) != 0) {
    return invalid_argument("the source did not send a pd-read handshake (bad magic)");
  }
  SourceHandshake h;
  auto layers = r.u32("layers");
  auto blocks = r.u32("blocks");
  auto tensors = r.u32("tensor count");
  if (!layers || !blocks || !tensors) return invalid_argument("truncated pd-read handshake");
  if (*tensors > kMaxTensors) {
    return invalid_argument("handshake names " + std::to_string(*tensors) + " tensors");
  }
  h.layout.layers = *layers;
  h.layout.blocks = *blocks;
  for (uint32_t t = 0; t < *tensors; ++t) {
    RD2H_TRY(b, r.u64("tensor bytes"));
    h.layout.tensor_bytes.push_back(b);
  }
  auto seed = r.u64("seed");
  auto base = r.u64("base");
  if (!seed || !base) return invalid_argument("truncated pd-read handshake");
  h.seed = *seed;
  h.base = *base;
  RD2H_TRY(meta, r.bytes("engine metadata", 1 << 24));
  h.engine_metadata.assign(meta.begin(), meta.end());
  if (!r.at_end()) return invalid_argument("trailing bytes after the pd-read handshake");
  return h;
}

}  // namespace rd2h::tools
