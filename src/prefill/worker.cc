#include "prefill/worker.h"

#include <algorithm>
#include <set>

#include "control/curve.h"
#include "prefill/layer_meta.h"
#include "topology/topology.h"
#include "util/log.h"

namespace rd2h::prefill {

Expected<std::unique_ptr<Worker>> Worker::create(WorkerConfig config,
                                                 std::shared_ptr<transfer::TransferEngine> engine,
                                                 std::shared_ptr<control::Context> context,
                                                 std::vector<layout::CacheLayer> layers) {
  if (config.p_tp < 1 || config.p_rank < 0 || config.p_rank >= config.p_tp) {
    return invalid_argument("Prefill rank " + std::to_string(config.p_rank) +
                            " is outside TP size " + std::to_string(config.p_tp));
  }
  if (layers.empty()) return invalid_argument("no KV cache layers to register");
  auto worker = std::unique_ptr<Worker>(new Worker(config, std::move(engine)));
  RD2H_TRY(sorted, worker->take_layers(std::move(layers)));
  RD2H_RETURN_IF_ERROR(worker->index_layers());
  if (config.register_memory) RD2H_RETURN_IF_ERROR(worker->register_caches(sorted));
  RD2H_RETURN_IF_ERROR(worker->describe_caches(sorted));
  RD2H_TRY(sender,
           Sender::start(config.sender, std::move(context), worker->mf_meta_, worker->engine_));
  worker->sender_ = std::move(sender);
  return worker;
}

Expected<std::vector<layout::CacheLayer>> Worker::take_layers(
    std::vector<layout::CacheLayer> layers) {
  for (auto& layer : layers) {
    RD2H_TRY(index, layout::layer_index_from_name(layer.name));
    RD2H_TRY(tensors, layout::to_layer_tensors(layer));
    layers_.push_back({layer.name, index, std::move(tensors)});
  }
  std::vector<size_t> order(layers.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return layers_[a].index < layers_[b].index; });
  std::vector<Layer> ordered;
  std::vector<layout::CacheLayer> sorted;
  for (size_t i : order) {
    ordered.push_back(std::move(layers_[i]));
    sorted.push_back(std::move(layers[i]));
  }
  layers_ = std::move(ordered);
  return sorted;
}

Status Worker::index_layers() {
  std::vector<layout::LayerTensors> tensors;
  min_blocks_ = UINT64_MAX;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& l = layers_[i];
    if (i > 0 && l.index == layers_[i - 1].index) {
      return invalid_argument("layers '" + layers_[i - 1].name + "' and '" + l.name +
                              "' have the same layer index " + std::to_string(l.index));
    }
    by_name_.emplace(l.name, i);
    tensors.push_back(l.tensors);
    min_blocks_ = std::min(min_blocks_, l.tensors.num_blocks);
  }
  slots_ = layout::StorageSlots::infer(tensors);
  for (size_t i = 0; i < slots_.main_slot_count(); ++i) {
    main_gates_.push_back(std::make_unique<SlotGate>());
  }
  for (size_t i = 0; i < slots_.indexer_slot_count(); ++i) {
    indexer_gates_.push_back(std::make_unique<SlotGate>());
  }
  return Status::ok();
}

Status Worker::register_caches(const std::vector<layout::CacheLayer>& sorted) {
  for (const auto& region : layout::merged_regions(sorted)) {
    void* addr = reinterpret_cast<void*>(region.addr);
    RD2H_RETURN_IF_ERROR(
        engine_->register_memory(addr, region.length).with_context("registering the KV caches"));
    registered_.push_back(addr);
  }
  return Status::ok();
}

Status Worker::describe_caches(const std::vector<layout::CacheLayer>& sorted) {
  RD2H_TRY(metadata, engine_->export_metadata());
  protocol::MfMeta& meta = mf_meta_;
  meta.p_session = engine_->session_id();
  for (const auto& layer : sorted) meta.layers.emplace_back(layer.name, to_layer_meta(layer));
  meta.protocol_version = protocol::kProtocolVersion;
  meta.cache_layout_version = protocol::kCacheLayoutVersion;
  meta.backend_name = std::string(engine_->backend_name());
  meta.backend_metadata = std::move(metadata);
  return Status::ok();
}

Worker::Worker(WorkerConfig config, std::shared_ptr<transfer::TransferEngine> engine)
    : config_(config), engine_(std::move(engine)) {}

Worker::~Worker() {
  sender_.reset();
  for (void* addr : registered_) (void)engine_->unregister_memory(addr);
}

Expected<size_t> Worker::find_layer(std::string_view name) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) {
    return not_found("layer '" + std::string(name) + "' is not a registered KV cache layer");
  }
  return it->second;
}

