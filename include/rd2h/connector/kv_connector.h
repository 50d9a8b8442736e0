// The worker role of a KV connector as a host engine drives it, whatever the connector:
// rd2h's ConnectorWorker, the host-offload connector, or a MultiConnector composing them.
// Each connector reads its own per-step metadata from bytes its scheduler produced.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "rd2h/common/status.h"
#include "rd2h/connector/metadata.h"
#include "rd2h/decode/all_gather.h"
#include "rd2h/layout/cache_layer.h"
#include "rd2h/prefill/write_event.h"

namespace rd2h::connector {

struct FinishedTransfers {
  std::vector<std::string> sending;  // Prefill: requests whose blocks may be freed now
  std::vector<std::string> recving;  // Decode: requests done loading (or failed: see errors)
};

// A request as the scheduler sees it.
struct Request {
  std::string request_id;  // the host engine's id
  uint64_t num_prompt_tokens = 0;
  std::optional<KvTransferParams> params;  // its kv_transfer_params, when it has them
  // The prompt's tokens, for connectors that key blocks by content (may be empty).
  std::vector<int64_t> prompt_token_ids;
};

// A request scheduled in this step (Prefill): its KV-cache blocks allocated since the last
// call, per group, and how many of its tokens are computed once this step ran. A request
// resumed after a preemption lost its blocks: new_block_ids is then its whole block list.
struct ScheduledRequest {
  std::string request_id;
  std::vector<std::vector<int64_t>> new_block_ids;  // per group; empty: none
  uint64_t num_computed_tokens = 0;
  bool resumed = false;  // new_block_ids replaces the request's blocks
};

struct MatchedTokens {
  uint64_t tokens = 0;
  bool load_async = false;
};

struct FinishedRequest {
  bool delay_free_blocks = false;
  std::optional<KvTransferParams> params;  // for the proxy; rd2h returns none
};

// The scheduler role of a KV connector as a host engine drives it (vLLM's names).
// build_connector_meta's bytes
// go to every worker of the engine for the step, to the same connector's worker role.
class KvConnectorScheduler {
 public:
  virtual ~KvConnectorScheduler() = default;
  virtual std::string_view name() const = 0;
  virtual MatchedTokens get_num_new_matched_tokens(const Request& request,
                                                   uint64_t num_computed_tokens) = 0;
  virtual Status update_state_after_alloc(Request& request,
                                          const std::vector<std::vector<int64_t>>& block_ids,
                                          uint64_t num_external_tokens) = 0;
  virtual Expected<std::vector<std::byte>> build_connector_meta(
      const std::vector<ScheduledRequest>& scheduled) = 0;
  virtual Expected<FinishedRequest> request_finished(const Request& request) = 0;
  // Whether update_state_after_alloc must see the request's full block groups even when
  // another connector was chosen to load it.
  virtual bool requires_full_blocks_on_update_after_alloc() const { return false; }
  // Whether this connector holds state for the request from before a preemption (it saved
  // or was loading the request's KV): a MultiConnector then asks it first for the match.
  virtual bool reports_preempted(const Request& request) const {
    (void)request;
    return false;
  }
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

  // MultiConnector hands rd2h's wait_for_layer_send to the others. A connector that takes
  // it returns true and calls it in its wait_for_layer_load before any of that layer's
  // buffers may be written (whether or not it writes them itself): rd2h's own
  // wait_for_layer_load is then not called on top of it.
  virtual bool set_buffer_reuse_waiter(BufferReuseWaiter waiter) {
    (void)waiter;
    return false;
  }
};

}  // namespace rd2h::connector
