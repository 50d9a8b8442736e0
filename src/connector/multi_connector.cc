#include "rd2h/connector/multi_connector.h"

#include <cstring>
#include <nlohmann/json.hpp>

namespace rd2h::connector {

std::vector<std::byte> encode_multi(const std::vector<std::vector<std::byte>>& per_connector) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& blob : per_connector) {
    j.push_back(nlohmann::json::binary_t(
        std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(blob.data()),
                             reinterpret_cast<const uint8_t*>(blob.data()) + blob.size())));
  }
  const auto bytes = nlohmann::json::to_msgpack(j);
  std::vector<std::byte> out(bytes.size());
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

Expected<std::vector<std::vector<std::byte>>> decode_multi(std::span<const std::byte> bytes) {
  auto j = nlohmann::json::from_msgpack(
      reinterpret_cast<const uint8_t*>(bytes.data()),
      reinterpret_cast<const uint8_t*>(bytes.data()) + bytes.size(), true, false);
  if (j.is_discarded() || !j.is_array()) return invalid_argument("multi metadata: not an array");
  std::vector<std::vector<std::byte>> out;
  for (const auto& blob : j) {
    if (!blob.is_binary()) return invalid_argument("multi metadata: an entry is not bytes");
    const auto& b = blob.get_binary();
    out.emplace_back(reinterpret_cast<const std::byte*>(b.data()),
                     reinterpret_cast<const std::byte*>(b.data()) + b.size());
  }
  return out;
}

MultiConnectorWorker::MultiConnectorWorker(
    std::vector<std::unique_ptr<KvConnectorWorker>> connectors)
    : connectors_(std::move(connectors)) {
  for (auto& c : connectors_) {
    if (!provider_ && c->name() == "rd2h") provider_ = c.get();
  }
  if (provider_) order_.push_back(provider_);
  for (auto& c : connectors_) {
    if (c.get() == provider_) continue;
    order_.push_back(c.get());
    if (provider_) {
      KvConnectorWorker* rd2h = provider_;
      const bool taken = c->set_buffer_reuse_waiter(
          [rd2h](std::string_view layer) { return rd2h->wait_for_layer_send(layer); });
      provider_wait_delegated_ = provider_wait_delegated_ || taken;
    }
  }
}

template <typename F>
Status MultiConnectorWorker::each(F f) {
  Status first;
  for (KvConnectorWorker* c : order_) {
    Status st = f(*c);
    if (!st && first.is_ok()) first = st.with_context(c->name());
  }
  return first;
}

Status MultiConnectorWorker::register_kv_caches(std::vector<layout::CacheLayer> layers,
                                                bool engine_allocated) {
  return each([&](KvConnectorWorker& c) { return c.register_kv_caches(layers, engine_allocated); });
}

Status MultiConnectorWorker::bind_connector_metadata(std::span<const std::byte> metadata) {
  RD2H_TRY(blobs, decode_multi(metadata));
  if (blobs.size() != connectors_.size()) {
    return invalid_argument("multi metadata: " + std::to_string(blobs.size()) + " entries for " +
                            std::to_string(connectors_.size()) + " connectors");
  }
  Status first;
  for (size_t i = 0; i < connectors_.size(); ++i) {
    Status st = connectors_[i]->bind_connector_metadata(blobs[i]);
    if (!st && first.is_ok()) first = st.with_context(connectors_[i]->name());
  }
  return first;
}

void MultiConnectorWorker::clear_connector_metadata() {
  for (auto* c : order_) c->clear_connector_metadata();
}

Status MultiConnectorWorker::start_load_kv() {
  return each([](KvConnectorWorker& c) { return c.start_load_kv(); });
}

Status MultiConnectorWorker::wait_for_layer_load(std::string_view layer) {
  return each([&](KvConnectorWorker& c) {
    if (&c == provider_ && provider_wait_delegated_) return Status::ok();  // waited through
    return c.wait_for_layer_load(layer);
  });
}

Status MultiConnectorWorker::save_kv_layer(std::string_view layer,
                                           std::shared_ptr<prefill::WriteEvent> event) {
  return each([&](KvConnectorWorker& c) { return c.save_kv_layer(layer, event); });
}

Status MultiConnectorWorker::on_kv_cache_written(std::string_view layer) {
  return each([&](KvConnectorWorker& c) { return c.on_kv_cache_written(layer); });
}

