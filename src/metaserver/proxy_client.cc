#include <sodium.h>

#include "metaserver/proxy_impl.h"

namespace rd2h::metaserver {

namespace {

// A random (version 4) UUID from the operating system's cryptographic source: request ids
// name transfers, so they must not be predictable.
std::string uuid4() {
  uint64_t a, b;
  randombytes_buf(&a, sizeof(a));
  randombytes_buf(&b, sizeof(b));
  char out[37];
  std::snprintf(out, sizeof(out), "%08x-%04x-4%03x-%04x-%012llx", static_cast<unsigned>(a >> 32),
                static_cast<unsigned>((a >> 16) & 0xffff), static_cast<unsigned>(a & 0xfff),
                static_cast<unsigned>(0x8000 | ((b >> 48) & 0x3fff)),
                static_cast<unsigned long long>(b & 0xffffffffffffULL));
  return out;
}

}  // namespace

void Proxy::Impl::start_decode_leg(const std::shared_ptr<Parent>& parent, DecodeLeg& leg,
                                   httplib::Headers headers, std::string payload) {
  const std::string origin = parent->decode_origin;
  auto upstream = std::make_shared<httplib::Client>(origin);
  set_timeouts(*upstream, config.upstream_timeout);
  {
    std::lock_guard lock(parent->mu);
    parent->upstream = upstream;  // from here on a failure closes the Decode request
  }
  const bool stream = parent->body.value("stream", ordered_json(false)).is_boolean() &&
                      parent->body.value("stream", false);
  leg.thread = std::thread([parent, &leg, upstream, stream, origin, headers = std::move(headers),
                            payload = std::move(payload)] {
    httplib::Request up;
    up.method = "POST";
    up.path = parent->path;
    up.headers = headers;
    up.body = payload;
    up.set_header("Content-Type", "application/json");
    up.response_handler = [&](const httplib::Response& r) {
      {
        std::lock_guard lock(leg.mu);
        leg.status = r.status;
        leg.content_type = r.get_header_value("Content-Type");
      }
      leg.cv.notify_all();
      return true;
    };
    up.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
      std::unique_lock lock(leg.mu);
      if (!stream && leg.held + n > kMaxHeldAnswerBytes) {
        leg.error = "Decode " + origin + " answered more than " +
                    std::to_string(kMaxHeldAnswerBytes) + " bytes";
        return false;
      }
      // A stream's backlog is bounded: Decode waits for a client that reads slowly.
      while (!leg.stop && leg.held + n > kMaxHeldAnswerBytes && leg.held > 0) {
        leg.cv.wait_for(lock, kLook);
      }
      if (leg.stop) return false;
      leg.chunks.emplace_back(data, n);
      leg.held += n;
      lock.unlock();
      leg.cv.notify_all();
      return true;
    };
    httplib::Result r{nullptr, httplib::Error::Canceled};
    if (parent->failed().second.empty()) r = upstream->send(up);
    {
      std::lock_guard lock(leg.mu);
      if (!r && leg.error.empty()) {
        leg.error = "Decode " + origin + " did not answer: " + httplib::to_string(r.error());
      }
      leg.done = true;
    }
    leg.cv.notify_all();
  });
}

