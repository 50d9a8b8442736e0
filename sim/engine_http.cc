#include "sim/engine_impl.h"
#include "util/json_bounds.h"
#include "util/log.h"

namespace rd2h::sim {

namespace {

std::string random_hex(size_t n) {
  thread_local std::mt19937_64 rng(std::random_device{}());
  static const char* digits = "0123456789abcdef";
  std::string s(n, '0');
  for (auto& c : s) c = digits[rng() & 15];
  return s;
}

}  // namespace

// One client request as its handler and its stream see it.
struct Engine::Impl::Call {
  std::string id, object, model;
  bool chat = false;
  int64_t created = 0;
  std::vector<std::string> children;    // ext ids, one per prompt
  std::vector<uint64_t> prompt_tokens;  // per prompt
  std::vector<std::shared_future<Result>> results;
  std::shared_ptr<Progress> progress;
  std::chrono::steady_clock::time_point deadline;
  std::function<bool()> client_went_away;  // true (and the request given up) if it did
  char token_text = 'y';                   // what one generated token reads as
  uint64_t recompute_after = 0;            // end the stream "recomputed" after this many
  uint64_t max_tokens = 0;                 // the request's budget (never cut at its end)
  std::function<void()> give_up;           // cancels the request in the engine core

  json chunk(json choices) const {
    return {{"id", id},
            // A chat stream's chunks are "chat.completion.chunk"; a completion's are named
            // as the completion ("text_completion"), as OpenAI and vLLM name them.
            {"object", object == "chat.completion" ? object + ".chunk" : object},
            {"created", created},
            {"model", model},
            {"choices", std::move(choices)}};
  }
  json token_choice(size_t i, const std::string& text, json finish = nullptr) const {
    json c = {{"index", i}};
    if (chat) {
      c["delta"] = text.empty() ? json::object() : json{{"content", text}};
    } else {
      c["text"] = text;
    }
    c["logprobs"] = nullptr;
    c["finish_reason"] = std::move(finish);
    return c;
  }
  json usage(const std::vector<Result>& done) const {
    uint64_t prompt = 0, completion = 0;
    for (uint64_t t : prompt_tokens) prompt += t;
    for (const auto& r : done) completion += r.text.size();
    return {{"prompt_tokens", prompt},
            {"completion_tokens", completion},
            {"total_tokens", prompt + completion}};
  }
  // Every prompt's result, or an HTTP status and why not.
  std::variant<std::vector<Result>, std::pair<int, std::string>> wait() const {
    std::vector<Result> done;
    for (size_t i = 0; i < results.size(); ++i) {
      while (results[i].wait_for(kLook) != std::future_status::ready) {
        if (std::chrono::steady_clock::now() >= deadline) {
          return std::pair{504, "request " + children[i] + " did not finish in time"};
        }
        if (client_went_away()) return std::pair{499, std::string("the client went away")};
      }
      const Result& r = results[i].get();
      if (!r.ok) return std::pair{500, "request " + children[i] + ": " + r.error};
      done.push_back(r);
    }
    return done;
  }
  json whole(std::vector<Result> done) const {
    // As a Decode that lost the request's KV after recompute_after tokens: what it had,
    // with stop reason "recomputed".
    const bool cut = recompute_after > 0 && done.size() == 1 && max_tokens > recompute_after;
    if (cut) done[0].text.resize(std::min<size_t>(done[0].text.size(), recompute_after));
    json choices = json::array();
    uint64_t verified = 0;
    for (size_t i = 0; i < done.size(); ++i) {
      json c = {{"index", i}};
      if (chat) {
        c["message"] = {{"role", "assistant"}, {"content", done[i].text}};
      } else {
        c["text"] = done[i].text;
      }
      c["logprobs"] = nullptr;
      c["finish_reason"] = cut ? "stop" : "length";
      if (cut) c["stop_reason"] = "recomputed";
      choices.push_back(std::move(c));
      verified += done[i].verified_blocks;
    }
    return {{"id", id},
            {"object", object},
            {"created", created},
            {"model", model},
            {"choices", choices},
            {"usage", usage(done)},
            {"rd2h", {{"verified_blocks", verified}}}};
  }
  // Ends the stream as a Decode that lost the request's KV: the request is given up, its
  // last event has stop reason "recomputed".
  bool recomputed(httplib::DataSink& sink, uint64_t tokens, bool include_usage) const {
    give_up();
    json c = token_choice(0, "", "stop");
    c["stop_reason"] = "recomputed";
    std::string out = "data: " + chunk({c}).dump() + "\n\n";
    if (include_usage) {
      json u = chunk(json::array());
      u["usage"] = {{"prompt_tokens", prompt_tokens[0]},
                    {"completion_tokens", tokens},
                    {"total_tokens", prompt_tokens[0] + tokens}};
      out += "data: " + u.dump() + "\n\n";
    }
    out += "data: [DONE]\n\n";
    sink.write(out.data(), out.size());
    sink.done();
    return true;
  }
  // How a stream writes: its events, and the last bytes before it ends.
  struct Events {
    httplib::DataSink& sink;
    bool include_usage;
    bool send(const json& event) const {
      const std::string data = "data: " + event.dump() + "\n\n";
      return sink.write(data.data(), data.size());
    }
    bool finish(const std::string& data) const {
      sink.write(data.data(), data.size());
      sink.done();
      return true;
    }
    json with_usage(json event) const {
      if (include_usage) event["usage"] = nullptr;
      return event;
    }
  };
  // Waits (a look at most) for tokens beyond `sent` or the end of every prompt: the tokens
  // made so far, and whether every prompt ended.
  std::pair<std::vector<uint64_t>, bool> progress_since(const std::vector<uint64_t>& sent) const {
    auto all_ended = [&] {
      return std::all_of(progress->ended.begin(), progress->ended.end(), [](bool e) { return e; });
    };
    std::unique_lock lock(progress->mu);
    progress->cv.wait_for(lock, kLook, [&] {
      for (size_t i = 0; i < sent.size(); ++i) {
        if (progress->tokens[i] > sent[i]) return true;
      }
      return all_ended();
    });
    return {progress->tokens, all_ended()};
  }
  // Streams the tokens as the engine makes them until every prompt ended (nullopt), or
  // ends the stream here (its outcome: false if the client went away).
  std::optional<bool> stream_tokens(const Events& ev, std::vector<uint64_t>& sent) const {
    const size_t n = sent.size();
    // A stream that ends "recomputed" carries exactly recompute_after tokens.
    const uint64_t cut = recompute_after > 0 && n == 1 ? recompute_after : UINT64_MAX;
    for (;;) {
      const auto [made, all_ended] = progress_since(sent);
      for (size_t i = 0; i < n; ++i) {
        for (; sent[i] < std::min(made[i], cut); ++sent[i]) {
          if (!ev.send(ev.with_usage(chunk({token_choice(i, std::string(1, token_text))})))) {
            client_went_away();
            return false;
          }
        }
      }
      // Cut whether or not the engine made the rest already (it may be that fast): the
      // stream ends at exactly recompute_after tokens, every time.
      if (recompute_after > 0 && n == 1 && sent[0] >= recompute_after && sent[0] < max_tokens) {
        return recomputed(ev.sink, sent[0], ev.include_usage);
      }
      if (all_ended) return std::nullopt;
      if (std::chrono::steady_clock::now() >= deadline) {
        return ev.finish(
            "data: " + http::api_error_json(504, "the request did not finish in time") +
            "\n\ndata: [DONE]\n\n");
      }
      if (client_went_away()) return false;
    }
  }
  // The end of a stream whose prompts all ended: what it has not carried yet, each prompt's
  // last event with its finish reason, the usage if asked for, then [DONE].
  bool stream_end(const Events& ev, const std::vector<uint64_t>& sent) const {
    auto outcome = wait();
    if (auto* failed = std::get_if<std::pair<int, std::string>>(&outcome)) {
      if (failed->first == 499) return false;
      return ev.finish("data: " + http::api_error_json(failed->first, failed->second) +
                       "\n\ndata: [DONE]\n\n");
    }
    const auto& done = std::get<std::vector<Result>>(outcome);
    uint64_t verified = 0;
    for (size_t i = 0; i < sent.size(); ++i) {
      // What the stream has not carried yet (Prefill's one token is not generated in steps).
      if (done[i].text.size() > sent[i] &&
          !ev.send(ev.with_usage(chunk({token_choice(i, done[i].text.substr(sent[i]))})))) {
        return false;
      }
      verified += done[i].verified_blocks;
      json last = ev.with_usage(chunk({token_choice(i, "", "length")}));
      if (i + 1 == sent.size()) last["rd2h"] = {{"verified_blocks", verified}};
      if (!ev.send(last)) return false;
    }
    if (ev.include_usage) {
      json u = chunk(json::array());
      u["usage"] = usage(done);
      if (!ev.send(u)) return false;
    }
    return ev.finish("data: [DONE]\n\n");
  }
  // The stream: one event per token as the engine makes it, a last event per prompt with its
  // finish reason, the usage if asked for, then [DONE]. False if the client went away.
  bool stream(httplib::DataSink& sink, bool include_usage) const {
    const Events ev{sink, include_usage};
    if (chat) {
      json c = token_choice(0, "");
      c["delta"] = {{"role", "assistant"}, {"content", ""}};
      if (!ev.send(ev.with_usage(chunk({c})))) return false;
    }
    std::vector<uint64_t> sent(children.size(), 0);
    if (const std::optional<bool> ended = stream_tokens(ev, sent)) return *ended;
    return stream_end(ev, sent);
  }
};

// A request id a client may give (X-Request-Id): it becomes part of the transfer's ids, so
// it is short and plain.
bool plain_request_id(const std::string& id) {
  if (id.empty() || id.size() > 128) return false;
  return std::all_of(id.begin(), id.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' ||
           c == ':';
  });
}

