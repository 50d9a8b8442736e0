// The proxy's insides, shared by its files (proxy.cc starts and stops it; proxy_client.cc,
// proxy_continue.cc and proxy_engines.cc are its client and engine sides): a client request
// and its rounds, and Proxy::Impl.
#pragma once

#include <httplib.h>

#include <cctype>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>
#include <variant>

#include "metaserver/client.h"
#include "rd2h/metaserver/proxy.h"
#include "rd2h/version.h"
#include "util/http_server.h"
#include "util/json_bounds.h"
#include "util/log.h"
#include "util/openai_body.h"
#include "util/thread_pool.h"

namespace rd2h::metaserver {

using nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

// How often a waiting handler looks whether its client is still there.
inline constexpr std::chrono::milliseconds kLook{100};
// A Decode answer the proxy holds at once: a non-streamed one whole, a stream's backlog
// while the client reads slower than Decode writes.
inline constexpr size_t kMaxHeldAnswerBytes = 64u << 20;

// What the proxy reads of an engine's answer to a request of its own (Prefill's one-token
// answer, /health, /v1/models, /reset_prefix_cache): more is an error, never buffered.
inline constexpr size_t kMaxEngineAnswerBytes = 1u << 20;
// Instances of one role the admin route takes in one list.
inline constexpr size_t kMaxInstances = 1024;

// An engine's answer, its body bounded by kMaxEngineAnswerBytes.
struct EngineAnswer {
  int status = 0;  // 0: none (see error)
  std::string body;
  std::string error;  // why there is no answer: "did not answer: ...", "answered more than ..."
  bool too_long = false;
  explicit operator bool() const { return error.empty() && status != 0; }
};

// Sends one request of the proxy's own to an engine and reads its answer, bounded.
EngineAnswer ask_engine(httplib::Client& c, const std::string& method, const std::string& path,
                        const httplib::Headers& headers, const std::string& body = {});
void set_timeouts(httplib::Client& c, std::chrono::milliseconds t);

// One client request and the rendezvous of its children.
struct Parent {
  std::string id;
  std::string client_id;  // the client's X-Request-Id, if it gave one: in the engines' lines
  std::string path;  // /v1/completions or /v1/chat/completions
  ordered_json body;
  std::vector<std::string> children;
  std::map<std::string, ordered_json> params;  // child -> Decode's rendezvous
  size_t decode = 0;                           // its Decode instance: an index into Impl::decodes
  std::string decode_origin;                   // and that instance's origin
  std::mutex mu;
  bool dispatched = false;
  // Its Decode failed and it is not tried again: no Prefill dispatch starts or goes on.
  bool prefill_abandoned = false;
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
  void fail(const std::string& why) { fail(502, http::api_error_json(502, why)); }
  // Stops its Prefill dispatch (in flight, or any still to come), the client's answer
  // left as it is: the KV it would compute has nowhere to go.
  void abandon_prefill() {
    std::shared_ptr<httplib::Client> pre;
    {
      std::lock_guard lock(mu);
      prefill_abandoned = true;
      pre = prefill;
    }
    if (pre) pre->stop();
  }
  // Whether its Prefill dispatch is not to go on (the request failed, or was abandoned).
  bool prefill_given_up() {
    std::lock_guard lock(mu);
    return prefill_abandoned || !failure.empty();
  }
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
  ordered_json body;               // the client's body (with its stream_options: usage if asked)
  std::optional<uint64_t> budget;  // the client's token limit, if it gave one
  std::string id;                  // the first round's id and created time, kept in every event
  ordered_json created;
  std::string text;                // every token's text so far
  uint64_t tokens = 0;             // events that carried text
  uint64_t prompt_tokens = 0;      // the first round's usage
  uint64_t completion_tokens = 0;  // usage of the rounds that ended recomputed
  int rounds = 0;
  bool recomputed = false;  // the current round ended with stop reason "recomputed"
  std::string pending;      // the bytes of an event not complete yet

  // The start of following a client's stream: its body, and its token budget if it set one.
  static Continuation of(const ordered_json& body, bool chat) {
    Continuation c;
    c.chat = chat;
    c.body = body;
    if (body.contains("max_completion_tokens") || body.contains("max_tokens")) {
      c.budget = http::requested_max_tokens(body, 0);
    }
    return c;
  }
};

// The instances of one role: their requests in flight, and whether they are in the rotation.
// An index names one instance for good (requests in flight hold it): an instance removed
// stays listed, marked removed, and is the same entry if it is added again. Guarded by
// Proxy::Impl::mu.
struct Pool {
  std::string role;  // "prefill" or "decode"
  std::vector<std::string> origins;
  std::vector<int> load;
  std::vector<std::string> down;  // why each is out of the rotation; empty: in it
  std::vector<bool> removed;      // no longer one of the pool: gets nothing new
  size_t cursor = 0;

