#include "rd2h/metaserver/proxy.h"

#include <httplib.h>
#include <sodium.h>

#include <cctype>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <set>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <variant>

#include "common/log.h"
#include "metaserver/client.h"
#include "metaserver/http_server.h"
#include "metaserver/openai_body.h"
#include "rd2h/version.h"

namespace rd2h::metaserver {

using nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

namespace {

// How often a waiting handler looks whether its client is still there.
constexpr std::chrono::milliseconds kLook{100};
// A Decode answer the proxy holds at once: a non-streamed one whole, a stream's backlog
// while the client reads slower than Decode writes.
constexpr size_t kMaxHeldAnswerBytes = 64u << 20;

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

// An X-Request-Id a client may give: echoed and logged, so short and printable.
bool printable_id(const std::string& id) {
  if (id.empty() || id.size() > 128) return false;
  return std::all_of(id.begin(), id.end(),
                     [](char c) { return c > 0x20 && c < 0x7f; });
}

// What the proxy reads of an engine's answer to a request of its own (Prefill's one-token
// answer, /health, /v1/models, /reset_prefix_cache): more is an error, never buffered.
constexpr size_t kMaxEngineAnswerBytes = 1u << 20;

// An engine's answer, its body bounded by kMaxEngineAnswerBytes.
struct EngineAnswer {
  int status = 0;    // 0: none (see error)
  std::string body;
  std::string error;  // why there is no answer: "did not answer: ...", "answered more than ..."
  bool too_long = false;
  explicit operator bool() const { return error.empty() && status != 0; }
};

EngineAnswer ask_engine(httplib::Client& c, const std::string& method, const std::string& path,
                        const httplib::Headers& headers, const std::string& body = {}) {
  httplib::Request req;
  req.method = method;
  req.path = path;
  req.headers = headers;
  if (method == "POST") {
    req.body = body;
    req.set_header("Content-Type", "application/json");
  }
  EngineAnswer a;
  req.response_handler = [&](const httplib::Response& r) {
    a.status = r.status;
    return true;
  };
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    if (a.body.size() + n > kMaxEngineAnswerBytes) {
      a.too_long = true;
      return false;
    }
    a.body.append(data, n);
    return true;
  };
  auto r = c.send(req);
  if (a.too_long) {
    a.error = "answered more than " + std::to_string(kMaxEngineAnswerBytes) + " bytes";
  } else if (!r) {
    a.error = "did not answer: " + httplib::to_string(r.error());
  }
  return a;
}

void set_timeouts(httplib::Client& c, std::chrono::milliseconds t) {
  c.set_connection_timeout(std::chrono::seconds(5));
  c.set_read_timeout(t);
  c.set_write_timeout(t);
}

}  // namespace

// One client request and the rendezvous of its children.
struct Parent {
  std::string id;
  std::string path;  // /v1/completions or /v1/chat/completions
  ordered_json body;
  std::vector<std::string> children;
  std::map<std::string, ordered_json> params;  // child -> Decode's rendezvous
  size_t decode = 0;
  std::mutex mu;
  bool dispatched = false;
  // Set when the request failed outside Decode (the Prefill dispatch, the client, the
  // proxy stopping): the status and OpenAI error object the client gets.
  int failure_status = 0;
  std::string failure;
  std::shared_ptr<httplib::Client> upstream;  // the Decode request, to close on failure
  std::shared_ptr<httplib::Client> prefill;   // the Prefill dispatch, to close on failure

  void fail(int status, const std::string& body) {
    std::shared_ptr<httplib::Client> up, pre;
    {
      std::lock_guard lock(mu);
      if (failure.empty()) {
        failure_status = status;
        failure = body;
      }
      up = upstream;
      pre = prefill;
    }
    if (up) up->stop();
    if (pre) pre->stop();
  }
  void fail(const std::string& why) { fail(502, api_error_json(502, why)); }
  std::pair<int, std::string> failed() {
    std::lock_guard lock(mu);
    return {failure_status, failure};
  }
};

// The Decode request of one client request, run on a thread of its own: meanwhile the
// client's handler watches its client, and it answers with Decode's own status once
// Decode's headers are in (a stream's status leaves with its first event).
struct DecodeLeg {
  std::mutex mu;
  std::condition_variable cv;
  int status = 0;  // Decode's HTTP status, once its headers are in
  std::string content_type;
  std::deque<std::string> chunks;
  size_t held = 0;  // bytes in `chunks`
  bool done = false;
  std::string error;  // why the request failed in transport, if it did
  bool stop = false;  // the handler is gone: drop what comes
  std::thread thread;

  ~DecodeLeg() {
    {
      std::lock_guard lock(mu);
      stop = true;
    }
    cv.notify_all();
    if (thread.joinable()) thread.join();
  }
};

// One round of a client request: the request as one Prefill and one Decode serve it. A
// stream that Decode ends with stop reason "recomputed" continues in a new round.
struct Round {
  std::shared_ptr<Parent> parent;
  std::shared_ptr<DecodeLeg> leg;
};

