// A layerwise host-offload connector, composed with rd2h (spec "AscendMultiConnector
// Integration"): saves and loads a layer's blocks through a host store keyed by content, and
// overwrites a layer buffer it shares with rd2h only once the buffer-reuse waiter returned.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "rd2h/connector/kv_connector.h"

namespace rd2h::connector {

// Host memory holding saved blocks: (content key, layer name) -> the block's tensors.
class HostStore {
 public:
  void put(const std::string& key, const std::string& layer, std::vector<std::byte> bytes);
  // The saved bytes, or null.
  std::shared_ptr<const std::vector<std::byte>> get(const std::string& key,
                                                    const std::string& layer) const;
  size_t size() const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, std::string>, std::shared_ptr<const std::vector<std::byte>>>
      blocks_;
};

// A block and its content key (e.g. a hash of the token prefix it ends).
struct OffloadBlock {
  std::string key;
  int64_t block_id = 0;
};

struct OffloadMetadata {
  std::vector<OffloadBlock> save;  // computed this step: store them
  std::vector<OffloadBlock> load;  // found in the store: load them before each layer runs
};
std::vector<std::byte> encode(const OffloadMetadata& m);
Expected<OffloadMetadata> decode_offload_metadata(std::span<const std::byte> bytes);

struct OffloadStats {
  uint64_t blocks_saved = 0;
  uint64_t blocks_loaded = 0;
  uint64_t reuse_waits = 0;
};

class HostOffloadWorker final : public KvConnectorWorker {
 public:
  explicit HostOffloadWorker(std::shared_ptr<HostStore> store) : store_(std::move(store)) {}

  std::string_view name() const override { return "host-offload"; }
  Status register_kv_caches(std::vector<layout::CacheLayer> layers, bool engine_allocated) override;
  Status bind_connector_metadata(std::span<const std::byte> metadata) override;
  void clear_connector_metadata() override { metadata_ = {}; }
  Status start_load_kv() override { return Status::ok(); }
  // Waits for the layer's buffers to be free, then copies the stored blocks into them.
  Status wait_for_layer_load(std::string_view layer_name) override;
  // Copies the step's computed blocks of the layer into the store.
  Status save_kv_layer(std::string_view layer_name,
                       std::shared_ptr<prefill::WriteEvent> event) override;
  Status on_kv_cache_written(std::string_view) override { return Status::ok(); }
  Status wait_for_layer_send(std::string_view) override { return Status::ok(); }
  Status wait_for_save() override { return Status::ok(); }
  Expected<FinishedTransfers> get_finished(const decode::AllGather&) override {
    return FinishedTransfers{};
  }
  std::vector<int64_t> get_block_ids_with_load_errors() override { return {}; }
  void shutdown() override {}
  bool set_buffer_reuse_waiter(BufferReuseWaiter waiter) override {
    waiter_ = std::move(waiter);
    return true;
  }

  OffloadStats stats() const { return stats_; }

 private:
  Expected<const layout::CacheLayer*> layer(std::string_view name) const;

  std::shared_ptr<HostStore> store_;
  std::map<std::string, layout::CacheLayer, std::less<>> layers_;
  OffloadMetadata metadata_;
  BufferReuseWaiter waiter_;
  OffloadStats stats_;
};

}  // namespace rd2h::connector

namespace rd2h::connector {

// Content keys of a prompt's full blocks: block i's key covers tokens [0, (i+1) * block_size),
// so equal keys mean equal prefixes.
std::vector<std::string> block_keys(const std::vector<int64_t>& tokens, uint64_t block_size);

// The host-offload connector's scheduler role: matches a prompt's leading full blocks
// against the store, loads them into the request's first blocks, and saves every full block
// the engine computes.
class HostOffloadScheduler final : public KvConnectorScheduler {
 public:
  // `probe_layer`: the layer whose presence in the store marks a block as stored (the last
  // layer saved). `group`: the KV-cache group whose block ids the store follows.
  HostOffloadScheduler(std::shared_ptr<HostStore> store, std::string probe_layer,
                       uint64_t block_size, size_t group = 0)
      : store_(std::move(store)),
        probe_layer_(std::move(probe_layer)),
        block_size_(block_size),
        group_(group) {}

  std::string_view name() const override { return "host-offload"; }
  MatchedTokens get_num_new_matched_tokens(const Request& request,
                                           uint64_t num_computed_tokens) override;
  Status update_state_after_alloc(Request& request,
                                  const std::vector<std::vector<int64_t>>& block_ids,
                                  uint64_t num_external_tokens) override;
  Expected<std::vector<std::byte>> build_connector_meta(
      const std::vector<ScheduledRequest>& scheduled) override;
  Expected<FinishedRequest> request_finished(const Request& request) override;
  size_t tracked() const { return requests_.size(); }

 private:
  struct Tracked {
    std::vector<std::string> keys;
    std::vector<int64_t> blocks;
    size_t saved_upto = 0;  // blocks [0, saved_upto) are in the store
  };
  std::shared_ptr<HostStore> store_;
  std::string probe_layer_;
  uint64_t block_size_;
  size_t group_;
  std::map<std::string, Tracked> requests_;
  std::map<std::string, uint64_t> computed_;  // tokens computed locally when matched
  OffloadMetadata pending_;
};

}  // namespace rd2h::connector
