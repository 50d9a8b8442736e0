#include "sim/engine_impl.h"
#include "util/log.h"

namespace rd2h::sim {

void EngineRequest::produced_token() {
  {
    std::lock_guard lock(progress->mu);
    ++progress->tokens[index];
  }
  progress->cv.notify_all();
}
void EngineRequest::ended() {
  {
    std::lock_guard lock(progress->mu);
    progress->ended[index] = true;
  }
  progress->cv.notify_all();
}

std::optional<std::string> Engine::Impl::never_fits(
    const std::vector<std::pair<std::string, std::vector<int64_t>>>& prompts,
    uint64_t max_tokens) const {
  const uint64_t bs = config.model.block_size;
  const std::string capacity =
      "; the engine holds " + std::to_string(config.model.num_blocks * bs) + " tokens (" +
      std::to_string(config.model.num_blocks) + " blocks of " + std::to_string(bs) + ")";
  const std::string generated =
      prefill ? std::string() : " and up to " + std::to_string(max_tokens) + " generated";
  // Prefill computes the prompts of a list one after another; Decode holds them all at once.
  if (prefill || prompts.size() == 1) {
    for (const auto& [id, tokens] : prompts) {
      const size_t need = blocks_needed(tokens.size(), max_tokens);
      if (need > config.model.num_blocks) {
        return "request " + id + " of " + std::to_string(tokens.size()) + " prompt tokens" +
               generated + " needs " + std::to_string(need) + " blocks of KV cache" + capacity;
      }
    }
    return std::nullopt;
  }
  size_t need = 0;
  for (const auto& [id, tokens] : prompts) need += blocks_needed(tokens.size(), max_tokens);
  if (need <= config.model.num_blocks) return std::nullopt;
  return "the list of " + std::to_string(prompts.size()) + " prompts" + generated + " each needs " +
         std::to_string(need) + " blocks of KV cache at once" + capacity;
}

json Engine::Impl::blocks_json(const EngineRequest& r, size_t first, size_t last) const {
  const uint64_t bs = config.model.block_size;
  const auto& tokens = r.request.prompt_token_ids;
  last = std::min(last, r.blocks.size());
  const size_t begin = std::min(tokens.size(), first * bs);
  const size_t end = std::min(tokens.size(), last * bs);
  return {{"req", r.ext_id},
          {"first", first},
          {"blocks", std::vector<int64_t>(r.blocks.begin() + static_cast<long>(first),
                                          r.blocks.begin() + static_cast<long>(last))},
          {"tokens", std::vector<int64_t>(tokens.begin() + static_cast<long>(begin),
                                          tokens.begin() + static_cast<long>(end))}};
}

void Engine::Impl::complete(const std::shared_ptr<EngineRequest>& r, Result result) {
  // An abandoned request was finished with the connector when it was given up.
  if (r->state != EngineRequest::State::kAbandoned) (void)scheduler->request_finished(r->request);
  free_blocks.insert(free_blocks.end(), r->blocks.begin(), r->blocks.end());
  r->blocks.clear();
  {
    std::lock_guard lock(mu);
    if (!result.ok) ++stats.failed_requests;
    stats.verified_blocks += result.verified_blocks;
    in_flight.erase(r->ext_id);
  }
  idle_cv.notify_all();
  if (auto it = verifying.find(r->ext_id); it != verifying.end() && it->second == r) {
    verifying.erase(it);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - r->arrived).count();
  if (prefill && result.ok) ttft.with().observe(seconds);
  // A client that went away is no failure of the engine's.
  const char* outcome = result.ok ? "ok" : r->cancelled.load() ? "cancelled" : "failed";
  e2e.with({outcome}).observe(seconds);
  prompts_done.with({outcome}).inc();
  if (result.ok) {
    prompt_tokens.with().inc(r->request.num_prompt_tokens);
    if (!prefill) generation_tokens.with().inc(r->generated);
  }
  r->done.set_value(std::move(result));
  r->ended();
  active.erase(std::remove(active.begin(), active.end(), r), active.end());
}

void Engine::Impl::give_up_cancelled() {
  // Still queued for blocks: they end here (a list's prompts share one client).
  for (auto group = waiting_blocks.begin(); group != waiting_blocks.end();) {
    const bool cancelled = std::any_of(group->begin(), group->end(),
                                       [](const auto& r) { return r->cancelled.load(); });
    if (!cancelled) {
      ++group;
      continue;
    }
    for (auto& r : *group) complete(r, {false, "", "the client went away"});
    group = waiting_blocks.erase(group);
  }
  // Between steps nothing of a request is in flight but Decode's reads: a request Prefill
  // is computing, or one Decode is generating for, ends now and frees its blocks.
  for (auto r : std::vector<std::shared_ptr<EngineRequest>>(active)) {
    if (!r->cancelled.load()) continue;
    if (prefill || r->state == EngineRequest::State::kRunning) {
      complete(r, {false, "", "the client went away"});
    } else if (r->state == EngineRequest::State::kWaitingRemote) {
      // Decode, KV still coming: the connector stops expecting it now. Its blocks stay until
      // the connector reports no read into them is in flight (the next steps). A request
      // being verified finishes on its own shortly.
      (void)scheduler->request_finished(r->request);
      r->state = EngineRequest::State::kAbandoned;
    }
  }
}

void Engine::Impl::admit(const std::shared_ptr<EngineRequest>& r) {
  const uint64_t bs = config.model.block_size;
  const uint64_t prompt = r->request.num_prompt_tokens;
  const size_t need = blocks_needed(*r);
  r->blocks.assign(free_blocks.end() - static_cast<long>(need), free_blocks.end());
  free_blocks.resize(free_blocks.size() - need);
  active.push_back(r);
  const bool remote = r->request.params && (prefill ? r->request.params->do_remote_decode
                                                    : r->request.params->do_remote_prefill);
  if (prefill || !remote) {
    if (Status st = scheduler->update_state_after_alloc(r->request, {r->blocks}, 0); !st) {
      return complete(r, {false, "", st.message()});
    }
    if (!prefill) r->computed = prompt;  // a plain request on Decode: nothing to pull
    return;
  }
  // Decode: a local prefix cache holds the first whole blocks; the rest comes from Prefill.
  uint64_t cached = std::min(config.decode_cached_tokens, prompt > 0 ? prompt - 1 : 0) / bs * bs;
  if (cached > 0) {
    auto written = call_ranks({{"op", "write"}, {"writes", {blocks_json(*r, 0, cached / bs)}}});
    if (!written) return complete(r, {false, "", written.status().message()});
  }
  const auto matched = scheduler->get_num_new_matched_tokens(r->request, cached);
  if (Status st = scheduler->update_state_after_alloc(r->request, {r->blocks}, matched.tokens);
      !st) {
    return complete(r, {false, "", st.message()});
  }
  r->computed = cached;
  r->state =
      matched.load_async ? EngineRequest::State::kWaitingRemote : EngineRequest::State::kRunning;
}

Status Engine::Impl::verify(const std::shared_ptr<EngineRequest>& r) {
  const size_t blocks = prompt_blocks(*r);
  r->state = EngineRequest::State::kVerifying;
  r->verify_pending = static_cast<int>(ranks->size());
  verifying[r->ext_id] = r;
  RD2H_TRY(replies, call_ranks({{"op", "verify"}, {"writes", {blocks_json(*r, 0, blocks)}}}));
  return Status::ok();
}

void Engine::Impl::take_verified(const std::vector<json>& replies) {
  for (const auto& reply : replies) {
    for (const auto& v : reply.value("verified", json::array())) {
      auto it = verifying.find(v.value("req", std::string()));
      if (it == verifying.end()) continue;  // already failed by another rank's check
      auto r = it->second;
      if (!v.value("ok", false)) {
        complete(r, {false, "", "KV check failed: " + v.value("error", std::string())});
        continue;
      }
      if (--r->verify_pending > 0) continue;
      verifying.erase(it);
      r->verified_blocks = prompt_blocks(*r) * static_cast<uint64_t>(config.model.layers);
      r->computed = r->request.num_prompt_tokens;
      r->state = EngineRequest::State::kRunning;
    }
  }
}

void Engine::Impl::decode_token(EngineRequest& r) {
  // "Attention" over the request's KV: one block of one layer per token, K and V, read
  // from the pool the ranks share.
  const size_t blocks = prompt_blocks(r);
  const int layer = static_cast<int>(r.generated % static_cast<uint64_t>(config.model.layers));
  const int64_t block = r.blocks[r.generated % blocks];
  for (size_t t = 0; t < 2; ++t) {
    const auto* p =
        reinterpret_cast<const uint64_t*>(pool->data() + model->decode_offset(layer, t, block));
    for (size_t i = 0; i < model->block_bytes()[t] / 8; ++i) checksum += p[i];
  }
  if (++r.generated == 1) {
    trace::instant("first token", "core", -1, r.ext_id);
    ttft.with().observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - r.arrived).count());
  }
  r.produced_token();
}