namespace {

// One token per byte of a text prompt, or the prompt's token ids.
std::vector<int64_t> tokens_of(const json& prompt) {
  std::vector<int64_t> t;
  if (prompt.is_string()) {
    for (unsigned char c : prompt.get<std::string>()) t.push_back(c);
  } else if (prompt.is_array()) {
    for (const auto& x : prompt) {
      if (x.is_number_integer()) t.push_back(x.get<int64_t>());
    }
  }
  return t;
}

// A checked body's field; null stands for the field's absence.
json field(const json& body, const char* name, json fallback) {
  auto it = body.find(name);
  return it == body.end() || it->is_null() ? fallback : *it;
}

// The prompts of a checked body, each with the id both sides of its transfer share.
std::vector<std::pair<std::string, std::vector<int64_t>>> prompts_of(const json& body, bool chat,
                                                                     const std::string& parent) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> children;
  if (chat) {
    std::string text;  // every message's text, one token per byte
    for (const auto& m : field(body, "messages", json::array())) {
      auto c = m.find("content");
      if (c == m.end() || c->is_null()) continue;
      if (c->is_string()) {
        text += c->get<std::string>();
        continue;
      }
      for (const auto& part : *c) text += part.value("text", std::string());
    }
    children.push_back({"chatcmpl-" + parent, tokens_of(json(text))});
    return children;
  }
  const json prompt = field(body, "prompt", json(""));
  if (prompt.is_array() && !prompt.empty() && !prompt[0].is_number()) {
    for (size_t i = 0; i < prompt.size(); ++i) {
      children.push_back({"cmpl-" + parent + "-" + std::to_string(i), tokens_of(prompt[i])});
    }
  } else {
    children.push_back({"cmpl-" + parent + "-0", tokens_of(prompt)});
  }
  return children;
}

}  // namespace

