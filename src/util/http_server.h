// The one way rd2h serves HTTP (the proxy's API and metaserver, the simulator's engines):
// cpp-httplib's routing and parsing inside rd2h's own connection handling. Every wait, body and
// connection count is bounded. A route's token or API key is checked before its handler runs (401).
#pragma once

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "rd2h/common/status.h"
#include "util/metrics.h"
#include "util/token.h"

namespace rd2h::http {

// What every HTTP server of a process counts, by listener (its HttpServerConfig::metrics_name),
// route (a registered path, else "other") and status.
struct HttpMetrics {
  explicit HttpMetrics(metrics::Registry& r);
  metrics::Family<metrics::Counter>& requests;
  metrics::Family<metrics::Gauge>& in_flight;
  metrics::Family<metrics::Histogram>& duration;
};

struct HttpServerConfig {
  std::string host = "127.0.0.1";
  int port = 0;               // 0 picks a free port
  std::string name = "HTTP";  // in errors: "cannot listen ... for the <name>"
  int backlog = 1024;
  size_t max_connections = 512;  // connections served at once (one thread each)
  size_t max_body_bytes = 16u << 20;
  std::chrono::milliseconds keep_alive_timeout{5000};  // idle before (between) requests
  std::chrono::milliseconds header_timeout{5000};      // a request's head, from its first byte
  std::chrono::milliseconds request_timeout{30000};    // a whole request arrives within it
  // Connections waiting for a request's head (they hold no thread); past it, those
  // waiting longest are closed.
  size_t max_waiting_connections = 4096;
  // Of those, from one client address; past it, that address's longest waiting is closed
  // (one client cannot push the others' connections out).
  size_t max_waiting_per_client = 512;
  // What the waiting connections' requests may hold in all (heads and bodies read before a
  // thread serves them; at least one largest request); past it, the longest waiting are
  // closed.
  size_t max_waiting_bytes = 256u << 20;
  std::chrono::milliseconds write_timeout{30000};      // one write waits at most this
  size_t keep_alive_max_count = 100;                   // requests on one connection
  std::string token;                                   // empty: routes need no token
  std::string api_key;                                 // empty: Auth::kApiKey routes need none
  // One log line per request (name, X-Request-Id, method and path, status, latency) at
  // info level; false: at debug level.
  bool access_log = true;
  HttpMetrics* metrics = nullptr;    // counted here if set (it outlives the server)
  std::string metrics_name = "api";  // the listener label of its series
};

class HttpServer {
 public:
  using Handler = std::function<void(const httplib::Request&, httplib::Response&)>;
  enum class Auth { kNone, kToken, kApiKey };

  explicit HttpServer(HttpServerConfig config);
  ~HttpServer();  // stop()
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Routes, before start(). `path` is matched exactly.
  void post(const std::string& path, Auth auth, Handler handler);
  void get(const std::string& path, Auth auth, Handler handler);

  // Binds, listens and starts accepting; returns once connections are served.
  Status start();
  // Stops accepting, lets requests being handled or answered finish for up to `grace`,
  // then wakes every connection and joins every thread. Handlers still running must return
  // on their own (their owners stop what they wait on first).
  void stop(std::chrono::milliseconds grace = std::chrono::milliseconds(0));

  int port() const { return port_; }
  uint64_t rejected_connections() const;

  class Server;

 private:
  void require(const std::string& path, const std::string& method, Auth auth);

  HttpServerConfig config_;
  std::unique_ptr<Server> server_;
  std::map<std::string, const std::string*> key_of_path_;  // the secret a route needs
  std::set<std::string> routes_;  // paths with a handler: the route label of the metrics
  std::map<std::string, std::set<std::string>> methods_;  // the methods of each path
  std::thread thread_;
  int port_ = 0;
};

// OpenAI's error object, {"error": {"message", "type", "param", "code"}}: the type follows
// from the HTTP status; an empty param or code is null.
std::string api_error_json(int status, const std::string& message, const std::string& param = {},
                           const std::string& code = {});
// What an error answer says, whole, for a log line: the message of an OpenAI error object,
// else the body itself (its first 4 KiB, with its size if longer).
std::string error_text(const std::string& body);
// Answers with `status` and that object.
void set_api_error(httplib::Response& res, int status, const std::string& message,
                   const std::string& param = {}, const std::string& code = {});

// A request id a client may give (X-Request-Id): echoed and logged, so 1 to 128 printable
// characters, no spaces.
bool printable_id(const std::string& id);

// Marks the connection of the request being handled to close after its answer (a request
// whose body was not read to the end leaves the stream unusable).
void close_connection_after_response();
// Whether the client of the request being handled closed its connection (or it broke):
// a handler that waits long asks this now and then, and gives the work up if so.
bool client_gone();

}  // namespace rd2h::http