// Prefill: the next chunk of each active request within the step's token budget.
void Engine::Impl::schedule_chunks(std::vector<connector::ScheduledRequest>& scheduled,
                                   std::vector<Write>& writes, uint64_t& step_tokens) {
  const uint64_t bs = config.model.block_size;
  uint64_t budget = config.token_budget;
  for (auto& r : active) {
    const uint64_t prompt = r->request.num_prompt_tokens;
    const uint64_t chunk = std::min(budget, prompt - r->computed);
    if (chunk == 0) continue;
    const uint64_t before = r->computed;
    r->computed += chunk;
    budget -= chunk;
    step_tokens += chunk;
    scheduled.push_back({r->request.request_id, {}, r->computed});
    writes.push_back({r, before / bs, (r->computed + bs - 1) / bs});
    if (budget == 0) break;
  }
}

// Decode: the next token of a running request; at its budget it ends.
void Engine::Impl::generate_token(const std::shared_ptr<EngineRequest>& r) {
  if (r->state != EngineRequest::State::kRunning || r->blocks.empty()) return;
  decode_token(*r);
  if (r->generated >= r->max_tokens) {
    complete(r, {true, std::string(r->max_tokens, 'y'), "", r->verified_blocks});
  }
}

// Prefill: each request whose last chunk was written ends with its one token.
void Engine::Impl::end_prefill_step(const std::vector<Write>& writes, const Status& failure,
                                    int64_t compute_end_us) {
  for (const auto& wr : writes) {
    if (!failure.is_ok()) {
      complete(wr.r, {false, "", failure.message()});
    } else if (wr.r->computed == wr.r->request.num_prompt_tokens) {
      if (trace::enabled()) {
        trace::record({"prefill done", "core", compute_end_us, -1, -1, -1, 0, wr.r->ext_id});
      }
      complete(wr.r, {true, "x", "", 0});  // the one token Prefill is asked for
    }
  }
}

