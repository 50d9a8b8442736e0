// The worker half of the connector (vLLM's KV Connector V1 worker role), one per TP rank. One
// thread calls it, per step: bind_connector_metadata, start_load_kv, per layer wait_for_layer_load
// and save_kv_layer, then wait_for_save, clear_connector_metadata and get_finished.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "rd2h/common/status.h"
#include "rd2h/connector/config.h"
#include "rd2h/connector/stats.h"
#include "rd2h/connector/kv_connector.h"
#include "rd2h/connector/metadata.h"
#include "rd2h/connector/scheduler.h"
#include "rd2h/layout/cache_layer.h"
#include "rd2h/prefill/write_event.h"
#include "rd2h/transfer/transfer_engine.h"

namespace rd2h::control {
class Context;
}  // namespace rd2h::control
namespace rd2h::decode {
class Worker;
}  // namespace rd2h::decode
namespace rd2h::prefill {
class Worker;
}  // namespace rd2h::prefill

namespace rd2h::connector {

namespace testing {
struct WorkerAccess;
}  // namespace testing

class ConnectorWorker final : public KvConnectorWorker {
 public:
  // `engine` is this process's transfer engine; null binds the process engine from `config`.
  static Expected<std::unique_ptr<ConnectorWorker>> create(
      ConnectorConfig config, Parallel parallel, int tp_rank,
      std::shared_ptr<transfer::TransferEngine> engine = nullptr);
  ~ConnectorWorker() override;

  std::string_view name() const override { return "rd2h"; }
  // The rank's caches, one entry per attention layer (main tensors, indexer, scale).
  // `engine_allocated`: they live in memory the engine allocated (already registered).
  Status register_kv_caches(std::vector<layout::CacheLayer> layers,
                            bool engine_allocated = false) override;

  Status bind_connector_metadata(const ConnectorMetadata& metadata);
  Status bind_connector_metadata(std::span<const std::byte> metadata) override;
  void clear_connector_metadata() override;
  // Decode: expect the step's new requests and drop the aborted ones.
  Status start_load_kv() override;
  // Decode loads whole requests in the background: a layer never waits here. Prefill: the
  // host is about to write the layer's KV, so this waits until Decode answered for what the
  // layer's physical buffers held before (as wait_for_layer_send does); a name without
  // "layers.<n>" does not wait.
  Status wait_for_layer_load(std::string_view layer_name) override;
  // Prefill: the layer's KV is written (or will be once `event` completes): publish it.
  Status save_kv_layer(std::string_view layer_name,
                       std::shared_ptr<prefill::WriteEvent> event = nullptr) override;
  // Layerwise hosts report the write here; rd2h publishes in save_kv_layer.
  Status on_kv_cache_written(std::string_view layer_name) override;
  Status wait_for_layer_send(std::string_view layer_name) override;
  Status wait_for_save() override;
  // Decode gathers over the TP group with `all_gather`; a request whose KV has not arrived
  // within kv_arrival_timeout fails. Prefill returns nothing (blocks are free once
  // wait_for_save returned).
  Expected<FinishedTransfers> get_finished(const decode::AllGather& all_gather) override;
  // Decode: destination blocks of the requests that failed since the last call.
  std::vector<int64_t> get_block_ids_with_load_errors() override;
  // Main and indexer block ids, each sorted and distinct. Prefill: the blocks the bound
  // step publishes (what a host staging KV through host buffers copies there first).
  // Decode: the destinations of the requests the last get_finished reported finished (what
  // such a host copies to the device before it reports them); taken once.
  struct BlockIds {
    std::vector<int64_t> main, indexer;
  };
  BlockIds step_blocks() const;
  BlockIds take_loaded_blocks();
  // Decode: what this rank has read so far.
  TransferStats transfer_stats() const;
  // Stops the connector's threads and unregisters its memory. Idempotent.
  void shutdown() override;

 private:
  friend struct testing::WorkerAccess;
  ConnectorWorker(ConnectorConfig config, Parallel parallel, int tp_rank,
                  std::shared_ptr<transfer::TransferEngine> engine);
  Status need(const void* worker, const char* call) const;

  ConnectorConfig config_;
  Parallel parallel_;
  int tp_rank_;
  std::shared_ptr<transfer::TransferEngine> engine_;
  std::shared_ptr<control::Context> context_;
  std::unique_ptr<prefill::Worker> prefill_;
  std::unique_ptr<decode::Worker> decode_;
  ConnectorMetadata metadata_;
  // Prefill without use_layerwise: the layers saved this step, published in wait_for_save.
  std::vector<std::pair<std::string, std::shared_ptr<prefill::WriteEvent>>> saved_layers_;
  std::vector<int64_t> load_errors_;
  BlockIds loaded_;
};

}  // namespace rd2h::connector
