// A small KV cache (kLayers x K, V, indexer x kBlocks) in engine memory, and the MF_META a
// Prefill publishes for it: the shared ground of the connector's loopback tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "layout/layout.h"
#include "protocol/messages.h"
#include "rd2h/transfer/transfer_engine.h"
#include "util/pattern.h"

namespace rd2h::testing {

inline constexpr uint64_t kBlocks = 16;
inline const std::vector<uint64_t> kBytes = {1024, 128, 64};  // K, V, indexer per block
inline constexpr int kLayers = 3;

inline std::string layer_name(int l) {
  return "model.layers." + std::to_string(l) + ".self_attn";
}
inline uint64_t key(int layer, size_t tensor, int64_t block) {
  return (static_cast<uint64_t>(layer) << 32) | (tensor << 16) | static_cast<uint64_t>(block);
}

// A KV pool of kLayers x 3 tensors x kBlocks in one registration.
struct Pool {
  std::unique_ptr<transfer::TransferEngine> engine;
  std::byte* base = nullptr;
  std::vector<std::vector<uint64_t>> tensor_base;  // [layer][tensor]

  Pool(transfer::Role role, bool fill) {
    transfer::EngineConfig cfg;
    cfg.role = role;
    cfg.transport = transfer::Transport::kShm;
    auto created = transfer::create_ucx_engine(cfg);
    EXPECT_TRUE(created) << created.status().to_string();
    engine = std::move(created.value());
    uint64_t per_layer = 0;
    for (auto b : kBytes) per_layer += b * kBlocks;
    auto region = engine->allocate_memory(per_layer * kLayers);
    EXPECT_TRUE(region) << region.status().to_string();
    base = static_cast<std::byte*>(region->addr);
    std::memset(base, 0, per_layer * kLayers);
    uint64_t off = 0;
    for (int l = 0; l < kLayers; ++l) {
      tensor_base.emplace_back();
      for (size_t t = 0; t < kBytes.size(); ++t) {
        tensor_base[l].push_back(reinterpret_cast<uint64_t>(base) + off);
        if (fill) {
          for (uint64_t b = 0; b < kBlocks; ++b) {
            fill_pattern(base + off + b * kBytes[t], kBytes[t], key(l, t, static_cast<int64_t>(b)));
          }
        }
        off += kBytes[t] * kBlocks;
      }
    }
  }
  layout::LayerTensors tensors(int l) const {
    layout::LayerTensors t;
    t.base_addrs = tensor_base[l];
    t.bytes_per_block = kBytes;
    t.main_tensor_count = 2;
    t.has_indexer = true;
    t.num_blocks = kBlocks;
    return t;
  }
  // Whether destination block `dst` of tensor t in layer l holds source block `src`.
  bool holds(int l, size_t t, int64_t dst, int64_t src) const {
    auto* p = reinterpret_cast<const void*>(tensor_base[l][t] + dst * kBytes[t]);
    return !find_pattern_mismatch(p, kBytes[t], key(l, t, src));
  }
  bool zero(int l, size_t t, int64_t dst) const {
    auto* p = reinterpret_cast<const std::byte*>(tensor_base[l][t] + dst * kBytes[t]);
    return std::all_of(p, p + kBytes[t], [](std::byte b) { return b == std::byte{0}; });
  }
};

inline protocol::MfMeta mf_meta(const Pool& prefill) {
  protocol::MfMeta m;
  m.p_session = "test-prefill";
  for (int l = 0; l < kLayers; ++l) {
    protocol::LayerMeta meta;
    meta.base_addrs = prefill.tensor_base[l];
    meta.block_len = kBytes;
    meta.block_size_scale = {1, 1, 1};
    meta.tensor_group_idx = {0, 0, 1};
    meta.main_tensor_count = 2;
    meta.has_indexer = true;
    m.layers.emplace_back(layer_name(l), meta);
  }
  m.backend_name = "ucx";
  m.backend_metadata = *prefill.engine->export_metadata();
  return m;
}

}  // namespace rd2h::testing
