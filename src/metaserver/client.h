// Decode's metaserver client: posts each request's rendezvous JSON to the proxy's metaserver in
// the background, retrying until delivered, cancelled (the request finished) or stopped. An HTTP
// error response counts as delivered (and is logged); every post is bounded by `timeout`.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "rd2h/common/status.h"
#include "util/thread_pool.h"

namespace rd2h::metaserver {

struct ClientConfig {
  std::chrono::milliseconds timeout{5000};
  int attempts = 3;
  std::chrono::milliseconds backoff{50};
  std::chrono::milliseconds resubmit{1000};
  size_t threads = 4;
  std::string token;  // sent as Authorization: Bearer <token>; empty: none
};

struct ClientStats {
  uint64_t delivered = 0;         // answered 2xx
  uint64_t http_errors = 0;       // answered otherwise: delivered all the same
  uint64_t transport_errors = 0;  // attempts that got no answer
  uint64_t cancelled = 0;
};

// "http://host:port/path" split for the HTTP client; an unsupported URL is an error.
struct Url {
  std::string origin;  // scheme://host:port
  std::string path;
};
Expected<Url> parse_url(const std::string& url);
// An engine's origin, exactly "http://host:port": the host a valid host name (RFC 1123, its
// last label not all digits), a dotted IPv4 address or a bracketed IPv6 one, the port in
// 1..65535. The error says what is wrong.
Expected<Url> parse_origin(const std::string& origin);
// "http://host:port", with an IPv6 host in brackets.
std::string http_origin(const std::string& host, int port);

class Client {
 public:
  explicit Client(ClientConfig config);
  ~Client();  // drops what is pending and joins the threads
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Posts `json` to `url` on behalf of request `key`. A malformed URL is refused at once.
  Status post(const std::string& key, const std::string& url, std::string json);
  // The request finished: stop trying (a post in flight completes, and is not retried).
  void cancel(const std::string& key);
  bool pending(const std::string& key) const;
  ClientStats stats() const;

 private:
  struct Job {
    std::string key;
    Url url;
    std::string body;
    int attempts = 0;
  };
  using Clock = std::chrono::steady_clock;
  void run();
  void attempt(Job job);

  ClientConfig config_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::multimap<Clock::time_point, Job> queue_;  // by when to try next
  std::set<std::string> keys_;                   // queued or in flight
  ClientStats stats_;
  bool stopping_ = false;
  ThreadPool pool_;  // config_.threads posting loops
};

}  // namespace rd2h::metaserver
