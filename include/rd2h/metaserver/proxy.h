// rd2h proxy (spec "Request Lifecycle"): an OpenAI-style HTTP front over Prefill and Decode
// instances, with the metaserver that pairs them: a client request goes to a Decode first, then,
// once its rendezvous arrived, to a Prefill. Behaviour: docs/design.md "The proxy".
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "rd2h/common/status.h"

namespace rd2h::metaserver {

struct ProxyConfig {
  std::string host = "127.0.0.1";    // binds this address only
  // The address Decode engines reach the proxy at, in the metaserver URL they are given
  // (empty: `host`). It cannot be a wildcard: a proxy bound to one needs it.
  std::string advertise_host;
  // A proxy on an address other than loopback with neither `api_key` nor `token` is
  // refused at start, unless this is set (then it starts with a warning).
  bool allow_unauthenticated = false;
  int port = 0;                      // client API; 0 picks a free port
  int metaserver_port = 0;           // rendezvous listener; 0 picks a free port
  std::vector<std::string> prefill;  // engine origins, "http://host:port"
  std::vector<std::string> decode;
  size_t max_body_bytes = 16u << 20;  // any framing, chunked too: larger is a 413
  size_t max_concurrent = 256;        // client requests served at once; more are refused (503)
  size_t max_prompts = 1024;          // prompts in one prompt list: more is a 400
  size_t max_prompt_tokens = 262144;  // tokens in one token list: more is a 400
  // The shared bearer token the metaserver requires and the engines are sent
  // (Authorization: Bearer <token>); empty: none. The client API never takes it (see
  // api_key).
  std::string token;
  // The key clients must send (Authorization: Bearer <key>) on /v1/completions,
  // /v1/chat/completions and /v1/models; empty: none. /health and /version need none.
  std::string api_key;
  std::chrono::milliseconds upstream_timeout{600000};
  // A Prefill dispatch that gets no answer or a 5xx is tried again, up to this many
  // attempts in all, waiting prefill_retry_backoff, then twice as long each time (at most
  // 5 s), before the client gets a 502.
  int prefill_attempts = 3;
  std::chrono::milliseconds prefill_retry_backoff{100};
  // A stream Decode ends with stop reason "recomputed" (it lost the request's KV) is
  // continued: the prompt plus the text so far and the rest of the token budget go to
  // Prefill and Decode again, up to this many times, and the client sees one answer. For
  // a single prompt (a text prompt or chat messages); 0: never.
  int max_reissues = 3;
  // Every instance is probed (GET /health, answered within probe_timeout, not with a 5xx)
  // this often: a failed probe takes it out of the rotation, a good one brings it back.
  // Zero: no probes (an instance that failed comes back at its next probe only, so never;
  // /health then asks every engine itself).
  // A Prefill taken out has its dispatches in flight cut and sent to another Prefill.
  std::chrono::milliseconds probe_interval{1000};
  std::chrono::milliseconds probe_timeout{2000};
  // A client request whose Decode gets no answer or answers a 5xx before anything reached
  // the client is tried on another Decode in rotation, up to this many attempts in all.
  int decode_attempts = 2;
};

struct ProxyStats {
  uint64_t requests = 0;
  uint64_t rendezvous = 0;
  uint64_t unknown_rendezvous = 0;
  uint64_t prefill_dispatches = 0;
  uint64_t prefill_failures = 0;
  uint64_t client_cancelled = 0;  // requests given up because their client went away
  uint64_t reissued = 0;          // rounds begun to continue a stream Decode recomputed
  uint64_t decode_retries = 0;    // client requests sent to another Decode after a failure
  uint64_t prefill_abandoned = 0;  // Prefill dispatches stopped: their Decode failed for good
  uint64_t taken_out = 0;         // times an instance left the rotation
  uint64_t brought_back = 0;      // times one came back
};

class Proxy {
 public:
  static Expected<std::unique_ptr<Proxy>> start(ProxyConfig config);
  ~Proxy();  // stops both listeners and every upstream request, joins every thread
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  // Stops taking client requests (they get 503, and so does /health) and waits up to
  // `bound` for those in flight to finish; true if they all did. The destructor then
  // aborts whatever is left.
  bool drain(std::chrono::milliseconds bound);

  int port() const;
  std::string url() const;             // http://host:port
  std::string metaserver_url() const;  // what Decode is told to post to
  ProxyStats stats() const;

  struct Impl;

 private:
  explicit Proxy(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace rd2h::metaserver