// What a client asked for, checked against this engine.
struct Engine::Impl::Asked {
  std::vector<std::pair<std::string, std::vector<int64_t>>> prompts;
  std::optional<connector::KvTransferParams> params;
  uint64_t max_tokens = 16;
  bool stream = false;
  bool include_usage = false;
};

std::variant<Engine::Impl::Asked, HttpFault> Engine::Impl::read_request(const json& body, bool chat,
                                                                        const std::string& parent) {
  const http::PromptLimits limits{config.max_prompts, config.max_prompt_tokens};
  http::BodyFault fault;
  if (auto checked = http::check_openai_body(body, chat, limits, http::BodyRules::kServe, &fault);
      !checked) {
    return HttpFault{400, checked.status().message(), fault.param, fault.code};
  }
  if (auto m = body.find("model");
      m != body.end() && m->is_string() && *m != config.served_model_name) {
    return HttpFault{404,
                     "the model '" + m->get<std::string>() +
                         "' does not exist; this engine serves '" + config.served_model_name + "'",
                     "model", "model_not_found"};
  }
  Asked asked;
  if (body.contains("kv_transfer_params") && !body["kv_transfer_params"].is_null()) {
    auto p = connector::KvTransferParams::from_json(body["kv_transfer_params"].dump());
    if (!p) return HttpFault{400, p.status().message(), "kv_transfer_params", ""};
    asked.params = std::move(*p);
  }
  asked.prompts = prompts_of(body, chat, parent);
  const char* prompt_param = chat ? "messages" : "prompt";
  for (const auto& [id, tokens] : asked.prompts) {
    // A text prompt is one token per byte here.
    if (tokens.size() > config.max_prompt_tokens) {
      return HttpFault{400,
                       "request " + id + " has " + std::to_string(tokens.size()) +
                           " prompt tokens; the limit is " +
                           std::to_string(config.max_prompt_tokens),
                       prompt_param, "context_length_exceeded"};
    }
    if (tokens.empty())
      return HttpFault{400, "request " + id + " has an empty prompt", prompt_param, ""};
  }
  asked.max_tokens = http::requested_max_tokens(body, 16);
  if (auto why = never_fits(asked.prompts, asked.max_tokens)) {
    return HttpFault{400, *why, prompt_param, "context_length_exceeded"};
  }
  asked.stream = field(body, "stream", false).get<bool>();
  const json options = field(body, "stream_options", json::object());
  asked.include_usage = options.value("include_usage", json(false)).is_boolean() &&
                        options.value("include_usage", false);
  return asked;
}