// A stream the proxy continues across rounds: what the client has seen so far.
struct Continuation {
  bool chat = false;
  ordered_json body;       // the client's body (with its stream_options: usage if asked)
  std::optional<uint64_t> budget;  // the client's token limit, if it gave one
  std::string id;          // the first round's id and created time, kept in every event
  ordered_json created;
  std::string text;        // every token's text so far
  uint64_t tokens = 0;     // events that carried text
  uint64_t prompt_tokens = 0;      // the first round's usage
  uint64_t completion_tokens = 0;  // usage of the rounds that ended recomputed
  int rounds = 0;
  bool recomputed = false;  // the current round ended with stop reason "recomputed"
  std::string pending;      // the bytes of an event not complete yet
};

struct Proxy::Impl {
  ProxyConfig config;
  // GET /metrics on the client API.
  metrics::Registry registry;
  HttpMetrics http{registry};
  metrics::Family<metrics::Histogram>& ttft = registry.histogram(
      "rd2h_proxy_time_to_first_token_seconds",
      "Streamed requests: from the request to its first event forwarded to the client", {},
      metrics::latency_buckets());
  metrics::Family<metrics::Counter>& rendezvous_posts = registry.counter(
      "rd2h_proxy_rendezvous_total", "Rendezvous posted by Decode, by whether the id was known",
      {"known"});
  metrics::Family<metrics::Counter>& dispatches = registry.counter(
      "rd2h_proxy_prefill_dispatches_total", "Requests dispatched to a Prefill instance",
      {"instance"});
  metrics::Family<metrics::Counter>& dispatch_failures = registry.counter(
      "rd2h_proxy_prefill_failures_total", "Prefill dispatches that failed", {"instance"});
  metrics::Family<metrics::Counter>& reissued = registry.counter(
      "rd2h_proxy_recomputed_reissues_total",
      "Streams Decode ended with stop reason recomputed, continued in a new round");
  metrics::Family<metrics::Counter>& cancelled = registry.counter(
      "rd2h_proxy_client_cancelled_total", "Requests given up because their client went away");
  metrics::Family<metrics::Gauge>& upstream_in_flight = registry.gauge(
      "rd2h_proxy_upstream_in_flight", "Requests in flight on each engine instance",
      {"role", "instance"});
  std::unique_ptr<HttpServer> api, rendezvous;
  int api_port = 0, rendezvous_port = 0;
  httplib::Headers auth;  // what the engines are sent: the bearer token, if any

  mutable std::mutex mu;
  std::condition_variable idle_cv;  // a client request finished (drain waits on it)
  std::map<std::string, std::shared_ptr<Parent>> by_child;
  std::set<std::shared_ptr<Parent>> parents;  // client requests in flight
  std::vector<int> decode_load, prefill_load;
  size_t decode_cursor = 0, prefill_cursor = 0;
  ProxyStats stats;
  bool stopping = false;
  bool draining = false;
  struct Dispatcher {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::list<Dispatcher> dispatchers;
  std::vector<std::shared_ptr<httplib::Client>> dispatch_clients;

  // The instance with the fewest requests in flight; ties go round, so an idle fleet is
  // used evenly. Caller holds mu.
  size_t least_loaded(std::vector<int>& load, size_t& cursor) {
    size_t best = cursor % load.size();
    for (size_t k = 1; k < load.size(); ++k) {
      const size_t i = (cursor + k) % load.size();
      if (load[i] < load[best]) best = i;
    }
    cursor = best + 1;
    ++load[best];
    return best;
  }

  std::string metaserver_url() const {
    return "http://" + config.host + ":" + std::to_string(rendezvous_port) + "/v1/metaserver";
  }