std::vector<SlotGate*> Worker::gates_of(size_t layer) {
  const layout::LayerSlots& s = slots_.of(layer);
  std::vector<SlotGate*> gates{main_gates_[s.main].get()};
  if (s.indexer) gates.push_back(indexer_gates_[*s.indexer].get());
  return gates;
}

Expected<std::string> Worker::decode_key(const SendRequest& r) const {
  const auto& trusted = config_.trusted_decode_keys;
  if (!config_.sender.curve) {
    if (config_.insecure || control::is_loopback_host(r.d_host)) return std::string();
    return failed_precondition("request " + r.ext_id + ": Decode host " + r.d_host +
                               " is not a loopback address, and this Prefill has no CURVE "
                               "keys (\"insecure\": true sends without them)");
  }
  if (!r.d_public_key.empty()) {
    if (std::find(trusted.begin(), trusted.end(), r.d_public_key) == trusted.end()) {
      return failed_precondition("request " + r.ext_id + ": Decode " + r.d_host + " gave key " +
                                 r.d_public_key + ", which this Prefill does not trust");
    }
    return r.d_public_key;
  }
  if (trusted.size() == 1) return trusted.front();
  return failed_precondition("request " + r.ext_id + ": Decode " + r.d_host +
                             " gave no public key (remote_public_key) and this Prefill trusts " +
                             std::to_string(trusted.size()) + " Decode keys");
}

Status Worker::check_request(const SendRequest& r) const {
  if (r.main_start < 0 || r.indexer_start < 0) {
    return invalid_argument("request " + r.ext_id + ": negative destination offset");
  }
  for (const auto& [ids, what] :
       {std::pair{&r.main_block_ids, "main"}, std::pair{&r.indexer_block_ids, "indexer"}}) {
    for (int64_t id : *ids) {
      if (id < 0 || static_cast<uint64_t>(id) >= min_blocks_) {
        return out_of_range("request " + r.ext_id + ": " + what + " block " + std::to_string(id) +
                            " is outside the " + std::to_string(min_blocks_) +
                            " blocks of Prefill's cache");
      }
    }
  }
  return Status::ok();
}

Status Worker::bind_step(std::vector<SendRequest> requests) {
  std::vector<Target> targets;
  std::set<std::string> seen;
  for (auto& r : requests) {
    if (!seen.insert(r.ext_id).second) {
      return invalid_argument("request " + r.ext_id + " appears twice in one step");
    }
    // A request its Decode cannot be sent to (an address, a TP size or a key that does not
    // work out) fails alone, unless failures are to raise.
    auto refuse = [&](const Status& why) {
      if (config_.raise_on_peer_failure) return why;
      ++stats_.peer_failures;
      log::warn("prefill rank {}: {}; the request is not sent", config_.p_rank, why.to_string());
      return Status::ok();
    };
    if (Status st = check_request(r); !st) {
      RD2H_RETURN_IF_ERROR(refuse(st));
      continue;
    }
    auto tp = topology::make_tp_mapping(config_.p_tp, r.d_tp);
    auto position = tp ? topology::contributor_of(*tp, config_.p_rank)
                       : Expected<topology::ContributorPosition>(tp.status());
    auto port = tp ? topology::remote_rank_port(r.d_base_port, *tp, config_.p_rank)
                   : Expected<int>(tp.status());
    auto server_key = decode_key(r);
    if (!tp || !position || !port || !server_key) {
      const Status why = !tp         ? tp.status()
                         : !position ? position.status()
                         : !port     ? port.status()
                                     : server_key.status();
      RD2H_RETURN_IF_ERROR(refuse(why.with_context("request " + r.ext_id)));
      continue;
    }
    const std::string url = control::endpoint_url(r.d_host, *port);
    auto target =
        std::find_if(targets.begin(), targets.end(), [&](const Target& t) { return t.url == url; });
    if (target == targets.end()) {
      Target t;
      t.url = url;
      t.server_key = *server_key;
      t.ready.group_member_idx = position->group_member_idx;
      t.ready.tp_ratio = tp->ratio;
      targets.push_back(std::move(t));
      target = targets.end() - 1;
    } else if (target->ready.tp_ratio != tp->ratio) {
      return invalid_argument("request " + r.ext_id + ": Decode endpoint " + url +
                              " is given TP size " + std::to_string(r.d_tp) +
                              " by one request and another by an earlier one");
    }
    if (!r.main_block_ids.empty() || !r.indexer_block_ids.empty()) {
      target->ready.read_reqs.push_back({r.ext_id, std::move(r.main_block_ids),
                                         std::move(r.indexer_block_ids), r.main_start,
                                         r.indexer_start});
    }
    if (r.final_chunk) target->final_ids.push_back(r.ext_id);
  }
  for (auto& t : targets) {
    t.body = protocol::encode_readiness_body(t.ready);
    t.ready.done_ext_ids = t.final_ids;
    t.body_last = protocol::encode_readiness_body(t.ready);
    t.ready.done_ext_ids.clear();
  }
  targets_ = std::move(targets);
  ++step_;
  return Status::ok();
}