std::variant<Round, std::pair<int, std::string>> Proxy::Impl::begin_round(
    const std::string& path, const ordered_json& client_body, size_t prompts,
    const std::string& client_id) {
  const bool chat = path == "/v1/chat/completions";
  auto parent = std::make_shared<Parent>();
  parent->id = uuid4();
  parent->client_id = client_id;
  parent->path = path;
  if (chat) {
    parent->children.push_back("chatcmpl-" + parent->id);
  } else {
    for (size_t i = 0; i < prompts; ++i) {
      parent->children.push_back("cmpl-" + parent->id + "-" + std::to_string(i));
    }
  }
  parent->body = client_body;
  {
    std::lock_guard lock(mu);
    if (stopping || draining) {
      return std::pair{503, http::api_error_json(503, "the proxy is shutting down")};
    }
    if (decodes.members().empty() || prefills.members().empty()) {
      return std::pair{503,
                       http::api_error_json(503, "the proxy has no Prefill or no Decode instance")};
    }
    const auto taken = decodes.take();
    if (!taken) return std::pair{503, http::api_error_json(503, "the proxy has no Decode instance")};
    parent->decode = *taken;
    parent->decode_origin = decodes.origins[*taken];
    upstream_in_flight.with({"decode", parent->decode_origin}).add(1);
    for (const auto& c : parent->children) by_child[c] = parent;
    parents.insert(parent);
  }
  ordered_json body = client_body;
  body["kv_transfer_params"] = {
      {"do_remote_decode", false}, {"do_remote_prefill", true}, {"metaserver", metaserver_url()}};
  auto leg = std::make_shared<DecodeLeg>();
  start_decode_leg(parent, *leg, engine_headers(*parent), body.dump());
  return Round{parent, leg};
}

bool Proxy::Impl::client_left(const std::shared_ptr<Parent>& of) {
  if (!http::client_gone()) return false;
  {
    std::lock_guard lock(mu);
    ++stats.client_cancelled;
  }
  cancelled.with().inc();
  of->fail(499, http::api_error_json(499, "the client went away"));
  return true;
}

bool Proxy::Impl::wait_on_leg(DecodeLeg& leg, const std::shared_ptr<Parent>& parent,
                              const std::function<bool()>& ready) {
  std::unique_lock lock(leg.mu);
  while (!leg.cv.wait_for(lock, kLook, ready)) {
    lock.unlock();
    const bool gone = client_left(parent);
    lock.lock();
    if (gone) return false;
  }
  return true;
}

void Proxy::Impl::answer_whole(httplib::Response& res, const std::shared_ptr<Round>& round,
                               Continuation* cont, const std::string& path, size_t prompts) {
  ordered_json merged;  // the answer so far, over rounds
  for (;;) {
    auto parent = round->parent;
    auto leg = round->leg;
    wait_on_leg(*leg, parent, [&] { return leg->done; });
    bool again = false;
    {
      std::lock_guard held(leg->mu);
      const bool done = leg->done;
      if (auto [status, failure] = parent->failed(); !failure.empty()) {
        res.status = status;
        res.set_content(failure, "application/json");
      } else if (!done || !leg->error.empty() || leg->status == 0) {
        http::set_api_error(res, 502, done ? leg->error : "the client went away");
      } else {
        std::string answer;
        answer.reserve(leg->held);
        for (auto& c : leg->chunks) answer += c;
        auto j = leg->status == 200 && cont != nullptr
                     ? ordered_json::parse(answer, nullptr, /*allow_exceptions=*/false)
                     : ordered_json();
        const bool whole = j.is_object() && !http::nests_deeper_than(j, http::kMaxBodyNesting);
        again = whole && continue_whole(*cont, j, merged);
        res.status = leg->status;
        if (!again) {
          res.set_content(cont != nullptr && cont->rounds > 0 && whole ? merged.dump() : answer,
                          leg->content_type.empty() ? "application/json" : leg->content_type);
        }
      }
    }
    round->leg.reset();
    leg.reset();  // joins the leg before the request is finished
    finish(parent);
    if (!again) return;
    {
      std::lock_guard stats_lock(mu);
      ++stats.reissued;
    }
    reissued.with().inc();
    log::info("proxy: request {}: Decode ended it recomputed after {} tokens; round {}", parent->id,
              cont->tokens, cont->rounds + 2);
    auto next = begin_round(path, next_round_body(*cont), prompts, parent->client_id);
    if (auto* refused = std::get_if<std::pair<int, std::string>>(&next)) {
      res.status = refused->first;
      return res.set_content(refused->second, "application/json");
    }
    *round = std::get<Round>(std::move(next));
    ++cont->rounds;
  }
}

