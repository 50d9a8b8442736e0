// MultiConnector (spec "AscendMultiConnector Integration"): composes connectors behind one
// KvConnectorWorker and one KvConnectorScheduler. rd2h runs first wherever buffer reuse depends
// on the order, and its wait_for_layer_send is the others' buffer-reuse waiter.
#pragma once

#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "rd2h/connector/kv_connector.h"

namespace rd2h::connector {

std::vector<std::byte> encode_multi(const std::vector<std::vector<std::byte>>& per_connector);
Expected<std::vector<std::vector<std::byte>>> decode_multi(std::span<const std::byte> bytes);

class MultiConnectorWorker final : public KvConnectorWorker {
 public:
  // `connectors` in composition order; the one named "rd2h", if any, is the completion
  // provider.
  explicit MultiConnectorWorker(std::vector<std::unique_ptr<KvConnectorWorker>> connectors);

  std::string_view name() const override { return "multi"; }
  Status register_kv_caches(std::vector<layout::CacheLayer> layers, bool engine_allocated) override;
  Status bind_connector_metadata(std::span<const std::byte> metadata) override;
  void clear_connector_metadata() override;
  Status start_load_kv() override;
  Status wait_for_layer_load(std::string_view layer_name) override;
  Status save_kv_layer(std::string_view layer_name,
                       std::shared_ptr<prefill::WriteEvent> event) override;
  Status on_kv_cache_written(std::string_view layer_name) override;
  Status wait_for_layer_send(std::string_view layer_name) override;
  Status wait_for_save() override;
  Expected<FinishedTransfers> get_finished(const decode::AllGather& all_gather) override;
  std::vector<int64_t> get_block_ids_with_load_errors() override;
  void shutdown() override;

  KvConnectorWorker& connector(size_t i) { return *connectors_[i]; }

 private:
  // Calls `f` on every connector, the completion provider first; returns the first error
  // after all were called.
  template <typename F>
  Status each(F f);

  std::vector<std::unique_ptr<KvConnectorWorker>> connectors_;
  std::vector<KvConnectorWorker*> order_;  // the completion provider first
  KvConnectorWorker* provider_ = nullptr;
  // Another connector calls the provider's wait in its own wait_for_layer_load: the
  // provider's wait_for_layer_load is not called on top of it.
  bool provider_wait_delegated_ = false;
};

// MultiConnector, scheduler role: the first connector that matches tokens for a request
// loads it (those that report the request preempted are asked before the others); every
// connector that requires full blocks (rd2h does) still sees the request's
// complete block groups on update_state_after_alloc; at most one connector may return
// kv_transfer_params when a request finishes.
class MultiConnectorScheduler final : public KvConnectorScheduler {
 public:
  explicit MultiConnectorScheduler(std::vector<std::unique_ptr<KvConnectorScheduler>> connectors)
      : connectors_(std::move(connectors)) {}

  std::string_view name() const override { return "multi"; }
  MatchedTokens get_num_new_matched_tokens(const Request& request,
                                           uint64_t num_computed_tokens) override;
  Status update_state_after_alloc(Request& request,
                                  const std::vector<std::vector<int64_t>>& block_ids,
                                  uint64_t num_external_tokens) override;
  Expected<std::vector<std::byte>> build_connector_meta(
      const std::vector<ScheduledRequest>& scheduled) override;
  Expected<FinishedRequest> request_finished(const Request& request) override;
  bool requires_full_blocks_on_update_after_alloc() const override;

  KvConnectorScheduler& connector(size_t i) { return *connectors_[i]; }

 private:
  std::vector<std::unique_ptr<KvConnectorScheduler>> connectors_;
  std::map<std::string, size_t> chosen_;  // request -> the connector that loads it
};

}  // namespace rd2h::connector
