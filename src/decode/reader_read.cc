// The Decode reader's read path: a readiness read into Decode's blocks and answered.
#include <chrono>

#include "decode/layer_meta.h"
#include "decode/reader.h"
#include "layout/cache.h"
#include "rd2h/common/trace.h"
#include "util/log.h"

namespace rd2h::decode {

void Reader::handle_ready(const std::string& identity, const protocol::ReadReadyBatch& ready) {
  if (std::optional<Status> st = start_read(identity, ready)) answer_ready(identity, ready, *st);
}

void Reader::answer_ready(const std::string& identity, const protocol::ReadReadyBatch& ready,
                          const Status& st) {
  auto peer = peers_.find(identity);
  const bool commits = peer != peers_.end() && peer->second.commits;
  std::lock_guard lock(mu_);
  if (st.is_ok()) {
    const int member = static_cast<int>(ready.group_member_idx);
    const auto one_source = [&](const std::string& ext_id, bool owes) {
      if (tracker_.read_on(ext_id, identity, member, owes)) return;
      log::warn(
          "decode reader {}: request {} came from Prefill contributor {} on two "
          "connections (Prefill gave the first up); it fails",
          config_.d_rank, ext_id, member);
    };
    for (const auto& req : ready.read_reqs) one_source(req.ext_id, /*owes=*/true);
    // From a Prefill that commits, the final layers are owed until it commits them.
    for (const auto& ext_id : ready.done_ext_ids) one_source(ext_id, /*owes=*/commits);
    count(&Counters::layers_done);
    if (commits) {
      // Complete once Prefill commits them (handle_commit).
      for (const auto& ext_id : ready.done_ext_ids) {
        peer->second.uncommitted[ext_id] = {member, static_cast<int>(ready.tp_ratio)};
      }
      reply(identity, protocol::encode(protocol::ReadDone{ready.layer_idx}));
      trace::instant("answer out", "reader", ready.layer_idx);
      return;
    }
    for (const auto& ext_id : ready.done_ext_ids) {
      // Each readiness carries its Prefill's contributor count: one Decode serves Prefill
      // instances of different TP sizes.
      Status st =
          tracker_.on_final_layer(ext_id, member, static_cast<int>(ready.tp_ratio), identity);
      if (!st) log::warn("decode reader {}: {}", config_.d_rank, st.message());
      if (trace::enabled() && tracker_.complete(ext_id)) {
        trace::instant("kv complete", "reader", ready.layer_idx, ext_id);
      }
    }
    reply(identity, protocol::encode(protocol::ReadDone{ready.layer_idx}));
    trace::instant("answer out", "reader", ready.layer_idx);
    return;
  }
  count(&Counters::layers_failed);
  // Every request of a failed layer may hold partly written blocks: all of them fail.
  for (const auto& req : ready.read_reqs) tracker_.on_failed(req.ext_id);
  for (const auto& ext_id : ready.done_ext_ids) tracker_.on_failed(ext_id);
  reply(identity, protocol::encode(protocol::ReadFailed{ready.layer_idx, st.message()}));
}

void Reader::handle_commit(const std::string& identity, const protocol::KvCommit& commit) {
  auto peer = peers_.find(identity);
  if (peer == peers_.end() || !peer->second.commits) {
    count(&Counters::messages_rejected);
    return;
  }
  std::lock_guard lock(mu_);
  for (const auto& ext_id : commit.ext_ids) {
    auto signal = peer->second.uncommitted.find(ext_id);
    if (signal == peer->second.uncommitted.end()) continue;  // failed or given up meanwhile
    const auto [member, ratio] = signal->second;
    peer->second.uncommitted.erase(signal);
    Status st = tracker_.on_final_layer(ext_id, member, ratio, identity);
    if (!st) log::warn("decode reader {}: {}", config_.d_rank, st.message());
    if (trace::enabled() && tracker_.complete(ext_id)) {
      trace::instant("kv complete", "reader", commit.layer_idx, ext_id);
    }
  }
}

std::optional<Status> Reader::start_read(const std::string& identity,
                                         const protocol::ReadReadyBatch& ready) {
  // Named only when something fails: the hot path builds no strings.
  auto where = [&] {
    return "Decode rank " + std::to_string(config_.d_rank) + ", layer " +
           std::to_string(ready.layer_idx);
  };
  auto peer = peers_.find(identity);
  if (peer == peers_.end()) {
    return failed_precondition(where() + ": no MF_META on this connection");
  }
  auto p_layer = peer->second.layers.find(ready.layer_name);
  if (p_layer == peer->second.layers.end()) {
    // MF_META was checked to name Decode's layers: one it lacks is in neither.
    return not_found(where() + ": layer '" + ready.layer_name + "' is not in Prefill's MF_META");
  }
  const PeerLayer& layer = p_layer->second;
  if (!layer.layout) return layer.layout;
  if (Status st = plan_read(layer, ready); !st) return st.with_context(where());
  if (reads_.empty()) return Status::ok();  // nothing on this rank: still answered
  return post_planned(identity, peer->second.session, ready);
}

Status Reader::plan_read(const PeerLayer& layer, const protocol::ReadReadyBatch& ready) {
  // Kept from one readiness to the next (reader thread only): no allocation per block once
  // it has grown.
  reads_.clear();
  std::lock_guard lock(mu_);
  const layout::ReadRole role{config_.d_rank, config_.d_tp,
                              static_cast<int>(ready.group_member_idx),
                              static_cast<int>(ready.tp_ratio)};
  for (const auto& req : ready.read_reqs) {
    const Destinations* dest = tracker_.destinations(req.ext_id);
    if (dest == nullptr) {
      // Decode gave the request up: nothing to read for it, and no reason to fail Prefill.
      if (tracker_.aborted(req.ext_id)) continue;
      return not_found("request " + req.ext_id + " has no destination on Decode");
    }
    RD2H_RETURN_IF_ERROR(layout::append_request_reads(
        layer.tensors, *layer.decode, {source_blocks(req), dest->main, dest->indexer}, role,
        reads_));
  }
  // Begun under the same lock as its destinations were looked up: a request removed from
  // here on is reported only once this read ended.
  if (!reads_.empty()) {
    planned_read_ = tracker_.read_started();
    for (const auto& req : ready.read_reqs) tracker_.read_into(req.ext_id, planned_read_);
  }
  return Status::ok();
}

std::optional<Status> Reader::post_planned(const std::string& identity,
                                           const transfer::SessionHandle& session,
                                           const protocol::ReadReadyBatch& ready) {
  InFlight f;
  for (const auto& op : reads_) f.bytes += op.length;
  f.read = planned_read_;
  f.start = std::chrono::steady_clock::now();
  f.start_us = trace::now_us();
  f.ready = ready;
  f.on_link = came_on_link(identity);
  auto request = engine_->post_reads(session, reads_);
  std::optional<Status> done;
  if (!request) {
    done = request.status();
  } else if (!(done = (*request)->test())) {
    // In flight: answered by progress_reads() once done.
    f.request = std::move(*request);
    in_flight_.emplace(identity, std::move(f));
    return std::nullopt;
  }
  return end_read(f, std::move(*done));
}

Status Reader::end_read(const InFlight& f, Status st) {
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now() - f.start)
                      .count();
  if (trace::enabled()) {
    std::string ids;
    for (const auto& req : f.ready.read_reqs) ids += (ids.empty() ? "" : ",") + req.ext_id;
    trace::span(st.is_ok() ? "read" : "read failed", "reader", f.start_us, trace::now_us(),
                f.ready.layer_idx, f.bytes, std::move(ids));
  }
  {
    std::lock_guard lock(mu_);
    tracker_.read_ended(f.read);
  }
  count(&Counters::reads);
  count(&Counters::read_ns, static_cast<uint64_t>(ns));
  read_seconds_.observe(static_cast<double>(ns) / 1e9);
  if (st.is_ok()) {
    count(&Counters::bytes_read, f.bytes);
    return st;
  }
  return st.with_context("Decode rank " + std::to_string(config_.d_rank) + ", layer " +
                         std::to_string(f.ready.layer_idx));
}

