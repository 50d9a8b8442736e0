#include "rd2h/connector/scheduler.h"

#include <algorithm>
#include <cctype>

#include "connector/module_configs.h"
#include "layout/cache.h"
#include "metaserver/client.h"
#include "topology/topology.h"
#include "util/token.h"

namespace rd2h::connector {

bool is_indexer_layer(std::string_view name) {
  constexpr std::string_view kWord = "indexer";
  auto lower = [](char a, char b) {
    return std::tolower(static_cast<unsigned char>(a)) == static_cast<unsigned char>(b);
  };
  return std::search(name.begin(), name.end(), kWord.begin(), kWord.end(), lower) != name.end();
}

Expected<GroupRoles> find_group_roles(const std::vector<KvCacheGroup>& groups) {
  if (groups.empty()) return invalid_argument("the engine has no KV-cache groups");
  std::optional<size_t> main, indexer;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].block_size == 0) {
      return invalid_argument("KV-cache group " + std::to_string(g) + " has block size 0");
    }
    for (const auto& name : groups[g].layer_names) {
      const bool indexer_layer = is_indexer_layer(name);
      if (indexer_layer && !indexer) indexer = g;
      if (!indexer_layer && !main) main = g;
    }
  }
  if (!main && indexer) {
    return invalid_argument("KV-cache group " + std::to_string(*indexer) +
                            " holds indexer layers, but no group holds a main attention layer");
  }
  if (!main) return invalid_argument("no KV-cache group holds a layer");
  return GroupRoles{*main, indexer.value_or(*main)};
}

Expected<std::unique_ptr<Scheduler>> Scheduler::create(ConnectorConfig config, Parallel parallel,
                                                       std::vector<KvCacheGroup> groups) {
  RD2H_TRY(roles, find_group_roles(groups));
  auto s = std::unique_ptr<Scheduler>(
      new Scheduler(std::move(config), parallel, std::move(groups), roles));
  if (s->config_.role == KvRole::kConsumer) {
    RD2H_TRY(base,
             topology::base_port(s->config_.kv_port, parallel.global_dp_rank, parallel.tp_size));
    s->base_port_ = base;
    auto token = http::load_token(s->config_.metaserver_token_file);
    if (!token) return token.status().with_context("metaserver_token_file");
    s->metaserver_ =
        std::make_unique<metaserver::Client>(metaserver_config(s->config_, std::move(*token)));
  }
  return s;
}

Scheduler::Scheduler(ConnectorConfig config, Parallel parallel, std::vector<KvCacheGroup> groups,
                     GroupRoles roles)
    : config_(std::move(config)), parallel_(parallel), groups_(std::move(groups)), roles_(roles) {}

Scheduler::~Scheduler() = default;

MatchedTokens Scheduler::get_num_new_matched_tokens(const Request& request,
                                                    uint64_t num_computed_tokens) {
  if (config_.role != KvRole::kConsumer || !request.params || !request.params->do_remote_prefill ||
      num_computed_tokens >= request.num_prompt_tokens) {
    return {};
  }
  computed_[request.request_id] = num_computed_tokens;
  return {request.num_prompt_tokens - num_computed_tokens, true};
}

Status Scheduler::update_state_after_alloc(Request& request,
                                           const std::vector<std::vector<int64_t>>& block_ids,
                                           uint64_t num_external_tokens) {
  if (block_ids.size() != groups_.size()) {
    return invalid_argument("request " + request.request_id + ": blocks of " +
                            std::to_string(block_ids.size()) + " KV-cache groups, the engine has " +
                            std::to_string(groups_.size()));
  }
  if (config_.role == KvRole::kConsumer) {
    if (!request.params || !request.params->do_remote_prefill) return Status::ok();
    if (num_external_tokens == 0) {  // everything is cached here: nothing to pull
      request.params->do_remote_prefill = false;
      computed_.erase(request.request_id);
      return Status::ok();
    }
    return update_decode(request, block_ids);
  }
  if (!request.params || !request.params->do_remote_decode) return Status::ok();
  return update_prefill(request, block_ids);
}

