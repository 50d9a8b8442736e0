#include "rd2h/connector/worker.h"

#include <algorithm>

#include "connector/module_configs.h"
#include "control/channel.h"
#include "decode/worker.h"
#include "layout/cache.h"
#include "prefill/worker.h"
#include "util/log.h"

namespace rd2h::connector {

Expected<std::unique_ptr<ConnectorWorker>> ConnectorWorker::create(
    ConnectorConfig config, Parallel parallel, int tp_rank,
    std::shared_ptr<transfer::TransferEngine> engine) {
  if (tp_rank < 0 || tp_rank >= parallel.tp_size) {
    return invalid_argument("TP rank " + std::to_string(tp_rank) + " is outside TP size " +
                            std::to_string(parallel.tp_size));
  }
  if (!engine) {
    RD2H_TRY(bound, transfer::bind_process_engine(config.engine_config(tp_rank)));
    engine = std::move(bound);
  }
  return std::unique_ptr<ConnectorWorker>(
      new ConnectorWorker(std::move(config), parallel, tp_rank, std::move(engine)));
}

ConnectorWorker::ConnectorWorker(ConnectorConfig config, Parallel parallel, int tp_rank,
                                 std::shared_ptr<transfer::TransferEngine> engine)
    : config_(std::move(config)),
      parallel_(parallel),
      tp_rank_(tp_rank),
      engine_(std::move(engine)),
      context_(control::Context::create()) {}

ConnectorWorker::~ConnectorWorker() {
  shutdown();
}

TransferStats ConnectorWorker::transfer_stats() const {
  TransferStats out;
  if (prefill_) {
    const auto p = prefill_->stats();
    out.readiness_sent = p.sender.readiness_sent;
    out.peer_failures = p.peer_failures;
  }
  if (!decode_) return out;
  const auto s = decode_->reader().stats();
  out.layers_done = s.layers_done;
  out.layers_failed = s.layers_failed;
  out.reads = s.reads;
  out.bytes_read = s.bytes_read;
  const auto h = decode_->reader().read_latency();
  out.read_seconds_bounds = h.bounds;
  out.read_seconds_buckets = h.buckets;
  out.read_seconds_sum = h.sum;
  return out;
}

void ConnectorWorker::shutdown() {
  prefill_.reset();
  decode_.reset();
}

Status ConnectorWorker::need(const void* worker, const char* call) const {
  if (worker) return Status::ok();
  return failed_precondition(std::string(call) + " before register_kv_caches (or after shutdown)");
}

Status ConnectorWorker::register_kv_caches(std::vector<layout::CacheLayer> layers,
                                           bool engine_allocated) {
  if (prefill_ || decode_) return failed_precondition("register_kv_caches called twice");
  if (config_.insecure) {
    log::warn(
        "connector: \"insecure\": true: control channels are neither authenticated nor "
        "encrypted; any host that reaches {} may take part",
        config_.host);
  }
  if (config_.role == KvRole::kProducer) {
    RD2H_TRY(w,
             prefill::Worker::create(prefill_config(config_, parallel_, tp_rank_, engine_allocated),
                                     engine_, context_, std::move(layers)));
    const auto& slots = w->slots();
    if (!config_.use_layerwise &&
        (slots.main_slot_count() < slots.layer_count() ||
         (slots.indexer_slot_count() > 0 && slots.indexer_slot_count() < slots.layer_count()))) {
      return invalid_argument(
          "use_layerwise=false publishes every layer at the end of the "
          "forward pass, which needs one buffer per layer; " +
          std::to_string(slots.layer_count()) + " layers share " +
          std::to_string(slots.main_slot_count()) + " buffers");
    }
    prefill_ = std::move(w);
    return Status::ok();
  }
  if (!config_.curve.enabled() && !config_.insecure && !control::is_loopback_host(config_.host)) {
    return failed_precondition("Decode would listen on " + config_.host +
                               ", not a loopback address, without CURVE keys "
                               "(\"insecure\": true listens without them)");
  }
  RD2H_TRY(w, decode::Worker::create(decode_config(config_, parallel_, tp_rank_, engine_allocated),
                                     engine_, context_, layers));
  decode_ = std::move(w);
  return Status::ok();
}

Status ConnectorWorker::bind_connector_metadata(const ConnectorMetadata& metadata) {
  metadata_ = metadata;
  saved_layers_.clear();
  if (prefill_) return prefill_->bind_step(metadata_.save);
  return Status::ok();
}

Status ConnectorWorker::bind_connector_metadata(std::span<const std::byte> metadata) {
  RD2H_TRY(decoded, decode_metadata(metadata));
  return bind_connector_metadata(decoded);
}

void ConnectorWorker::clear_connector_metadata() {
  metadata_ = {};
}

Status ConnectorWorker::start_load_kv() {
  if (!decode_) return Status::ok();
  for (const auto& ext_id : metadata_.abort) decode_->remove_request(ext_id);
  const auto deadline = std::chrono::steady_clock::now() + config_.kv_arrival_timeout;
  for (const auto& r : metadata_.load) {
    RD2H_RETURN_IF_ERROR(
        decode_->add_request(r.ext_id, r.internal_id, r.main_blocks, r.indexer_blocks, deadline));
  }
  return Status::ok();
}

Status ConnectorWorker::wait_for_layer_load(std::string_view layer_name) {
  if (config_.role != KvRole::kProducer) return Status::ok();
  RD2H_RETURN_IF_ERROR(need(prefill_.get(), "wait_for_layer_load"));
  // vLLM calls this before an attention layer writes its KV and never calls
  // wait_for_layer_send: the write may reuse a physical buffer Decode is still reading.
  auto index = layout::layer_index_from_name(layer_name);
  if (!index) return Status::ok();  // not a numbered layer: it owns no slot
  return prefill_->wait_for_layer_reuse(*index);
}

Status ConnectorWorker::save_kv_layer(std::string_view layer_name,
                                      std::shared_ptr<prefill::WriteEvent> event) {
  if (config_.role != KvRole::kProducer) return Status::ok();
  RD2H_RETURN_IF_ERROR(need(prefill_.get(), "save_kv_layer"));
  if (!config_.use_layerwise) {
    saved_layers_.emplace_back(std::string(layer_name), std::move(event));
    return Status::ok();
  }
  return prefill_->save_kv_layer(layer_name, std::move(event));
}

Status ConnectorWorker::on_kv_cache_written(std::string_view) {
  return Status::ok();
}

Status ConnectorWorker::wait_for_layer_send(std::string_view layer_name) {
  if (config_.role != KvRole::kProducer) return Status::ok();
  RD2H_RETURN_IF_ERROR(need(prefill_.get(), "wait_for_layer_send"));
  return prefill_->wait_for_layer_send(layer_name);
}

Status ConnectorWorker::wait_for_save() {
  if (config_.role != KvRole::kProducer) return Status::ok();
  RD2H_RETURN_IF_ERROR(need(prefill_.get(), "wait_for_save"));
  std::vector<std::pair<std::string, std::shared_ptr<prefill::WriteEvent>>> layers;
  layers.swap(saved_layers_);
  for (auto& [name, event] : layers) {
    RD2H_RETURN_IF_ERROR(prefill_->save_kv_layer(name, std::move(event)));
  }
  return prefill_->wait_for_save();
}

Expected<FinishedTransfers> ConnectorWorker::get_finished(const decode::AllGather& all_gather) {
  FinishedTransfers out;
  if (config_.role != KvRole::kConsumer) return out;
  RD2H_RETURN_IF_ERROR(need(decode_.get(), "get_finished"));
  RD2H_TRY(done, decode_->get_finished(all_gather));
  for (auto* ids : {&done.finished, &done.failed}) {
    for (auto& id : *ids) out.recving.push_back(id);
  }
  // This call's only: a host that stages no KV never takes them, and nothing piles up.
  loaded_ = {std::move(done.loaded_main_blocks), std::move(done.loaded_indexer_blocks)};
  load_errors_.insert(load_errors_.end(), done.invalid_main_blocks.begin(),
                      done.invalid_main_blocks.end());
  load_errors_.insert(load_errors_.end(), done.invalid_indexer_blocks.begin(),
                      done.invalid_indexer_blocks.end());
  return out;
}

namespace {
void sort_distinct(std::vector<int64_t>& ids) {
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
}
}  // namespace

ConnectorWorker::BlockIds ConnectorWorker::step_blocks() const {
  BlockIds out;
  for (const auto& r : metadata_.save) {
    out.main.insert(out.main.end(), r.main_block_ids.begin(), r.main_block_ids.end());
    out.indexer.insert(out.indexer.end(), r.indexer_block_ids.begin(), r.indexer_block_ids.end());
  }
  sort_distinct(out.main);
  sort_distinct(out.indexer);
  return out;
}

ConnectorWorker::BlockIds ConnectorWorker::take_loaded_blocks() {
  BlockIds out;
  std::swap(out, loaded_);
  sort_distinct(out.main);
  sort_distinct(out.indexer);
  return out;
}

std::vector<int64_t> ConnectorWorker::get_block_ids_with_load_errors() {
  std::vector<int64_t> out;
  out.swap(load_errors_);
  return out;
}

}  // namespace rd2h::connector