std::optional<HttpFault> Engine::Impl::enqueue(Call& call, Asked& asked) {
  std::vector<std::shared_ptr<EngineRequest>> requests;
  {
    std::lock_guard lock(mu);
    if (auto why = refusal()) return HttpFault{503, *why, "", ""};
    for (auto& [id, tokens] : asked.prompts) {
      // Both sides of the transfer know a request by this id: two at once would mix.
      if (in_flight.count(id) != 0) {
        return HttpFault{409, "request " + id + " is already in flight", "X-Request-Id", ""};
      }
    }
    for (auto& [id, tokens] : asked.prompts) in_flight.insert(id);
    for (auto& [id, tokens] : asked.prompts) {
      auto r = std::make_shared<EngineRequest>();
      r->ext_id = id;
      r->request.request_id = id + "-" + random_hex(8);
      r->request.num_prompt_tokens = tokens.size();
      r->request.prompt_token_ids = std::move(tokens);
      r->request.params = asked.params;
      r->max_tokens = asked.max_tokens;
      r->admit_with_previous = !prefill && !requests.empty();
      r->progress = call.progress;
      r->index = requests.size();
      call.children.push_back(id);
      call.prompt_tokens.push_back(r->request.num_prompt_tokens);
      call.results.push_back(r->done.get_future().share());
      requests.push_back(r);
      incoming.push_back(std::move(r));
      ++stats.requests;
    }
  }
  cv.notify_all();
  // A client that closes its connection gives its request up (as vLLM aborts it): the core
  // frees what it holds instead of waiting out the request's deadlines.
  call.give_up = [this, requests] {
    for (auto& r : requests) r->cancelled.store(true);
    {
      std::lock_guard lock(mu);
      cancels_pending = true;
    }
    cv.notify_all();
  };
  call.client_went_away = [give_up = call.give_up] {
    if (!http::client_gone()) return false;
    give_up();
    return true;
  };
  return std::nullopt;
}