Status Scheduler::update_decode(Request& request,
                                const std::vector<std::vector<int64_t>>& block_ids) {
  RD2H_TRY(ext, config_.request_ids.to_external(request.request_id));
  // Without a metaserver, or for a virtual request, the rendezvous reaches Prefill some
  // other way (or never): nothing is posted, and Decode still expects the KV.
  const bool post = !request.params->metaserver.empty() && !request.params->is_virtual;
  KvTransferParams rendezvous;
  rendezvous.request_id = ext;
  rendezvous.remote_engine_id = config_.engine_id;
  rendezvous.remote_host = config_.advertise_host.empty() ? config_.host : config_.advertise_host;
  rendezvous.remote_port = base_port_;
  rendezvous.remote_tp_size = parallel_.tp_size;
  rendezvous.remote_pcp_size = parallel_.pcp_size;
  rendezvous.remote_dcp_size = parallel_.dcp_size;
  rendezvous.remote_public_key = config_.curve.public_key;
  auto computed = computed_.find(request.request_id);
  rendezvous.remote_cached_tokens = computed == computed_.end() ? 0 : computed->second;
  if (post) {
    RD2H_RETURN_IF_ERROR(
        metaserver_->post(ext, request.params->metaserver, rendezvous.rendezvous_json()));
  }
  if (computed != computed_.end()) computed_.erase(computed);
  pending_.load.push_back(
      {ext, request.request_id, block_ids[roles_.main], block_ids[roles_.indexer]});
  recv_[request.request_id] = ext;
  request.params->do_remote_prefill = false;
  return Status::ok();
}

Status Scheduler::update_prefill(Request& request,
                                 const std::vector<std::vector<int64_t>>& block_ids) {
  RD2H_TRY(ext, config_.request_ids.to_external(request.request_id));
  RD2H_TRY(decode, request.params->for_request(ext));
  // No Decode endpoint: nothing to send, so the request is not tracked (no readiness, no
  // gate closed for it).
  if (decode.remote_host.empty() || decode.remote_port <= 0) return Status::ok();
  Send s;
  s.ext_id = ext;
  s.decode = std::move(decode);
  s.decode.batch.clear();
  s.num_prompt_tokens = request.num_prompt_tokens;
  s.main_blocks = block_ids[roles_.main];
  s.indexer_blocks = block_ids[roles_.indexer];
  send_[request.request_id] = std::move(s);
  return Status::ok();
}

Status Scheduler::add_new_blocks(Send& s, const ScheduledRequest& step) {
  if (step.new_block_ids.empty()) return Status::ok();
  if (step.new_block_ids.size() != groups_.size()) {
    return invalid_argument("request " + s.ext_id + ": new blocks of " +
                            std::to_string(step.new_block_ids.size()) + " groups, expected " +
                            std::to_string(groups_.size()));
  }
  const auto& m = step.new_block_ids[roles_.main];
  if (step.resumed) s.main_blocks.clear();  // recomputed into new blocks
  s.main_blocks.insert(s.main_blocks.end(), m.begin(), m.end());
  if (roles_.indexer != roles_.main) {
    const auto& i = step.new_block_ids[roles_.indexer];
    if (step.resumed) s.indexer_blocks.clear();
    s.indexer_blocks.insert(s.indexer_blocks.end(), i.begin(), i.end());
  } else {
    s.indexer_blocks = s.main_blocks;
  }
  return Status::ok();
}

namespace {

std::vector<int64_t> ids_in(const std::vector<int64_t>& ids, layout::Range r) {
  return std::vector<int64_t>(ids.begin() + static_cast<long>(r.begin),
                              ids.begin() + static_cast<long>(r.end));
}

}  // namespace