// A stream relayed to its client, round after round: the response's content provider.
struct Proxy::Impl::StreamRelay {
  Impl* impl;
  std::shared_ptr<Round> round;
  std::shared_ptr<Continuation> cont;
  bool follow;  // event by event, for a stream that may go on in another round
  std::string path;
  size_t prompts;
  Clock::time_point started;
  std::shared_ptr<bool> first_event = std::make_shared<bool>(true);

  enum class Next { kDone, kAgain, kEnded };

  bool operator()(size_t, httplib::DataSink& sink) const {
    for (;;) {
      if (!relay_leg(sink)) return false;
      if (failed_leg(sink)) return true;
      const Next next = next_round(sink);
      if (next == Next::kEnded) return true;
      if (next == Next::kDone) break;
    }
    sink.done();
    return true;
  }

  bool write(httplib::DataSink& sink, const std::string& out) const {
    if (out.empty()) return true;
    if (std::exchange(*first_event, false)) {
      impl->ttft.with().observe(std::chrono::duration<double>(Clock::now() - started).count());
    }
    if (sink.write(out.data(), out.size())) return true;
    impl->client_left(round->parent);
    round->parent->fail(499, http::api_error_json(499, "the client went away"));
    return false;
  }

  // Raw, or event by event for a stream that may go on in another round.
  bool forward(httplib::DataSink& sink, std::string chunk) const {
    if (!follow) return write(sink, chunk);
    cont->pending += chunk;
    if (cont->pending.size() > kMaxHeldAnswerBytes) {
      return write(
          sink, "data: " +
                    http::api_error_json(502, "Decode sent an event of more than " +
                                                  std::to_string(kMaxHeldAnswerBytes) + " bytes") +
                    "\n\n");
    }
    size_t end;
    while ((end = cont->pending.find("\n\n")) != std::string::npos) {
      std::string event = cont->pending.substr(0, end);
      cont->pending.erase(0, end + 2);
      if (!write(sink, impl->continue_event(*cont, event))) return false;
    }
    return true;
  }

  // Forwards the current leg's chunks until it is done; false once the client is gone.
  bool relay_leg(httplib::DataSink& sink) const {
    auto& leg = round->leg;
    std::unique_lock lock(leg->mu);
    for (;;) {
      while (!leg->chunks.empty()) {
        std::string chunk = std::move(leg->chunks.front());
        leg->chunks.pop_front();
        leg->held -= chunk.size();
        lock.unlock();
        leg->cv.notify_all();
        if (!forward(sink, std::move(chunk))) return false;
        lock.lock();
      }
      if (leg->done) return true;
      if (!leg->cv.wait_for(lock, kLook, [&] { return leg->done || !leg->chunks.empty(); })) {
        lock.unlock();
        if (impl->client_left(round->parent)) return false;
        lock.lock();
      }
    }
  }

  // Whether the round that ended failed; if so the client got the failure and the stream
  // ended.
  bool failed_leg(httplib::DataSink& sink) const {
    std::string error;
    int status = 0;
    {
      std::lock_guard lock(round->leg->mu);
      error = round->leg->error;
      status = round->leg->status;
    }
    auto [failed_status, failure] = round->parent->failed();
    if (failure.empty() && error.empty() && status != 200) {
      // A later round's Decode refused: its answer (an error object, not events) is what
      // the client gets.
      const auto answer = ordered_json::parse(cont->pending, nullptr, false);
      failure = answer.is_object() && answer.contains("error")
                    ? cont->pending
                    : http::api_error_json(502, "Decode answered HTTP " + std::to_string(status));
    }
    if (failure.empty() && error.empty()) return false;
    const std::string event =
        "data: " + (failure.empty() ? http::api_error_json(502, error) : failure) + "\n\n" +
        (cont->rounds > 0 ? "data: [DONE]\n\n" : "");
    sink.write(event.data(), event.size());
    sink.done();
    return true;
  }

