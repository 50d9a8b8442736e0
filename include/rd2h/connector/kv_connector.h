// The worker role of a KV connector as a host engine drives it, whatever the connector:
// rd2h's ConnectorWorker, the host-offload connector, or a MultiConnector composing them.
// Each connector reads its own per-step metadata from bytes its scheduler produced.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "rd2h/common/status.h"
#include "rd2h/decode/completion_tracker.h"
#include "rd2h/layout/cache.h"
#include "rd2h/prefill/write_event.h"

namespace rd2h::connector {

struct FinishedTransfers {
  std::vector<std::string> sending;  // Prefill: requests whose blocks may be freed now
  std::vector<std::string> recving;  // Decode: requests done loading (or failed: see errors)
};

// Returns once what a layer's physical buffers hold may be overwritten.
using BufferReuseWaiter = std::function<Status(std::string_view layer_name)>;

class KvConnectorWorker {
 public:
  virtual ~KvConnectorWorker() = default;
  virtual std::string_view name() const = 0;

  // `engine_allocated`: the caches live in memory the transfer engine allocated.
  virtual Status register_kv_caches(std::vector<layout::CacheLayer> layers,
                                    bool engine_allocated) = 0;
  virtual Status bind_connector_metadata(std::span<const std::byte> metadata) = 0;
  virtual void clear_connector_metadata() = 0;
  virtual Status start_load_kv() = 0;
  virtual Status wait_for_layer_load(std::string_view layer_name) = 0;
  virtual Status save_kv_layer(std::string_view layer_name,
                               std::shared_ptr<prefill::WriteEvent> event) = 0;
  virtual Status on_kv_cache_written(std::string_view layer_name) = 0;
  virtual Status wait_for_layer_send(std::string_view layer_name) = 0;
  virtual Status wait_for_save() = 0;
  virtual Expected<FinishedTransfers> get_finished(const decode::AllGather& all_gather) = 0;
  virtual std::vector<int64_t> get_block_ids_with_load_errors() = 0;
  virtual void shutdown() = 0;

  // A connector that overwrites or publishes physical layer buffers waits on this first;
  // MultiConnector hands rd2h's wait_for_layer_send to the others.
  virtual void set_buffer_reuse_waiter(BufferReuseWaiter waiter) { (void)waiter; }
};

}  // namespace rd2h::connector