// Decode: requests whose KV arrived are checked (or fail where it did not load), and
// running ones get their next token.
void Engine::Impl::end_decode_step(const std::vector<json>& replies) {
  std::set<int64_t> bad;
  for (const auto& reply : replies) {
    for (int64_t b : reply.value("load_errors", std::vector<int64_t>{})) bad.insert(b);
  }
  const auto recving = replies[0].value("recving", std::vector<std::string>{});
  const std::set<std::string> ready(recving.begin(), recving.end());
  for (auto r : std::vector<std::shared_ptr<EngineRequest>>(active)) {
    const bool arrived = ready.count(r->request.request_id) != 0;
    if (r->state == EngineRequest::State::kAbandoned) {
      if (arrived) complete(r, {false, "", "the client went away while its KV loaded"});
    } else if (r->state == EngineRequest::State::kWaitingRemote) {
      if (arrived) arrive(r, bad);
    } else {
      generate_token(r);
    }
  }
}

// Decode: a request whose KV arrived is checked, or fails where it did not load.
void Engine::Impl::arrive(const std::shared_ptr<EngineRequest>& r, const std::set<int64_t>& bad) {
  trace::instant("kv ready", "core", -1, r->ext_id);
  const size_t blocks = prompt_blocks(*r);
  bool failed_load = false;
  for (size_t i = 0; i < blocks; ++i) failed_load = failed_load || bad.count(r->blocks[i]);
  if (failed_load) {
    complete(r, {false, "", "the KV of the request failed to load"});
  } else if (Status st = verify(r); !st) {
    complete(r, {false, "", st.message()});
  }
}

Status Engine::Impl::step() {
  std::vector<connector::ScheduledRequest> scheduled;
  std::vector<Write> writes;
  uint64_t step_tokens = 0;
  if (prefill) schedule_chunks(scheduled, writes, step_tokens);
  RD2H_TRY(meta, scheduler->build_connector_meta(scheduled));  // as a host ships it
  RD2H_TRY(handed, connector::decode_metadata(meta));
  bool waiting = false;
  for (auto& r : active) waiting = waiting || r->state != EngineRequest::State::kRunning;
  if (scheduled.empty() && !waiting && handed.empty()) {
    if (!prefill) {  // every active request runs: none waits for KV
      for (auto r : std::vector<std::shared_ptr<EngineRequest>>(active)) {
        decode_token(*r);
        if (r->generated >= r->max_tokens) {
          complete(r, {true, std::string(r->max_tokens, 'y'), "", r->verified_blocks});
        }
      }
    }
    return Status::ok();
  }
  {
    std::lock_guard lock(mu);
    ++stats.steps;
    stats.prefill_chunks += scheduled.size();
  }
  json job = {{"op", "step"},
              {"meta", json::binary(std::vector<uint8_t>(
                           reinterpret_cast<const uint8_t*>(meta.data()),
                           reinterpret_cast<const uint8_t*>(meta.data()) + meta.size()))},
              {"tokens", step_tokens},
              {"writes", json::array()}};
  for (const auto& w : writes) job["writes"].push_back(blocks_json(*w.r, w.first, w.last));
  if (corrupt_pending && !writes.empty() &&
      writes.front().r->computed == writes.front().r->request.num_prompt_tokens) {
    job["corrupt"] = true;
    corrupt_pending = false;
  }
  RD2H_TRY(replies, call_ranks(job));
  Status failure;
  int64_t compute_end_us = 0;
  for (size_t k = 0; k < replies.size(); ++k) {
    const json& reply = replies[k];
    if (!reply.value("ok", false) && failure.is_ok()) {
      failure = internal_error("TP rank " + std::to_string(k) + ": " +
                               reply.value("error", std::string()));
    }
    compute_end_us = std::max(compute_end_us, reply.value("compute_end_us", int64_t{0}));
  }
  if (prefill) {
    end_prefill_step(writes, failure, compute_end_us);
    return Status::ok();
  }
  for (const auto& reply : replies) {
    if (auto t = reply.find("transfer"); t != reply.end() && t->is_object()) take_transfer(*t);
  }
  if (!failure.is_ok()) return failure;
  end_decode_step(replies);
  return Status::ok();
}