Status MultiConnectorWorker::wait_for_layer_send(std::string_view layer) {
  return each([&](KvConnectorWorker& c) { return c.wait_for_layer_send(layer); });
}

Status MultiConnectorWorker::wait_for_save() {
  return each([](KvConnectorWorker& c) { return c.wait_for_save(); });
}

Expected<FinishedTransfers> MultiConnectorWorker::get_finished(const decode::AllGather& gather) {
  FinishedTransfers out;
  for (auto* c : order_) {
    auto f = c->get_finished(gather);
    if (!f) return f.status().with_context(c->name());
    out.sending.insert(out.sending.end(), f->sending.begin(), f->sending.end());
    out.recving.insert(out.recving.end(), f->recving.begin(), f->recving.end());
  }
  return out;
}

std::vector<int64_t> MultiConnectorWorker::get_block_ids_with_load_errors() {
  std::vector<int64_t> out;
  for (auto* c : order_) {
    auto e = c->get_block_ids_with_load_errors();
    out.insert(out.end(), e.begin(), e.end());
  }
  return out;
}

void MultiConnectorWorker::shutdown() {
  for (auto* c : order_) c->shutdown();
}

MatchedTokens MultiConnectorScheduler::get_num_new_matched_tokens(const Request& request,
                                                                  uint64_t num_computed_tokens) {
  // A connector holding the request from before its preemption decides its match first;
  // then the others, in composition order.
  std::vector<size_t> order;
  for (size_t i = 0; i < connectors_.size(); ++i) {
    if (connectors_[i]->reports_preempted(request)) order.push_back(i);
  }
  for (size_t i = 0; i < connectors_.size(); ++i) {
    if (!connectors_[i]->reports_preempted(request)) order.push_back(i);
  }
  for (size_t i : order) {
    const MatchedTokens m =
        connectors_[i]->get_num_new_matched_tokens(request, num_computed_tokens);
    if (m.tokens > 0) {
      chosen_[request.request_id] = i;
      return m;
    }
  }
  chosen_.erase(request.request_id);
  return {};
}

Status MultiConnectorScheduler::update_state_after_alloc(
    Request& request, const std::vector<std::vector<int64_t>>& block_ids,
    uint64_t num_external_tokens) {
  auto it = chosen_.find(request.request_id);
  const std::vector<std::vector<int64_t>> none(block_ids.size());
  Status first;
  for (size_t i = 0; i < connectors_.size(); ++i) {
    auto& c = *connectors_[i];
    Status st;
    if (it != chosen_.end() && it->second == i) {
      st = c.update_state_after_alloc(request, block_ids, num_external_tokens);
    } else if (c.requires_full_blocks_on_update_after_alloc()) {
      st = c.update_state_after_alloc(request, block_ids, 0);
    } else {
      st = c.update_state_after_alloc(request, none, 0);
    }
    if (!st && first.is_ok()) first = st.with_context(c.name());
  }
  return first;
}

Expected<std::vector<std::byte>> MultiConnectorScheduler::build_connector_meta(
    const std::vector<ScheduledRequest>& scheduled) {
  std::vector<std::vector<std::byte>> blobs;
  for (auto& c : connectors_) {
    auto m = c->build_connector_meta(scheduled);
    if (!m) return m.status().with_context(c->name());
    blobs.push_back(std::move(*m));
  }
  return encode_multi(blobs);
}

Expected<FinishedRequest> MultiConnectorScheduler::request_finished(const Request& request) {
  chosen_.erase(request.request_id);
  FinishedRequest out;
  std::string from;
  Status error;
  for (auto& c : connectors_) {
    auto f = c->request_finished(request);
    if (!f) {
      if (error.is_ok()) error = f.status().with_context(c->name());
      continue;
    }
    out.delay_free_blocks = out.delay_free_blocks || f->delay_free_blocks;
    if (f->params) {
      if (out.params && error.is_ok()) {
        error = failed_precondition("request " + request.request_id + ": both " + from + " and " +
                                    std::string(c->name()) + " returned kv_transfer_params");
      }
      out.params = std::move(f->params);
      from = std::string(c->name());
    }
  }
  if (!error.is_ok()) return error;
  return out;
}

bool MultiConnectorScheduler::requires_full_blocks_on_update_after_alloc() const {
  for (const auto& c : connectors_) {
    if (c->requires_full_blocks_on_update_after_alloc()) return true;
  }
  return false;
}

}  // namespace rd2h::connector
