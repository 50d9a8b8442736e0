// Where the simulator keeps each block of each layer, and what it holds: Prefill's layer
// buffers (layer l in buffer l % slots), Decode's shared main pool and per-rank indexer. A block's
// bytes are a function of its tokens, layer, tensor and position, so any copy can be checked.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "sim/engine.h"
#include "util/pattern.h"

namespace rd2h::sim {

inline std::string layer_name(int l) {
  return "model.layers." + std::to_string(l) + ".self_attn";
}

class KvModel {
 public:
  explicit KvModel(const ModelLayout& m) : m_(m) {
    for (auto b : m.bytes_per_token) block_bytes_.push_back(b * m.block_size);
  }
  const ModelLayout& layout() const { return m_; }
  const std::vector<uint64_t>& block_bytes() const { return block_bytes_; }
  size_t tensors() const { return block_bytes_.size(); }
  static bool is_main(size_t t) { return t < 2; }
  int slots() const { return m_.prefill_slots > 0 ? m_.prefill_slots : m_.layers; }

  uint64_t prefill_bytes() const { return slot_bytes() * static_cast<uint64_t>(slots()); }
  uint64_t main_pool_bytes() const {
    return (block_bytes_[0] + block_bytes_[1]) * m_.num_blocks * static_cast<uint64_t>(m_.layers);
  }
  uint64_t indexer_bytes() const {
    return indexer_layer_bytes() * static_cast<uint64_t>(m_.layers);
  }
  // Offset of `block` of tensor `t` of `layer` in the rank's Prefill region.
  uint64_t prefill_offset(int layer, size_t t, int64_t block) const {
    uint64_t off = static_cast<uint64_t>(layer % slots()) * slot_bytes();
    for (size_t k = 0; k < t; ++k) off += block_bytes_[k] * m_.num_blocks;
    return off + static_cast<uint64_t>(block) * block_bytes_[t];
  }
  // Decode: offset in the main pool (t < 2) or in the rank's indexer region.
  uint64_t decode_offset(int layer, size_t t, int64_t block) const {
    const uint64_t n = m_.num_blocks;
    if (is_main(t)) {
      return static_cast<uint64_t>(layer) * (block_bytes_[0] + block_bytes_[1]) * n +
             (t == 0 ? 0 : block_bytes_[0] * n) + static_cast<uint64_t>(block) * block_bytes_[t];
    }
    uint64_t off = static_cast<uint64_t>(layer) * indexer_layer_bytes();
    for (size_t k = 2; k < t; ++k) off += block_bytes_[k] * n;
    return off + static_cast<uint64_t>(block) * block_bytes_[t];
  }
  // What block `index` of a prompt holds: `block_tokens` are that block's tokens.
  static uint64_t kv_key(std::span<const int64_t> block_tokens, size_t index, int layer, size_t t) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (int64_t token : block_tokens) {
      h ^= static_cast<uint64_t>(token);
      h *= 0x100000001b3ULL;
    }
    return splitmix64(h ^ (static_cast<uint64_t>(layer) << 40) ^ (static_cast<uint64_t>(t) << 32) ^
                      index);
  }

 private:
  uint64_t slot_bytes() const {
    uint64_t s = 0;
    for (auto b : block_bytes_) s += b * m_.num_blocks;
    return s;
  }
  uint64_t indexer_layer_bytes() const {
    uint64_t s = 0;
    for (size_t k = 2; k < block_bytes_.size(); ++k) s += block_bytes_[k] * m_.num_blocks;
    return s;
  }

  ModelLayout m_;
  std::vector<uint64_t> block_bytes_;
};

}  // namespace rd2h::sim