  void handle_client(const httplib::Request& req, httplib::Response& res, bool chat);
  // Registers a round (its children, its Decode instance) and starts its Decode leg; an
  // HTTP status and error body if the proxy cannot take it.
  std::variant<Round, std::pair<int, std::string>> begin_round(const std::string& path,
                                                               const ordered_json& body,
                                                               size_t prompts);
  // Whether the client can see Decode's stream as this proxy continues it across rounds.
  static bool continuable(const ordered_json& body, bool chat, size_t prompts);
  // One event of a continued stream: what the client gets of it (maybe nothing).
  std::string continue_event(Continuation& c, const std::string& event);
  // The body of the round that continues a stream Decode ended "recomputed".
  ordered_json next_round_body(const Continuation& c) const;
  void start_decode_leg(const std::shared_ptr<Parent>& parent, DecodeLeg& leg,
                        httplib::Headers headers, std::string payload);
  void handle_rendezvous(const httplib::Request& req, httplib::Response& res);
  void handle_health(httplib::Response& res);
  void handle_models(httplib::Response& res);
  void handle_reset_prefix_cache(httplib::Response& res);
  void dispatch_prefill(std::shared_ptr<Parent> parent);
  void finish(const std::shared_ptr<Parent>& parent);
};

void Proxy::Impl::start_decode_leg(const std::shared_ptr<Parent>& parent, DecodeLeg& leg,
                                   httplib::Headers headers, std::string payload) {
  auto upstream = std::make_shared<httplib::Client>(config.decode[parent->decode]);
  set_timeouts(*upstream, config.upstream_timeout);
  {
    std::lock_guard lock(parent->mu);
    parent->upstream = upstream;  // from here on a failure closes the Decode request
  }
  const bool stream = parent->body.value("stream", ordered_json(false)).is_boolean() &&
                      parent->body.value("stream", false);
  const std::string origin = config.decode[parent->decode];
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
    const std::string& path, const ordered_json& client_body, size_t prompts) {
  const bool chat = path == "/v1/chat/completions";
  auto parent = std::make_shared<Parent>();
  parent->id = uuid4();
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
      return std::pair{503, api_error_json(503, "the proxy is shutting down")};
    }
    if (config.decode.empty() || config.prefill.empty()) {
      return std::pair{503, api_error_json(503, "the proxy has no Prefill or no Decode instance")};
    }
    parent->decode = least_loaded(decode_load, decode_cursor);
    upstream_in_flight.with({"decode", config.decode[parent->decode]}).add(1);
    for (const auto& c : parent->children) by_child[c] = parent;
    parents.insert(parent);
  }
  ordered_json body = client_body;
  body["kv_transfer_params"] = {
      {"do_remote_decode", false}, {"do_remote_prefill", true}, {"metaserver", metaserver_url()}};
  httplib::Headers headers = auth;
  headers.emplace("X-Request-Id", parent->id);
  auto leg = std::make_shared<DecodeLeg>();
  start_decode_leg(parent, *leg, headers, body.dump());
  return Round{parent, leg};
}

bool Proxy::Impl::continuable(const ordered_json& body, bool chat, size_t prompts) {
  if (prompts != 1) return false;  // a prompt list's choices would each need their round
  if (chat) return body.contains("messages") && body["messages"].is_array();
  const auto prompt = body.find("prompt");
  if (prompt == body.end()) return false;
  return prompt->is_string() ||
         (prompt->is_array() && prompt->size() == 1 && (*prompt)[0].is_string());
}

ordered_json Proxy::Impl::next_round_body(const Continuation& c) const {
  ordered_json body = c.body;
  // The prompt and the text so far; the rest of the token budget.
  if (c.chat) {
    body["messages"].push_back({{"role", "assistant"}, {"content", c.text}});
    body["continue_final_message"] = true;
    body["add_generation_prompt"] = false;
  } else if (body["prompt"].is_string()) {
    body["prompt"] = body["prompt"].get<std::string>() + c.text;
  } else {
    body["prompt"][0] = body["prompt"][0].get<std::string>() + c.text;
  }
  if (c.budget) {
    const uint64_t left = *c.budget - std::min(*c.budget, c.tokens);
    for (const char* name : {"max_completion_tokens", "max_tokens"}) {
      if (body.contains(name) && !body[name].is_null()) body[name] = left;
    }
  }
  return body;
}