Status Worker::save_kv_layer(std::string_view layer_name, std::shared_ptr<WriteEvent> event) {
  RD2H_TRY(found, find_layer(layer_name));
  const Layer& layer = layers_[found];
  const bool last = found + 1 == layers_.size();  // the last cache-bearing layer

  std::vector<const Target*> sending;
  for (const auto& t : targets_) {
    if (!t.ready.read_reqs.empty() || (last && !t.final_ids.empty())) sending.push_back(&t);
  }
  // The reuse gate: what the slots held before must be answered for. Checked for every
  // slot before any is opened, so a failure leaves every gate as it was.
  const std::vector<SlotGate*> gates = gates_of(found);
  const Deadline deadline(config_.send_timeout);
  for (SlotGate* gate : gates) {
    RD2H_RETURN_IF_ERROR(wait_reusable(*gate, deadline)
                             .with_context("layer " + std::to_string(layer.index) +
                                           " cannot take its storage slot"));
  }
  std::vector<GateTicket> tickets;
  for (SlotGate* gate : gates) {
    tickets.push_back({gate, gate->open(layer.index, sending.size(), step_)});
  }
  for (const Target* t : sending) {
    sender_->send(
        t->url, layer.index,
        protocol::encode_readiness(layer.index, layer.name, last ? t->body_last : t->body), tickets,
        event, t->server_key, last ? t->final_ids : std::vector<std::string>{});
  }
  ++stats_.layers_saved;
  stats_.readiness_queued += sending.size();
  return Status::ok();
}

Status Worker::wait_for_layer_send(std::string_view layer_name) {
  RD2H_TRY(found, find_layer(layer_name));
  const Deadline deadline(config_.send_timeout);
  for (SlotGate* gate : gates_of(found)) {
    RD2H_RETURN_IF_ERROR(
        wait_reusable(*gate, deadline)
            .with_context("waiting for Decode to read " + std::string(layer_name)));
  }
  return Status::ok();
}

Status Worker::wait_for_layer_reuse(int64_t layer_index) {
  auto it = std::lower_bound(layers_.begin(), layers_.end(), layer_index,
                             [](const Layer& l, int64_t index) { return l.index < index; });
  if (it == layers_.end() || it->index != layer_index) {
    // A layer that was never registered has no slot to wait for: the caller's model and
    // the caches it registered disagree, and nothing it writes is guarded.
    return invalid_argument("layer index " + std::to_string(layer_index) +
                            " was never registered (" + std::to_string(layers_.size()) +
                            " layers were" +
                            (layers_.empty() ? std::string()
                                             : ", " + std::to_string(layers_.front().index) +
                                                   " to " + std::to_string(layers_.back().index)) +
                            ")");
  }
  return wait_for_layer_send(it->name);
}

Status Worker::wait_for_save() {
  const Deadline deadline(config_.send_timeout);
  Status first;
  for (auto* gates : {&main_gates_, &indexer_gates_}) {
    for (auto& gate : *gates) {
      Status st = wait_reusable(*gate, deadline);
      if (!st && first.is_ok()) first = st.with_context("waiting for Decode to read the step");
    }
  }
  return first;
}

Status Worker::wait_reusable(SlotGate& gate, const Deadline& deadline) {
  Status st = gate.settle(deadline);
  // Not answered in time: this rank's own wait ran out (the sender fails a Decode that
  // does not answer within reply_timeout, before).
  if (st.is_ok() || !gate.answered()) return st;
  const uint64_t step = gate.tag();
  const bool first = raised_steps_.insert(step).second;
  while (raised_steps_.size() > 64) raised_steps_.erase(raised_steps_.begin());
  if (!config_.raise_on_peer_failure) {
    ++stats_.peer_failures;
    if (first) {
      log::warn("prefill rank {}: {}; only the requests sent to that Decode fail", config_.p_rank,
                st.to_string());
    }
    return Status::ok();
  }
  return first ? st : Status::ok();  // a step raises once
}

WorkerStats Worker::stats() const {
  WorkerStats s = stats_;
  s.sender = sender_->stats();
  return s;
}

}  // namespace rd2h::prefill