  void assign(std::string r, const std::vector<std::string>& o) {
    role = std::move(r);
    origins.clear();
    load.clear();
    down.clear();
    removed.clear();
    for (const auto& origin : o) add(origin);
  }
  // Adds `origin` (in the rotation), or brings a removed entry of it back; its index.
  size_t add(const std::string& origin) {
    for (size_t i = 0; i < origins.size(); ++i) {
      if (origins[i] != origin) continue;
      if (removed[i]) {
        removed[i] = false;
        down[i].clear();
      }
      return i;
    }
    origins.push_back(origin);
    load.push_back(0);
    down.emplace_back();
    removed.push_back(false);
    return origins.size() - 1;
  }
  // The instances of the pool (not removed), by index.
  std::vector<size_t> members() const {
    std::vector<size_t> out;
    for (size_t i = 0; i < origins.size(); ++i) {
      if (!removed[i]) out.push_back(i);
    }
    return out;
  }
  bool serves(size_t i) const { return !removed[i] && down[i].empty(); }
  bool any_up() const {
    for (size_t i = 0; i < origins.size(); ++i) {
      if (serves(i)) return true;
    }
    return false;
  }
  // The least loaded instance in the rotation, counted as one more in flight; ties go
  // round, so an idle fleet is used evenly. With every instance out, the least loaded of
  // them all (one may be back before its probe says so). None without instances.
  std::optional<size_t> take() {
    const bool any = any_up();
    std::optional<size_t> best;
    for (size_t k = 0; k < load.size(); ++k) {
      const size_t i = (cursor + k) % load.size();
      if (removed[i] || (any && !down[i].empty())) continue;
      if (!best || load[i] < load[*best]) best = i;
    }
    if (!best) return std::nullopt;
    cursor = *best + 1;
    ++load[*best];
    return best;
  }
};

struct Proxy::Impl {
  ProxyConfig config;
  // GET /metrics on the client API.
  metrics::Registry registry;
  http::HttpMetrics http_metrics{registry};
  metrics::Family<metrics::Histogram>& ttft = registry.histogram(
      "rd2h_proxy_time_to_first_token_seconds",
      "Streamed requests: from the request to its first event forwarded to the client", {},
      metrics::latency_buckets());
  metrics::Family<metrics::Counter>& rendezvous_posts =
      registry.counter("rd2h_proxy_rendezvous_total",
                       "Rendezvous posted by Decode, by whether the id was known", {"known"});
  metrics::Family<metrics::Counter>& dispatches =
      registry.counter("rd2h_proxy_prefill_dispatches_total",
                       "Requests dispatched to a Prefill instance", {"engine"});
  metrics::Family<metrics::Counter>& dispatch_failures = registry.counter(
      "rd2h_proxy_prefill_failures_total", "Prefill dispatches that failed", {"engine"});
  metrics::Family<metrics::Counter>& reissued = registry.counter(
      "rd2h_proxy_recomputed_reissues_total",
      "Streams Decode ended with stop reason recomputed, continued in a new round");
  metrics::Family<metrics::Counter>& cancelled = registry.counter(
      "rd2h_proxy_client_cancelled_total", "Requests given up because their client went away");
  metrics::Family<metrics::Gauge>& upstream_in_flight =
      registry.gauge("rd2h_proxy_upstream_in_flight", "Requests in flight on each engine instance",
                     {"role", "engine"});
  metrics::Family<metrics::Gauge>& in_rotation = registry.gauge(
      "rd2h_proxy_instance_in_rotation",
      "1 while an engine instance is in the rotation, 0 while it is out of it or removed",
      {"role", "engine"});
  metrics::Family<metrics::Counter>& taken_out_count = registry.counter(
      "rd2h_proxy_taken_out_total", "Times an engine instance left the rotation (it failed)",
      {"role", "engine"});
  metrics::Family<metrics::Counter>& decode_retry_count = registry.counter(
      "rd2h_proxy_decode_retries_total", "Client requests started again on another Decode");
  metrics::Family<metrics::Counter>& abandoned_count =
      registry.counter("rd2h_proxy_prefill_abandoned_total",
                       "Prefill dispatches stopped because their Decode failed for good");
  // Sets in_rotation for every instance `pool` has had (under mu).
  void publish_rotation(const Pool& pool) {
    for (size_t i = 0; i < pool.origins.size(); ++i) {
      in_rotation.with({pool.role, pool.origins[i]}).set(pool.serves(i) ? 1 : 0);
    }
  }
  std::unique_ptr<http::HttpServer> api, rendezvous;
  // The client API and the metaserver listener, with their routes (before they start).
  void make_servers();
  void add_routes();
  int api_port = 0, rendezvous_port = 0;
  httplib::Headers auth;  // what the engines are sent: the bearer token, if any
  // An engine request's headers: the token, the proxy's id for the request (which names its
  // transfer) and the client's own id, if it gave one, for the engines' lines.
  httplib::Headers engine_headers(const Parent& parent) const {
    httplib::Headers headers = auth;
    headers.emplace("X-Request-Id", parent.id);
    if (!parent.client_id.empty()) headers.emplace("X-Client-Request-Id", parent.client_id);
    return headers;
  }