  // After a round that ended well: done, or (Decode lost the request's KV) the answer goes
  // on from a new Prefill and Decode.
  Next next_round(httplib::DataSink& sink) const {
    if (!cont->recomputed) return Next::kDone;
    {
      std::lock_guard stats_lock(impl->mu);
      ++impl->stats.reissued;
    }
    impl->reissued.with().inc();
    log::info("proxy: request {}: Decode ended it recomputed after {} tokens; round {}",
              round->parent->id, cont->tokens, cont->rounds + 2);
    auto next =
        impl->begin_round(path, impl->next_round_body(*cont), prompts, round->parent->client_id);
    round->leg.reset();  // joins the leg before its round is finished
    impl->finish(round->parent);
    if (auto* refused = std::get_if<std::pair<int, std::string>>(&next)) {
      const std::string event = "data: " + refused->second + "\n\ndata: [DONE]\n\n";
      sink.write(event.data(), event.size());
      sink.done();
      // The finish callback finishes the round the client saw last: already done.
      round->parent = std::make_shared<Parent>();
      return Next::kEnded;
    }
    *round = std::get<Round>(std::move(next));
    ++cont->rounds;
    cont->recomputed = false;
    cont->pending.clear();
    return Next::kAgain;
  }
};

void Proxy::Impl::handle_client(const httplib::Request& req, httplib::Response& res, bool chat) {
  const auto started = Clock::now();
  const std::string client_id = req.get_header_value("X-Request-Id");
  if (!client_id.empty() && !http::printable_id(client_id)) {
    return http::set_api_error(res, 400, "X-Request-Id must be 1 to 128 printable characters",
                               "X-Request-Id");
  }
  // Bounded before a document is built: a small hostile body cannot become a large one.
  auto parsed = http::parse_bounded<ordered_json>(req.body);
  if (!parsed) return http::set_api_error(res, 400, parsed.status().message());
  auto body = std::move(*parsed);
  if (!body.is_object()) {
    return http::set_api_error(res, 400, "the request body is not a JSON object");
  }
  http::BodyFault fault;
  const auto prompts = http::check_openai_body(
      body, chat, http::PromptLimits{config.max_prompts, config.max_prompt_tokens},
      http::BodyRules::kRoute, &fault);
  if (!prompts) {
    return http::set_api_error(res, 400, prompts.status().message(), fault.param, fault.code);
  }
  const auto stream_field = body.find("stream");
  const bool stream =
      stream_field != body.end() && stream_field->is_boolean() && stream_field->get<bool>();
  // A stream Decode may end "recomputed" is followed across rounds, event by event.
  auto cont = std::make_shared<Continuation>();
  const bool may_go_on = config.max_reissues > 0 && continuable(body, chat, *prompts);
  const bool follow = stream && may_go_on;
  if (may_go_on) *cont = Continuation::of(body, chat);
  const std::string path = chat ? "/v1/chat/completions" : "/v1/completions";
  auto begun = begin_round(path, body, *prompts, client_id);
  if (auto* refused = std::get_if<std::pair<int, std::string>>(&begun)) {
    if (!client_id.empty()) res.set_header("X-Request-Id", client_id);
    if (refused->first == 503) res.set_header("Connection", "close");
    res.status = refused->first;
    return res.set_content(refused->second, "application/json");
  }
  auto round = std::make_shared<Round>(std::get<Round>(std::move(begun)));
  {
    std::lock_guard lock(mu);
    ++stats.requests;
  }
  // Decode's status, or the end of its answer. A client that hangs up meanwhile gives its
  // request up: both legs are closed, so the engines free its blocks at once. A Decode that
  // fails before anything reached the client leaves the rotation, and the request starts
  // again on another (its Prefill dispatch, if any, is stopped).
  for (int attempt = 1;; ++attempt) {
    auto& leg = *round->leg;
    // A 5xx is read to its end (or its first 64 KiB), so that its reason is logged whole.
    wait_on_leg(leg, round->parent, [&] {
      return leg.done || (leg.status != 0 && (leg.status < 500 || leg.held >= (64u << 10)));
    });
    std::string why;
    {
      std::lock_guard lock(leg.mu);
      const std::string& origin = round->parent->decode_origin;
      if (leg.status >= 500) {
        std::string said;
        for (const auto& c : leg.chunks) said += c;
        why = "Decode " + origin + " answered HTTP " + std::to_string(leg.status) +
              (said.empty() ? std::string() : ": " + http::error_text(said));
      } else if (leg.status == 0 && leg.done) {
        why = leg.error.empty() ? "Decode " + origin + " did not answer" : leg.error;
      }
    }
    // A failure of the request's own (its Prefill dispatch, its client) is not Decode's.
    if (why.empty() || !round->parent->failed().second.empty()) break;
    bool retry = true;
    {
      std::lock_guard lock(mu);
      take_out(decodes, round->parent->decode, why);
      // Only another Decode is worth a try: the same one would fail the same way.
      retry = attempt < std::max(1, config.decode_attempts) && decodes.any_up();
      if (retry) {
        ++stats.decode_retries;
        decode_retry_count.with().inc();
      }
    }
    if (!retry) {
      // The client gets Decode's own answer; the KV Prefill would compute has no reader.
      log::warn("proxy: request {}: {}; its Prefill dispatch is stopped", round->parent->id, why);
      round->parent->abandon_prefill();
      break;
    }
    log::info("proxy: request {}: {}; attempt {} on another Decode", round->parent->id, why,
              attempt + 1);
    round->parent->fail(why);  // closes its Prefill dispatch, if one began
    round->leg.reset();        // joins the leg before its round is finished
    finish(round->parent);
    auto again = begin_round(path, body, *prompts, client_id);
    if (auto* refused = std::get_if<std::pair<int, std::string>>(&again)) {
      // No other Decode to try: the client learns both why.
      const auto e = ordered_json::parse(refused->second, nullptr, false);
      std::string then = "no other Decode";
      if (e.is_object() && e.contains("error") && e["error"].is_object() &&
          e["error"].contains("message") && e["error"]["message"].is_string()) {
        then = e["error"]["message"].get<std::string>();
      }
      if (!client_id.empty()) res.set_header("X-Request-Id", client_id);
      res.status = 502;
      return res.set_content(http::api_error_json(502, why + "; then " + then), "application/json");
    }
    *round = std::get<Round>(std::move(again));
  }
  // The client's id is echoed; the transfer is named by the proxy's own, which no client can
  // predict or reuse.
  res.set_header("X-Request-Id", client_id.empty() ? round->parent->id : client_id);
  auto& leg = *round->leg;
  bool streaming = false;
  {
    std::lock_guard lock(leg.mu);
    streaming = stream && leg.status == 200;
  }
  if (!streaming) {
    return answer_whole(res, round, !stream && may_go_on ? cont.get() : nullptr, path, *prompts);
  }
  res.set_chunked_content_provider("text/event-stream",
                                   StreamRelay{this, round, cont, follow, path, *prompts, started},
                                   [this, round](bool) {
                                     round->leg.reset();
                                     if (round->parent) finish(round->parent);
                                   });
}

void Proxy::Impl::finish(const std::shared_ptr<Parent>& parent) {
  {
    std::lock_guard lock(mu);
    for (const auto& c : parent->children) {
      auto it = by_child.find(c);
      if (it != by_child.end() && it->second == parent) by_child.erase(it);
    }
    if (parents.erase(parent) != 0) {
      --decodes.load[parent->decode];
      upstream_in_flight.with({"decode", parent->decode_origin}).add(-1);
    }
  }
  idle_cv.notify_all();
}

}  // namespace rd2h::metaserver