std::string Proxy::Impl::continue_event(Continuation& c, const std::string& event) {
  const std::string raw = event + "\n\n";
  if (event.rfind("data: ", 0) != 0) return raw;
  const std::string data = event.substr(6);
  if (data == "[DONE]") return c.recomputed ? std::string() : raw;
  auto j = ordered_json::parse(data, nullptr, /*allow_exceptions=*/false);
  // Not an event to follow (or nested too deep to copy and write back safely): as it is.
  if (j.is_discarded() || !j.is_object() || j.contains("error") ||
      nests_deeper_than(j, kMaxBodyNesting)) {
    return raw;
  }
  if (c.rounds == 0) {
    if (c.id.empty() && j.contains("id") && j["id"].is_string()) {
      c.id = j["id"].get<std::string>();
      c.created = j.value("created", ordered_json());
    }
  } else {
    // One answer: every round's events carry the first round's id.
    if (!c.id.empty()) j["id"] = c.id;
    if (!c.created.is_null()) j["created"] = c.created;
  }
  auto choices = j.find("choices");
  const bool has_choice = choices != j.end() && choices->is_array() && !choices->empty() &&
                          (*choices)[0].is_object();
  if (!has_choice) {
    // The usage event, after the last choice.
    auto usage = j.find("usage");
    if (usage == j.end() || !usage->is_object()) return c.recomputed ? std::string() : raw;
    const uint64_t prompt = usage->value("prompt_tokens", uint64_t{0});
    const uint64_t completion = usage->value("completion_tokens", uint64_t{0});
    if (c.rounds == 0) c.prompt_tokens = prompt;
    if (c.recomputed) {
      c.completion_tokens += completion;
      return {};
    }
    if (c.rounds == 0) return raw;  // one round: Decode's own count
    const uint64_t all = c.completion_tokens + completion;
    (*usage)["prompt_tokens"] = c.prompt_tokens;
    (*usage)["completion_tokens"] = all;
    (*usage)["total_tokens"] = c.prompt_tokens + all;
    return "data: " + j.dump() + "\n\n";
  }
  auto& choice = (*choices)[0];
  std::string text;
  if (c.chat) {
    auto delta = choice.find("delta");
    if (delta != choice.end() && delta->is_object()) {
      if (delta->contains("content") && (*delta)["content"].is_string()) {
        text = (*delta)["content"].get<std::string>();
      }
      // The client had the role from the first round.
      if (c.rounds > 0) delta->erase("role");
    }
  } else if (choice.contains("text") && choice["text"].is_string()) {
    text = choice["text"].get<std::string>();
  }
  c.text += text;
  if (!text.empty()) ++c.tokens;
  auto stop = choice.find("stop_reason");
  const bool recomputed = stop != choice.end() && *stop == "recomputed";
  const bool budget_left = !c.budget || c.tokens < *c.budget;
  if (recomputed && budget_left && c.rounds < config.max_reissues) {
    c.recomputed = true;  // the client's answer goes on in the next round
    choice["finish_reason"] = nullptr;
    choice.erase("stop_reason");
    if (text.empty()) return {};
  } else if (recomputed && !budget_left) {
    // Every token asked for has arrived: the answer is whole, whatever Decode lost after.
    choice["finish_reason"] = "length";
    choice.erase("stop_reason");
  } else if (c.rounds == 0) {
    return raw;  // nothing to change: forwarded as Decode wrote it
  } else if (text.empty() && choice["finish_reason"].is_null()) {
    return {};  // the next round's opening event: the client is past it
  }
  return "data: " + j.dump() + "\n\n";
}

