#include "rd2h/connector/host_offload.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "layout/cache.h"

namespace rd2h::connector {

using nlohmann::json;

void HostStore::put(const std::string& key, const std::string& layer,
                    std::vector<std::byte> bytes) {
  auto value = std::make_shared<const std::vector<std::byte>>(std::move(bytes));
  std::lock_guard lock(mu_);
  blocks_[{key, layer}] = std::move(value);
}

std::shared_ptr<const std::vector<std::byte>> HostStore::get(const std::string& key,
                                                             const std::string& layer) const {
  std::lock_guard lock(mu_);
  auto it = blocks_.find({key, layer});
  return it == blocks_.end() ? nullptr : it->second;
}

size_t HostStore::size() const {
  std::lock_guard lock(mu_);
  return blocks_.size();
}

std::vector<std::byte> encode(const OffloadMetadata& m) {
  json j;
  for (const auto* list : {&m.save, &m.load}) {
    json a = json::array();
    for (const auto& b : *list) a.push_back({b.key, b.block_id});
    j[list == &m.save ? "save" : "load"] = a;
  }
  const auto bytes = json::to_msgpack(j);
  std::vector<std::byte> out(bytes.size());
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

Expected<OffloadMetadata> decode_offload_metadata(std::span<const std::byte> bytes) {
  auto j = json::from_msgpack(reinterpret_cast<const uint8_t*>(bytes.data()),
                              reinterpret_cast<const uint8_t*>(bytes.data()) + bytes.size(),
                              /*strict=*/true, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return invalid_argument("offload metadata: not a map");
  OffloadMetadata m;
  try {
    for (const auto& b : j.at("save")) m.save.push_back({b.at(0), b.at(1)});
    for (const auto& b : j.at("load")) m.load.push_back({b.at(0), b.at(1)});
  } catch (const std::exception& e) {
    return invalid_argument(std::string("offload metadata: ") + e.what());
  }
  return m;
}

Status HostOffloadWorker::register_kv_caches(std::vector<layout::CacheLayer> layers, bool) {
  for (auto& l : layers) {
    RD2H_TRY(checked, layout::to_layer_tensors(l));
    std::string name = l.name;
    layers_.emplace(std::move(name), std::move(l));
  }
  return Status::ok();
}

Status HostOffloadWorker::bind_connector_metadata(std::span<const std::byte> metadata) {
  RD2H_TRY(m, decode_offload_metadata(metadata));
  for (const auto* list : {&m.save, &m.load}) {
    for (const auto& b : *list) {
      for (const auto& [name, l] : layers_) {
        if (b.block_id < 0 || static_cast<uint64_t>(b.block_id) * l.tensors[0].bytes_per_block() >=
                                  l.tensors[0].bytes) {
          return out_of_range("offload block " + std::to_string(b.block_id) +
                              " is outside layer '" + name + "'");
        }
      }
    }
  }
  metadata_ = std::move(m);
  return Status::ok();
}

Expected<const layout::CacheLayer*> HostOffloadWorker::layer(std::string_view name) const {
  auto it = layers_.find(name);
  if (it == layers_.end()) return not_found("layer '" + std::string(name) + "' is not registered");
  return &it->second;
}

Status HostOffloadWorker::wait_for_layer_load(std::string_view layer_name) {
  RD2H_TRY(l, layer(layer_name));
  // The buffers may still be read for their previous owner: wait before they are written,
  // by this load or by the layer's compute (the waiter's owner leaves that wait to us).
  if (waiter_) {
    ++stats_.reuse_waits;
    RD2H_RETURN_IF_ERROR(
        waiter_(layer_name).with_context("host offload, loading " + std::string(layer_name)));
  }
  if (metadata_.load.empty()) return Status::ok();
  for (const auto& b : metadata_.load) {
    auto saved = store_->get(b.key, l->name);
    if (!saved) {
      return not_found("host offload: block '" + b.key + "' of " + std::string(layer_name) +
                       " is not in the store");
    }
    size_t offset = 0;
    for (const auto& t : l->tensors) {
      const uint64_t n = t.bytes_per_block();
      if (offset + n > saved->size()) return internal_error("host offload: short stored block");
      std::memcpy(reinterpret_cast<void*>(t.addr + static_cast<uint64_t>(b.block_id) * n),
                  saved->data() + offset, n);
      offset += n;
    }
    ++stats_.blocks_loaded;
  }
  return Status::ok();
}

Status HostOffloadWorker::save_kv_layer(std::string_view layer_name,
                                        std::shared_ptr<prefill::WriteEvent> event) {
  RD2H_TRY(l, layer(layer_name));
  if (event) RD2H_RETURN_IF_ERROR(event->wait(Deadline(std::chrono::seconds(60))));
  for (const auto& b : metadata_.save) {
    std::vector<std::byte> bytes;
    for (const auto& t : l->tensors) {
      const uint64_t n = t.bytes_per_block();
      const auto* src =
          reinterpret_cast<const std::byte*>(t.addr + static_cast<uint64_t>(b.block_id) * n);
      bytes.insert(bytes.end(), src, src + n);
    }
    store_->put(b.key, l->name, std::move(bytes));
    ++stats_.blocks_saved;
  }
  return Status::ok();
}

}  // namespace rd2h::connector

namespace rd2h::connector {

std::vector<std::string> block_keys(const std::vector<int64_t>& tokens, uint64_t block_size) {
  std::vector<std::string> keys;
  if (block_size == 0) return keys;
  uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a over the token ids, chained block to block
  for (size_t i = 0; i + block_size <= tokens.size(); i += block_size) {
    for (size_t k = i; k < i + block_size; ++k) {
      for (int b = 0; b < 8; ++b) {
        h ^= (static_cast<uint64_t>(tokens[k]) >> (8 * b)) & 0xff;
        h *= 0x100000001b3ULL;
      }
    }
    char text[17];
    std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(h));
    keys.emplace_back(text);
  }
  return keys;
}

MatchedTokens HostOffloadScheduler::get_num_new_matched_tokens(const Request& request,
                                                               uint64_t num_computed_tokens) {
  const auto keys = block_keys(request.prompt_token_ids, block_size_);
  size_t hits = 0;
  while (hits < keys.size() && store_->get(keys[hits], probe_layer_)) ++hits;
  // The engine computes at least the prompt's last token itself.
  const uint64_t limit = request.num_prompt_tokens == 0 ? 0 : request.num_prompt_tokens - 1;
  const uint64_t matched =
      std::min<uint64_t>(hits * block_size_, limit) / block_size_ * block_size_;
  if (matched <= num_computed_tokens) return {};
  computed_[request.request_id] = num_computed_tokens;
  return {matched - num_computed_tokens, false};
}

Status HostOffloadScheduler::update_state_after_alloc(
    Request& request, const std::vector<std::vector<int64_t>>& block_ids,
    uint64_t num_external_tokens) {
  if (request.prompt_token_ids.empty() || block_ids.size() <= group_) return Status::ok();
  Tracked t;
  t.keys = block_keys(request.prompt_token_ids, block_size_);
  t.blocks = block_ids[group_];
  auto computed = computed_.find(request.request_id);
  const uint64_t first = computed == computed_.end() ? 0 : computed->second / block_size_;
  if (computed != computed_.end()) computed_.erase(computed);
  const uint64_t end = std::min<uint64_t>(first + num_external_tokens / block_size_, t.keys.size());
  for (uint64_t i = first; i < end && i < t.blocks.size(); ++i) {
    pending_.load.push_back({t.keys[i], t.blocks[i]});
  }
  t.saved_upto = end;  // the loaded blocks are in the store already
  requests_[request.request_id] = std::move(t);
  return Status::ok();
}

Expected<std::vector<std::byte>> HostOffloadScheduler::build_connector_meta(
    const std::vector<ScheduledRequest>& scheduled) {
  OffloadMetadata meta;
  std::swap(meta, pending_);
  for (const auto& step : scheduled) {
    auto it = requests_.find(step.request_id);
    if (it == requests_.end()) continue;
    Tracked& t = it->second;
    if (step.new_block_ids.size() > group_) {
      const auto& more = step.new_block_ids[group_];
      if (step.resumed) t.blocks.clear();
      t.blocks.insert(t.blocks.end(), more.begin(), more.end());
    }
    const size_t full = std::min<size_t>(step.num_computed_tokens / block_size_, t.keys.size());
    for (size_t i = t.saved_upto; i < full && i < t.blocks.size(); ++i) {
      meta.save.push_back({t.keys[i], t.blocks[i]});
    }
    t.saved_upto = std::max(t.saved_upto, full);
  }
  return encode(meta);
}

Expected<FinishedRequest> HostOffloadScheduler::request_finished(const Request& request) {
  requests_.erase(request.request_id);
  computed_.erase(request.request_id);
  return FinishedRequest{};
}

}  // namespace rd2h::connector