void Engine::Impl::run_core() {
  while (true) {
    std::deque<std::shared_ptr<EngineRequest>> fresh;
    std::vector<std::promise<void>> drains;
    bool cancels = false;  // a client went away since the last look
    {
      std::unique_lock lock(mu);
      const bool busy = !active.empty();
      cv.wait_for(lock, busy ? std::chrono::milliseconds(1) : std::chrono::milliseconds(50), [&] {
        return stopping || !incoming.empty() || !event_drains.empty() || cancels_pending;
      });
      cancels = std::exchange(cancels_pending, false);
      if (stopping) break;
      fresh.swap(incoming);
      drains.swap(event_drains);
    }
    if (!drains.empty()) {
      (void)call_ranks({{"op", "events"}});  // their events go to this process's recorder
      for (auto& d : drains) d.set_value();
      drains.clear();
    }
    // A list's prompts were queued together, so they are together in `fresh`.
    for (auto& r : fresh) {
      if (!r->admit_with_previous || waiting_blocks.empty()) waiting_blocks.emplace_back();
      waiting_blocks.back().push_back(r);
    }
    if (cancels) give_up_cancelled();
    // A rank that died while the engine was idle is noticed within a look, not at the next
    // request.
    if (const auto now = std::chrono::steady_clock::now(); now - last_rank_look >= kLook) {
      last_rank_look = now;
      (void)rank_died();
    }
    admit_waiting();
    if (Status st = step(); !st) {
      (void)rank_died();  // the engine is broken before the requests fail
      for (auto r : std::vector<std::shared_ptr<EngineRequest>>(active)) {
        complete(r, {false, "", st.message()});
      }
    }
    size_t waiting = 0;
    for (const auto& group : waiting_blocks) waiting += group.size();
    std::lock_guard lock(mu);
    stats.free_blocks = free_blocks.size();
    stats.waiting_for_blocks = waiting;
  }
  end_everything();
}

bool Engine::Impl::rank_died() {
  auto why = ranks->any_exited();
  if (!why) return false;
  const std::string message = *why + ": the engine cannot serve";
  {
    std::lock_guard lock(mu);
    if (!broken.empty()) return true;
    broken = message;
  }
  log::error("engine: {}", message);
  for (auto r : std::vector<std::shared_ptr<EngineRequest>>(active)) {
    complete(r, {false, "", message});
  }
  for (auto& group : waiting_blocks) {
    for (auto& r : group) complete(r, {false, "", message});
  }
  waiting_blocks.clear();
  return true;
}

void Engine::Impl::admit_waiting() {
  // First come, first served: a large request is not starved by smaller ones behind it.
  while (!waiting_blocks.empty()) {
    size_t need = 0;
    for (const auto& r : waiting_blocks.front()) need += blocks_needed(*r);
    if (need > free_blocks.size() && need <= config.model.num_blocks) break;
    auto next = std::move(waiting_blocks.front());
    waiting_blocks.pop_front();
    for (auto& r : next) {
      if (need > config.model.num_blocks) {  // serve() refuses these; nothing may wait on them
        complete(r, {false, "",
                     "needs " + std::to_string(need) + " blocks, the engine has " +
                         std::to_string(config.model.num_blocks)});
      } else {
        admit(r);
      }
    }
  }
}

void Engine::Impl::end_everything() {
  for (auto r : std::vector<std::shared_ptr<EngineRequest>>(active)) {
    complete(r, {false, "", "the engine is stopping"});
  }
  for (auto& group : waiting_blocks) {
    for (auto& r : group) complete(r, {false, "", "the engine is stopping"});
  }
  waiting_blocks.clear();
  std::lock_guard lock(mu);
  for (auto& d : event_drains) d.set_value();
  event_drains.clear();
  for (auto& r : incoming) {
    in_flight.erase(r->ext_id);
    r->done.set_value({false, "", "the engine is stopping"});
    r->ended();
  }
  incoming.clear();
  idle_cv.notify_all();
}

}  // namespace rd2h::sim