Expected<std::optional<prefill::SendRequest>> Scheduler::next_chunk(Send& s,
                                                                    const ScheduledRequest& step) {
  const bool final_chunk = step.num_computed_tokens >= s.num_prompt_tokens;
  const layout::ChunkProgress progress{s.decode.remote_cached_tokens, s.transferred_tokens,
                                       step.num_computed_tokens, final_chunk};
  auto main = layout::chunk_slice(progress, groups_[roles_.main].block_size, s.main_blocks.size());
  if (!main) return main.status().with_context("request " + s.ext_id + ", main blocks");
  auto indexer =
      layout::chunk_slice(progress, groups_[roles_.indexer].block_size, s.indexer_blocks.size());
  if (!indexer) return indexer.status().with_context("request " + s.ext_id + ", indexer blocks");
  s.transferred_tokens = std::max(s.transferred_tokens, step.num_computed_tokens);
  if (main->size() == 0 && indexer->size() == 0 && !final_chunk) {
    return std::optional<prefill::SendRequest>();
  }
  prefill::SendRequest out;
  out.ext_id = s.ext_id;
  out.d_host = s.decode.remote_host;
  out.d_base_port = s.decode.remote_port;
  out.d_public_key = s.decode.remote_public_key;
  out.d_tp = s.decode.remote_tp_size;
  out.main_block_ids = ids_in(s.main_blocks, *main);
  out.indexer_block_ids = ids_in(s.indexer_blocks, *indexer);
  out.main_start = static_cast<int64_t>(main->begin);
  out.indexer_start = static_cast<int64_t>(indexer->begin);
  out.final_chunk = final_chunk;
  return std::optional<prefill::SendRequest>(std::move(out));
}

Expected<ConnectorMetadata> Scheduler::step_metadata(
    const std::vector<ScheduledRequest>& scheduled) {
  ConnectorMetadata meta;
  std::vector<std::string> last_out;  // internal ids whose last chunk this step publishes
  for (const auto& step : scheduled) {
    auto it = send_.find(step.request_id);
    if (it == send_.end()) continue;  // not a request this connector publishes
    RD2H_RETURN_IF_ERROR(add_new_blocks(it->second, step));
    RD2H_TRY(chunk, next_chunk(it->second, step));
    if (!chunk) continue;
    if (chunk->final_chunk) last_out.push_back(it->first);
    meta.save.push_back(std::move(*chunk));
  }
  // A request whose last chunk is out is done here: a later schedule of it (a decode
  // step, a recompute) never sends its last partial block again.
  for (const auto& id : last_out) send_.erase(id);
  // Decode's loads and aborts go out with a step that succeeded, not before: a step that
  // fails loses none of them.
  meta.load = std::exchange(pending_.load, {});
  meta.abort = std::exchange(pending_.abort, {});
  return meta;
}

Expected<std::vector<std::byte>> Scheduler::build_connector_meta(
    const std::vector<ScheduledRequest>& scheduled) {
  RD2H_TRY(meta, step_metadata(scheduled));
  return encode(meta);
}

MetaserverStats Scheduler::metaserver_stats() const {
  if (!metaserver_) return {};
  const auto s = metaserver_->stats();
  return {s.delivered, s.http_errors, s.transport_errors, s.cancelled};
}

Expected<FinishedRequest> Scheduler::request_finished(const Request& request) {
  if (config_.role == KvRole::kConsumer) {
    computed_.erase(request.request_id);
    auto it = recv_.find(request.request_id);
    if (it != recv_.end()) {
      metaserver_->cancel(it->second);
      // The worker drops whatever it still holds for it; a request already completed there
      // is already gone, and the abort is a no-op.
      pending_.abort.push_back(it->second);
      recv_.erase(it);
    }
  } else {
    send_.erase(request.request_id);
  }
  return FinishedRequest{};
}

}  // namespace rd2h::connector