// A stream's status leaves with its first event: it waits for the first token (or the end
// of every prompt), so a request that fails before it gets an HTTP error.
std::optional<HttpFault> Engine::Impl::await_first_token(Call& call) {
  auto& p = *call.progress;
  std::unique_lock lock(p.mu);
  auto started = [&] {
    return std::any_of(p.tokens.begin(), p.tokens.end(), [](uint64_t t) { return t > 0; }) ||
           std::all_of(p.ended.begin(), p.ended.end(), [](bool e) { return e; });
  };
  while (!p.cv.wait_for(lock, kLook, started) && std::chrono::steady_clock::now() < call.deadline) {
    lock.unlock();
    const bool gone = call.client_went_away();
    lock.lock();
    if (gone) return HttpFault{499, "the client went away", "", ""};
  }
  const bool any_token =
      std::any_of(p.tokens.begin(), p.tokens.end(), [](uint64_t t) { return t > 0; });
  lock.unlock();
  if (any_token) return std::nullopt;
  auto outcome = call.wait();  // ended: an error, or Prefill's one token
  if (auto* failed = std::get_if<std::pair<int, std::string>>(&outcome)) {
    return HttpFault{failed->first, failed->second, "", ""};
  }
  return std::nullopt;
}

void Engine::Impl::serve(const httplib::Request& req, httplib::Response& res, bool chat) {
  std::string parent = req.get_header_value("X-Request-Id");
  auto fail = [&](const HttpFault& f) {
    // The engine's own failures are logged whole (the access line has only the status).
    if (f.status >= 500) {
      log::warn("{}: request {} failed: {}", prefill ? "prefill" : "decode",
                plain_request_id(parent) ? parent : "-", f.message);
    }
    http::set_api_error(res, f.status, f.message, f.param, f.code);
  };
  if (!parent.empty()) {
    res.set_header("X-Request-Id", parent);
    if (!plain_request_id(parent)) {
      return fail({400, "X-Request-Id must be 1 to 128 letters, digits and the characters - _ . :",
                   "X-Request-Id", ""});
    }
  }
  // Bounded before a document is built: a small hostile body cannot become a large one.
  auto parsed = http::parse_bounded<json>(req.body);
  if (!parsed) return fail({400, parsed.status().message(), "", ""});
  const json body = std::move(*parsed);
  if (!body.is_object()) return fail({400, "the body is not a JSON object", "", ""});
  if (parent.empty()) parent = random_hex(32);
  auto read = read_request(body, chat, parent);
  if (auto* f = std::get_if<HttpFault>(&read)) return fail(*f);
  auto& asked = std::get<Asked>(read);
  auto call = std::make_shared<Call>();
  call->chat = chat;
  call->id = chat ? "chatcmpl-" + parent : "cmpl-" + parent;
  call->object = chat ? "chat.completion" : "text_completion";
  call->model = config.served_model_name;
  call->created = static_cast<int64_t>(std::time(nullptr));
  call->token_text = prefill ? 'x' : 'y';
  if (!prefill) call->recompute_after = config.test_recompute_after;
  call->max_tokens = asked.max_tokens;
  call->progress = std::make_shared<Progress>(asked.prompts.size());
  call->deadline = std::chrono::steady_clock::now() + config.request_timeout;
  if (auto f = enqueue(*call, asked)) return fail(*f);
  if (!asked.stream) {
    auto outcome = call->wait();
    if (auto* failed = std::get_if<std::pair<int, std::string>>(&outcome)) {
      return fail({failed->first, failed->second, "", ""});
    }
    return res.set_content(call->whole(std::get<std::vector<Result>>(outcome)).dump(),
                           "application/json");
  }
  if (auto f = await_first_token(*call)) return fail(*f);
  res.set_chunked_content_provider("text/event-stream", [call, include_usage = asked.include_usage](
                                                            size_t, httplib::DataSink& sink) {
    return call->stream(sink, include_usage);
  });
}

}  // namespace rd2h::sim