  mutable std::mutex mu;
  std::condition_variable idle_cv;  // a client request finished (drain waits on it)
  std::map<std::string, std::shared_ptr<Parent>> by_child;
  std::set<std::shared_ptr<Parent>> parents;  // client requests in flight
  Pool prefills, decodes;
  ProxyStats stats;
  bool stopping = false;
  bool draining = false;
  // Prefill dispatches: at most one per client request in flight.
  std::unique_ptr<ThreadPool> dispatchers;
  // The dispatches in flight, by the Prefill instance they went to.
  std::vector<std::pair<size_t, std::shared_ptr<httplib::Client>>> dispatch_clients;

  // Takes instance `i` of `pool` out of the rotation (it failed: `why`), or brings it back.
  // Caller holds mu.
  void take_out(Pool& pool, size_t i, const std::string& why);
  void bring_back(Pool& pool, size_t i);
  // The health probes: every probe_interval, GET /health of each instance.
  std::thread prober;
  void probe_loop();
  // Whether an engine answers GET /health within the probe timeout, not with a 5xx; why not.
  std::optional<std::string> probe(const std::string& origin) const;

  std::string metaserver_url() const {
    return http_origin(config.advertise_host.empty() ? config.host : config.advertise_host,
                       rendezvous_port) +
           "/v1/metaserver";
  }

  void handle_client(const httplib::Request& req, httplib::Response& res, bool chat);
  // Whether the client went away (it hung up); if so `of` fails with 499. On the client's
  // connection thread only.
  bool client_left(const std::shared_ptr<Parent>& of);
  // Waits until `ready` holds (under the leg's mu) or the client goes away; false if it did.
  bool wait_on_leg(DecodeLeg& leg, const std::shared_ptr<Parent>& parent,
                   const std::function<bool()>& ready);
  // Decode's whole answer, or the failure the client gets instead; then the request is done.
  // With `cont` (a request that may go on), an answer Decode ended "recomputed" goes on in
  // further rounds, and the client gets them as one answer.
  void answer_whole(httplib::Response& res, const std::shared_ptr<Round>& round, Continuation* cont,
                    const std::string& path, size_t prompts);
  // Takes a whole answer (`j`, parsed) into `c`: whether it ended "recomputed" with tokens
  // still to come, so another round is to follow. `merged` becomes the answer so far.
  bool continue_whole(Continuation& c, ordered_json& j, ordered_json& merged) const;
  struct StreamRelay;
  // Registers a round (its children, its Decode instance) and starts its Decode leg; an
  // HTTP status and error body if the proxy cannot take it.
  std::variant<Round, std::pair<int, std::string>> begin_round(const std::string& path,
                                                               const ordered_json& body,
                                                               size_t prompts,
                                                               const std::string& client_id);
  // Whether the client can see Decode's stream as this proxy continues it across rounds.
  static bool continuable(const ordered_json& body, bool chat, size_t prompts);
  // One event of a continued stream: what the client gets of it (maybe nothing).
  std::string continue_event(Continuation& c, const std::string& event);
  // Its parts: the usage event (`j`, whose text is `raw`), and an event with a choice.
  std::string continue_usage(Continuation& c, ordered_json& j, const std::string& raw);
  std::string continue_choice(Continuation& c, ordered_json& j, ordered_json& choice,
                              const std::string& raw);
  // The body of the round that continues a stream Decode ended "recomputed".
  ordered_json next_round_body(const Continuation& c) const;
  void start_decode_leg(const std::shared_ptr<Parent>& parent, DecodeLeg& leg,
                        httplib::Headers headers, std::string payload);
  void handle_rendezvous(const httplib::Request& req, httplib::Response& res);
  void handle_health(httplib::Response& res);
  // The admin routes: GET lists the instances of both pools, POST sets them.
  void handle_instances(const httplib::Request& req, httplib::Response& res);
  // Whether this request may use the admin routes (an error answered if not).
  bool admin_allowed(httplib::Response& res) const;
  // Makes `wanted` the instances of `pool`: those not in it leave (their requests in flight
  // finish), new ones join once their health probe answers (at once without a prober).
  // Caller holds mu.
  void set_instances(Pool& pool, const std::vector<std::string>& wanted,
                     const std::vector<std::optional<std::string>>& verdicts);
  // The pools as GET /admin/instances shows them. Caller holds mu.
  ordered_json instances_json() const;
  void handle_models(httplib::Response& res);
  // The origins of the instances of `pool` now.
  std::vector<std::string> member_origins(const Pool& pool) const;
  void handle_reset_prefix_cache(const httplib::Request& req, httplib::Response& res);
  void dispatch_prefill(std::shared_ptr<Parent> parent);
  // What Prefill is sent for a client request: its body for one token, with every child's
  // kv_transfer_params.
  std::string prefill_payload(Parent& parent) const;
  // How one Prefill dispatch went: why it failed (empty: it did not), whether another
  // attempt may go, and Prefill's own refusal of the client's body.
  struct PrefillAttempt {
    std::string why;
    int status = 502;
    std::string refusal;
    bool retry = false;
    bool given_up = false;
  };
  PrefillAttempt attempt_prefill(const std::shared_ptr<Parent>& parent, const std::string& payload);
  void finish(const std::shared_ptr<Parent>& parent);
};

}  // namespace rd2h::metaserver