void Proxy::Impl::handle_client(const httplib::Request& req, httplib::Response& res, bool chat) {
  const auto started = Clock::now();
  const std::string client_id = req.get_header_value("X-Request-Id");
  if (!client_id.empty() && !printable_id(client_id)) {
    return set_api_error(res, 400, "X-Request-Id must be 1 to 128 printable characters",
                         "X-Request-Id");
  }
  auto body = ordered_json::parse(req.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object()) {
    return set_api_error(res, 400, "the request body is not a JSON object");
  }
  BodyFault fault;
  const auto prompts = check_openai_body(
      body, chat, PromptLimits{config.max_prompts, config.max_prompt_tokens}, &fault);
  if (!prompts) return set_api_error(res, 400, prompts.status().message(), fault.param, fault.code);
  const auto stream_field = body.find("stream");
  const bool stream = stream_field != body.end() && stream_field->is_boolean() &&
                      stream_field->get<bool>();
  // A stream Decode may end "recomputed" is followed across rounds, event by event.
  auto cont = std::make_shared<Continuation>();
  const bool follow = stream && config.max_reissues > 0 && continuable(body, chat, *prompts);
  if (follow) {
    cont->chat = chat;
    cont->body = body;
    if (body.contains("max_completion_tokens") || body.contains("max_tokens")) {
      cont->budget = requested_max_tokens(body, 0);
    }
  }
  const std::string path = chat ? "/v1/chat/completions" : "/v1/completions";
  auto begun = begin_round(path, body, *prompts);
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
  auto parent = round->parent;
  auto leg = round->leg;
  // The client's id is echoed; the transfer is named by the proxy's own, which no client can
  // predict or reuse.
  res.set_header("X-Request-Id", client_id.empty() ? parent->id : client_id);
  // A client that hangs up gives its request up: both legs are closed, so the engines free
  // its blocks at once.
  auto client_left = [this](const std::shared_ptr<Parent>& of) {
    if (!client_gone()) return false;
    {
      std::lock_guard lock(mu);
      ++stats.client_cancelled;
    }
    cancelled.with().inc();
    of->fail(499, api_error_json(499, "the client went away"));
    return true;
  };
  // Decode's status, or the end of its answer.
  {
    std::unique_lock lock(leg->mu);
    while (!leg->cv.wait_for(lock, kLook, [&] { return leg->status != 0 || leg->done; })) {
      lock.unlock();
      const bool gone = client_left(parent);
      lock.lock();
      if (gone) break;
    }
  }
  auto answer_failure = [&]() -> bool {
    auto [status, failure] = parent->failed();
    if (failure.empty()) return false;
    res.status = status;
    res.set_content(failure, "application/json");
    return true;
  };
  bool streaming = false;
  {
    std::lock_guard lock(leg->mu);
    streaming = stream && leg->status == 200;
  }
  if (!streaming) {
    std::unique_lock lock(leg->mu);
    while (!leg->cv.wait_for(lock, kLook, [&] { return leg->done; })) {
      lock.unlock();
      const bool gone = client_left(parent);
      lock.lock();
      if (gone) break;
    }
    const bool done = leg->done;
    lock.unlock();
    if (!answer_failure()) {
      std::lock_guard held(leg->mu);
      if (!done || !leg->error.empty() || leg->status == 0) {
        set_api_error(res, 502, done ? leg->error : "the client went away");
      } else {
        std::string answer;
        answer.reserve(leg->held);
        for (auto& c : leg->chunks) answer += c;
        res.status = leg->status;
        res.set_content(answer, leg->content_type.empty() ? "application/json"
                                                          : leg->content_type);
      }
    }
    round->leg.reset();
    leg.reset();  // joins the leg before the request is finished
    finish(parent);
    return;
  }
  leg.reset();
  parent.reset();
  auto first_event = std::make_shared<bool>(true);
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, round, cont, follow, path, prompts = *prompts, client_left, started,
       first_event](size_t, httplib::DataSink& sink) {
        auto write = [&](const std::string& out) {
          if (out.empty()) return true;
          if (std::exchange(*first_event, false)) {
            ttft.with().observe(std::chrono::duration<double>(Clock::now() - started).count());
          }
          if (sink.write(out.data(), out.size())) return true;
          client_left(round->parent);
          round->parent->fail(499, api_error_json(499, "the client went away"));
          return false;
        };
        // Raw, or event by event for a stream that may go on in another round.
        auto forward = [&](std::string chunk) {
          if (!follow) return write(chunk);
          cont->pending += chunk;
          if (cont->pending.size() > kMaxHeldAnswerBytes) {
            return write("data: " +
                         api_error_json(502, "Decode sent an event of more than " +
                                                 std::to_string(kMaxHeldAnswerBytes) + " bytes") +
                         "\n\n");
          }
          size_t end;
          while ((end = cont->pending.find("\n\n")) != std::string::npos) {
            std::string event = cont->pending.substr(0, end);
            cont->pending.erase(0, end + 2);
            if (!write(continue_event(*cont, event))) return false;
          }
          return true;
        };
        for (;;) {
          auto& leg = round->leg;
          std::unique_lock lock(leg->mu);
          for (;;) {
            while (!leg->chunks.empty()) {
              std::string chunk = std::move(leg->chunks.front());
              leg->chunks.pop_front();
              leg->held -= chunk.size();
              lock.unlock();
              leg->cv.notify_all();
              if (!forward(std::move(chunk))) return false;
              lock.lock();
            }
            if (leg->done) break;
            if (!leg->cv.wait_for(lock, kLook,
                                  [&] { return leg->done || !leg->chunks.empty(); })) {
              lock.unlock();
              if (client_left(round->parent)) return false;
              lock.lock();
            }
          }
          std::string error = leg->error;
          const int status = leg->status;
          lock.unlock();
          auto [failed_status, failure] = round->parent->failed();
          if (failure.empty() && error.empty() && status != 200) {
            // A later round's Decode refused: its answer (an error object, not events) is
            // what the client gets.
            const auto answer = ordered_json::parse(cont->pending, nullptr, false);
            failure = answer.is_object() && answer.contains("error")
                          ? cont->pending
                          : api_error_json(502, "Decode answered HTTP " + std::to_string(status));
          }
          if (!failure.empty() || !error.empty()) {
            const std::string event =
                "data: " + (failure.empty() ? api_error_json(502, error) : failure) + "\n\n" +
                (cont->rounds > 0 ? "data: [DONE]\n\n" : "");
            sink.write(event.data(), event.size());
            sink.done();
            return true;
          }
          if (!cont->recomputed) break;
          // Decode lost the request's KV: the answer goes on from a new Prefill and Decode.
          {
            std::lock_guard stats_lock(mu);
            ++stats.reissued;
          }
          reissued.with().inc();
          log::info("proxy: request {}: Decode ended it recomputed after {} tokens; round {}",
                    round->parent->id, cont->tokens, cont->rounds + 2);
          auto next = begin_round(path, next_round_body(*cont), prompts);
          leg.reset();  // joins the leg before its round is finished
          finish(round->parent);
          if (auto* refused = std::get_if<std::pair<int, std::string>>(&next)) {
            const std::string event = "data: " + refused->second + "\n\ndata: [DONE]\n\n";
            sink.write(event.data(), event.size());
            sink.done();
            // The finish callback finishes the round the client saw last: already done.
            round->parent = std::make_shared<Parent>();
            return true;
          }
          *round = std::get<Round>(std::move(next));
          ++cont->rounds;
          cont->recomputed = false;
          cont->pending.clear();
        }
        sink.done();
        return true;
      },
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
      --decode_load[parent->decode];
      upstream_in_flight.with({"decode", config.decode[parent->decode]}).add(-1);
    }
  }
  idle_cv.notify_all();
}

