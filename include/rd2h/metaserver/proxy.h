// rd2h proxy (spec "Request Lifecycle"; docs/wire-format.md "The rendezvous over HTTP"): an
// OpenAI-style HTTP front over Prefill and Decode instances, with the metaserver that pairs them.
//
// A client request goes to the least-loaded Decode first, with kv_transfer_params
// {do_remote_decode: false, do_remote_prefill: true, metaserver: <url>}; Decode's output
// streams back to the client. Decode posts each child's rendezvous to the metaserver; once
// every child of a request reported, the proxy dispatches the original request to the
// least-loaded Prefill once (max_tokens, min_tokens and max_completion_tokens 1, no
// stream_options, first child's params plus batch_kv_transfer_params for a prompt list),
// tried again with backoff if it gets no answer or a 5xx. A metaserver post is answered at once and
// never held; it is served by a listener of its own, so client requests cannot starve it.
// If the Prefill dispatch fails, the client's request fails cleanly (its Decode request
// is closed) with a 502, or with Prefill's own 4xx when it refused the client's body. A
// client that hangs up, streamed or not, has both its Decode and Prefill requests closed,
// so the engines give the request up and free its blocks at once. Errors are OpenAI
// error objects; the client's X-Request-Id is echoed (the transfer is named by the proxy's
// own random id).
//
// Instances fail over: one that fails (no answer or a refused connection, a 5xx, no answer
// within its deadline, a failed health probe) leaves the rotation at once and is probed
// (GET /health) in the background until it answers again; requests go to the least loaded
// instance in rotation. A client request whose Decode fails before anything reached the
// client goes to another Decode (decode_attempts); a Prefill dispatch that fails goes to
// another Prefill (prefill_attempts). /health is 200 while at least one Prefill and one
// Decode are in rotation, and names each instance's state. A client request whose Decode
// failed and is not tried again has its Prefill dispatch stopped.
//
// The pools change while the proxy runs: GET /admin/instances lists each instance with its
// state ("serving", "out of rotation", "leaving") and requests in flight; POST
// /admin/instances {"prefill": [origins], "decode": [origins]} (either list, whole) makes
// them the pool: an instance left out gets no new request and leaves once those it holds
// finish; one added joins at once if its health probe answers, else out of rotation until
// one does. These routes take the engines' token; a proxy without one serves them on a
// loopback address only.
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