void Reader::progress_reads() {
  std::vector<std::string> done;
  for (auto& [identity, f] : in_flight_) {
    if ((f.outcome = f.request->test())) done.push_back(identity);
  }
  for (const auto& identity : done) complete_read(identity, /*replay=*/true);
}

void Reader::complete_read(const std::string& identity, bool replay) {
  auto node = in_flight_.extract(identity);
  if (node.empty()) return;
  InFlight& f = node.mapped();
  Status st = f.outcome ? *f.outcome : f.request->wait();
  f.request.reset();
  answer_on(identity, f.on_link);
  answer_ready(identity, f.ready, end_read(f, std::move(st)));
  if (!replay) {
    // The connection goes: the requests of the readiness that waited fail with it.
    std::lock_guard lock(mu_);
    for (const auto& [in, on_link] : f.behind) {
      auto m = protocol::decode_message(in.payload);
      const auto* r = m ? std::get_if<protocol::ReadReadyBatch>(&*m) : nullptr;
      if (r == nullptr) continue;
      for (const auto& req : r->read_reqs) tracker_.on_failed(req.ext_id);
      for (const auto& ext_id : r->done_ext_ids) tracker_.on_failed(ext_id);
    }
    return;
  }
  // In order, each answered on the path it came on; a readiness among them that starts
  // another read puts the rest behind it.
  for (auto& [in, on_link] : f.behind) {
    answer_on(identity, on_link);
    handle(in);
  }
}

}  // namespace rd2h::decode