void Proxy::Impl::handle_rendezvous(const httplib::Request& req, httplib::Response& res) {
  auto body = ordered_json::parse(req.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object() || !body.contains("request_id") ||
      !body["request_id"].is_string()) {
    return set_api_error(res, 400, "a rendezvous is a JSON object with a string request_id");
  }
  if (nests_deeper_than(body, kMaxBodyNesting)) {  // it is kept and copied: bound the recursion
    return set_api_error(res, 400,
                         "the rendezvous nests arrays and objects deeper than " +
                             std::to_string(kMaxBodyNesting) + " levels");
  }
  const std::string child = body["request_id"].get<std::string>();
  std::shared_ptr<Parent> parent;
  {
    std::lock_guard lock(mu);
    auto it = by_child.find(child);
    if (it == by_child.end()) {
      ++stats.unknown_rendezvous;
      rendezvous_posts.with({"false"}).inc();
      return set_api_error(res, 404, "unknown request id " + child, "request_id");
    }
    ++stats.rendezvous;
    rendezvous_posts.with({"true"}).inc();
    parent = it->second;
  }
  bool complete = false;
  {
    std::lock_guard lock(parent->mu);
    parent->params[child] = body;
    if (!parent->dispatched && parent->params.size() == parent->children.size()) {
      parent->dispatched = true;
      complete = true;
    }
  }
  if (complete) {
    std::lock_guard lock(mu);
    if (stopping) return set_api_error(res, 502, "the proxy is stopping");
    // Reap the dispatchers that ended, so a long-lived proxy does not collect threads.
    for (auto it = dispatchers.begin(); it != dispatchers.end();) {
      if (it->done->load()) {
        it->thread.join();
        it = dispatchers.erase(it);
      } else {
        ++it;
      }
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    dispatchers.push_back({std::thread([this, parent, done] {
                             dispatch_prefill(parent);
                             done->store(true);
                           }),
                           done});
  }
  res.set_content(R"({"status":"ok"})", "application/json");
}

void Proxy::Impl::dispatch_prefill(std::shared_ptr<Parent> parent) {
  ordered_json body = parent->body;
  body["stream"] = false;
  body.erase("stream_options");
  body["max_tokens"] = 1;
  body["min_tokens"] = 1;
  if (body.contains("max_completion_tokens")) body["max_completion_tokens"] = 1;
  {
    std::lock_guard lock(parent->mu);
    ordered_json params = parent->params[parent->children[0]];
    if (parent->children.size() > 1) {
      ordered_json batch = ordered_json::object();
      for (const auto& c : parent->children) batch[c] = parent->params[c];
      params["batch_kv_transfer_params"] = batch;
    }
    body["kv_transfer_params"] = params;
  }
  const std::string payload = body.dump();
  const int attempts = std::max(1, config.prefill_attempts);
  std::string why;
  int status = 502;
  std::string refusal;  // Prefill's own error object, when the client's body is at fault
  bool given_up = false;
  for (int attempt = 1;; ++attempt) {
    size_t which;
    std::shared_ptr<httplib::Client> client;
    bool stopped;
    {
      std::lock_guard lock(mu);
      ++stats.prefill_dispatches;
      which = least_loaded(prefill_load, prefill_cursor);
      dispatches.with({config.prefill[which]}).inc();
      upstream_in_flight.with({"prefill", config.prefill[which]}).add(1);
      client = std::make_shared<httplib::Client>(config.prefill[which]);
      set_timeouts(*client, config.upstream_timeout);
      dispatch_clients.push_back(client);  // the destructor stops it while in flight
      stopped = stopping;
    }
    {
      std::lock_guard lock(parent->mu);
      parent->prefill = client;  // a failure of the request closes it too
      stopped = stopped || !parent->failure.empty();
    }
    // Client::stop() only cuts a request in flight: one not started must not start.
    EngineAnswer r;
    r.error = "did not answer: the request was given up";
    if (!stopped) {
      httplib::Headers headers = auth;
      headers.emplace("X-Request-Id", parent->id);
      r = ask_engine(*client, "POST", parent->path, headers, payload);
    }
    why.clear();
    refusal.clear();
    status = 502;
    bool retry = false;
    given_up = stopped || !parent->failed().second.empty();  // given up meanwhile
    if (given_up) {
      why = "the request was given up before Prefill";
    } else if (!r) {
      why = "Prefill " + config.prefill[which] + " " + r.error;
      retry = !r.too_long;  // no answer: another try; an answer too long: none
    } else if (r.status != 200) {
      why = "Prefill " + config.prefill[which] + " answered HTTP " + std::to_string(r.status) +
            ": " + r.body.substr(0, 200);
      // A 4xx about the body (not the proxy's own token) is the client's to see as it is.
      const auto e = ordered_json::parse(r.body, nullptr, false);
      if (r.status >= 400 && r.status < 500 && r.status != 401 && r.status != 403 &&
          e.is_object() && e.contains("error") && e["error"].is_object()) {
        status = r.status;
        refusal = r.body;
      }
      retry = r.status >= 500;
    }
    {
      std::lock_guard lock(mu);
      --prefill_load[which];
      upstream_in_flight.with({"prefill", config.prefill[which]}).add(-1);
      for (auto it = dispatch_clients.begin(); it != dispatch_clients.end(); ++it) {
        if (*it == client) {
          dispatch_clients.erase(it);
          break;
        }
      }
      if (!why.empty() && !given_up) {
        ++stats.prefill_failures;
        dispatch_failures.with({config.prefill[which]}).inc();
      }
    }
    if (!retry || attempt >= attempts) break;
    // Exponential backoff before the next attempt, cut short if the proxy stops.
    const auto backoff = std::min<std::chrono::milliseconds>(
        config.prefill_retry_backoff * (1 << std::min(attempt - 1, 10)), std::chrono::seconds(5));
    log::info("proxy: request {}: {}; attempt {} of {} in {} ms", parent->id, why, attempt + 1,
              attempts, static_cast<long long>(backoff.count()));
    std::unique_lock lock(mu);
    if (idle_cv.wait_for(lock, backoff, [&] { return stopping; })) break;
  }
  if (!why.empty() && !given_up) {
    log::warn("proxy: request {}: {}", parent->id, why);
    parent->fail(status, refusal.empty() ? api_error_json(502, why) : refusal);
  }
}

void Proxy::Impl::handle_health(httplib::Response& res) {
  {
    std::lock_guard lock(mu);
    if (stopping || draining) return set_api_error(res, 503, "the proxy is shutting down");
  }
  ordered_json out = {{"status", "ok"}};
  std::vector<std::string> down;
  for (const auto* role : {"prefill", "decode"}) {
    const auto& list = role == std::string("prefill") ? config.prefill : config.decode;
    ordered_json instances = ordered_json::array();
    for (const auto& origin : list) {
      httplib::Client c(origin);
      c.set_connection_timeout(std::chrono::seconds(1));
      c.set_read_timeout(std::chrono::seconds(2));
      const bool ok = ask_engine(c, "GET", "/health", {}).status == 200;
      if (!ok) down.push_back(std::string(role) + " " + origin);
      instances.push_back({{"url", origin}, {"healthy", ok}});
    }
    out[role] = instances;
  }
  if (!down.empty()) {
    std::string names;
    for (const auto& d : down) names += (names.empty() ? "" : ", ") + d;
    out["status"] = "unhealthy";
    out["error"] = {{"message", "not answering /health: " + names}, {"type", "server_error"}};
    res.status = 503;
  }
  res.set_content(out.dump(), "application/json");
}

void Proxy::Impl::handle_reset_prefix_cache(httplib::Response& res) {
  std::vector<std::string> failed;
  for (const auto* list : {&config.prefill, &config.decode}) {
    for (const auto& origin : *list) {
      httplib::Client c(origin);
      set_timeouts(c, std::chrono::seconds(10));
      const auto r = ask_engine(c, "POST", "/reset_prefix_cache", auth);
      if (!r || r.status != 200) {
        failed.push_back(origin + (r ? " (HTTP " + std::to_string(r.status) + ")"
                                     : " (" + r.error + ")"));
      }
    }
  }
  if (failed.empty()) return res.set_content(R"({"status":"ok"})", "application/json");
  std::string names;
  for (const auto& f : failed) names += (names.empty() ? "" : ", ") + f;
  set_api_error(res, 500, "the prefix cache was not reset on " + names);
}

void Proxy::Impl::handle_models(httplib::Response& res) {
  std::string last = "no Decode instance";
  for (const auto& origin : config.decode) {
    httplib::Client c(origin);
    set_timeouts(c, std::chrono::seconds(5));
    const auto r = ask_engine(c, "GET", "/v1/models", auth);
    if (r && r.status == 200) return res.set_content(r.body, "application/json");
    last = "Decode " + origin + (r ? " answered HTTP " + std::to_string(r.status) : " " + r.error);
  }
  set_api_error(res, 502, last);
}

Expected<std::unique_ptr<Proxy>> Proxy::start(ProxyConfig config) {
  for (const auto* list : {&config.prefill, &config.decode}) {
    for (const auto& origin : *list) {
      auto u = parse_url(origin);
      if (!u || u->path != "/") {
        return invalid_argument("engine address '" + origin + "' is not http://host:port");
      }
    }
  }
  if (sodium_init() < 0) return internal_error("libsodium could not be initialised");
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  impl->decode_load.assign(config.decode.size(), 0);
  impl->prefill_load.assign(config.prefill.size(), 0);
  if (!config.token.empty()) impl->auth.emplace("Authorization", bearer(config.token));
  Impl* p = impl.get();
  HttpServerConfig api;
  api.host = config.host;
  api.port = config.port;
  api.name = "client API";
  api.max_body_bytes = config.max_body_bytes;
  api.max_connections = config.max_concurrent == 0 ? 1 : config.max_concurrent;
  api.token = config.token;
  api.api_key = config.api_key;
  api.metrics = &p->http;
  HttpServerConfig meta = api;
  meta.port = config.metaserver_port;
  meta.name = "metaserver";
  meta.max_connections = HttpServerConfig{}.max_connections;
  meta.api_key.clear();
  meta.access_log = false;  // a post per prompt: at debug level
  meta.metrics_name = "metaserver";
  p->api = std::make_unique<HttpServer>(api);
  p->rendezvous = std::make_unique<HttpServer>(meta);
  for (HttpServer* s : {p->api.get(), p->rendezvous.get()}) {
    s->post("/v1/metaserver", HttpServer::Auth::kToken,
            [p](const httplib::Request& req, httplib::Response& res) {
              p->handle_rendezvous(req, res);
            });
  }
  // The client-facing routes take the client API key (if one is set), not the engine token.
  using Auth = HttpServer::Auth;
  p->api->post("/v1/completions", Auth::kApiKey,
               [p](const httplib::Request& req, httplib::Response& res) {
                 p->handle_client(req, res, false);
               });
  p->api->post("/v1/chat/completions", Auth::kApiKey,
               [p](const httplib::Request& req, httplib::Response& res) {
                 p->handle_client(req, res, true);
               });
  p->api->get("/v1/models", Auth::kApiKey,
              [p](const httplib::Request&, httplib::Response& res) { p->handle_models(res); });
  // The existing proxy's operator routes.
  p->api->get("/healthcheck", Auth::kNone, [p](const httplib::Request&, httplib::Response& res) {
    res.set_content(ordered_json{{"status", "ok"},
                                 {"prefill_instances", p->config.prefill.size()},
                                 {"decode_instances", p->config.decode.size()}}
                        .dump(),
                    "application/json");
  });
  p->api->post("/reset_prefix_cache", Auth::kApiKey,
               [p](const httplib::Request&, httplib::Response& res) {
                 p->handle_reset_prefix_cache(res);
               });
  p->api->get("/health", Auth::kNone,
              [p](const httplib::Request&, httplib::Response& res) { p->handle_health(res); });
  p->api->get("/metrics", Auth::kNone, [p](const httplib::Request&, httplib::Response& res) {
    res.set_content(p->registry.render(), metrics::kContentType);
  });
  p->api->get("/version", Auth::kNone, [](const httplib::Request&, httplib::Response& res) {
    res.set_content(ordered_json{{"version", rd2h::version()}}.dump(), "application/json");
  });
  RD2H_RETURN_IF_ERROR(p->api->start());
  RD2H_RETURN_IF_ERROR(p->rendezvous->start());
  p->api_port = p->api->port();
  p->rendezvous_port = p->rendezvous->port();
  return std::unique_ptr<Proxy>(new Proxy(std::move(impl)));
}

Proxy::Proxy(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

bool Proxy::drain(std::chrono::milliseconds bound) {
  Impl& p = *impl_;
  std::unique_lock lock(p.mu);
  p.draining = true;
  return p.idle_cv.wait_for(lock, bound, [&] { return p.parents.empty(); });
}

Proxy::~Proxy() {
  Impl& p = *impl_;
  std::vector<std::shared_ptr<Parent>> in_flight;
  {
    std::lock_guard lock(p.mu);
    p.stopping = true;
    in_flight.assign(p.parents.begin(), p.parents.end());
  }
  p.idle_cv.notify_all();  // a dispatch backing off before its next attempt stops waiting
  // Failed first, so that the dispatches cut below are not taken for Prefill's failures.
  for (auto& parent : in_flight) {
    parent->fail(503, api_error_json(503, "the proxy is stopping"));
  }
  in_flight.clear();
  {
    std::lock_guard lock(p.mu);
    for (auto& c : p.dispatch_clients) c->stop();
  }
  {
    // Their handlers wake within a look and answer 503 before the connections close.
    std::unique_lock lock(p.mu);
    p.idle_cv.wait_for(lock, std::chrono::seconds(5), [&] { return p.parents.empty(); });
  }
  p.api->stop(std::chrono::seconds(5));  // the 503s of what was aborted go out first
  p.rendezvous->stop();
  std::list<Impl::Dispatcher> dispatchers;
  {
    std::lock_guard lock(p.mu);
    dispatchers.swap(p.dispatchers);
  }
  for (auto& d : dispatchers) d.thread.join();
}

int Proxy::port() const {
  return impl_->api_port;
}
std::string Proxy::url() const {
  return "http://" + impl_->config.host + ":" + std::to_string(impl_->api_port);
}
std::string Proxy::metaserver_url() const {
  return impl_->metaserver_url();
}
ProxyStats Proxy::stats() const {
  std::lock_guard lock(impl_->mu);
  return impl_->stats;
}

}  // namespace rd2h::metaserver
