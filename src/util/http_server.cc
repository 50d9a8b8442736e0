// HttpServer's front: the routes and the tokens they need, the access log and metrics of
// every answer, start and stop; OpenAI's error object, and the bearer token. The connection
// handling and its limits are in http_connection.cc.
#include "util/http_server.h"

#include <sodium.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "util/http_server_impl.h"
#include "util/log.h"

namespace rd2h::http {

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

bool printable_id(const std::string& id) {
  if (id.empty() || id.size() > 128) return false;
  return std::all_of(id.begin(), id.end(), [](char c) { return c > 0x20 && c < 0x7f; });
}

std::string error_text(const std::string& body) {
  const auto j = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_object()) {
    const auto e = j.find("error");
    if (e != j.end() && e->is_object()) {
      const auto m = e->find("message");
      if (m != e->end() && m->is_string()) return m->get<std::string>();
    }
  }
  constexpr size_t kShown = 4096;
  if (body.size() <= kShown) return body;
  return body.substr(0, kShown) + "... (" + std::to_string(body.size()) + " bytes)";
}

std::string api_error_json(int status, const std::string& message, const std::string& param,
                           const std::string& code) {
  const char* type = status == 401   ? "authentication_error"
                     : status == 403 ? "permission_error"
                     : status == 404 ? "not_found_error"
                     : status == 429 ? "rate_limit_error"
                     : status >= 500 ? "server_error"
                                     : "invalid_request_error";
  auto or_null = [](const std::string& s) {
    return s.empty() ? nlohmann::json() : nlohmann::json(s);
  };
  return nlohmann::json{
      {"error",
       {{"message", message}, {"type", type}, {"param", or_null(param)}, {"code", or_null(code)}}}}
      .dump();
}

void set_api_error(httplib::Response& res, int status, const std::string& message,
                   const std::string& param, const std::string& code) {
  res.status = status;
  res.set_content(api_error_json(status, message, param, code), "application/json");
}

HttpMetrics::HttpMetrics(metrics::Registry& r)
    : requests(r.counter("rd2h_http_requests_total", "HTTP requests answered",
                         {"listener", "route", "status"})),
      in_flight(
          r.gauge("rd2h_http_requests_in_flight", "HTTP requests being served", {"listener"})),
      duration(r.histogram("rd2h_http_request_duration_seconds",
                           "From a request's first byte to the end of its answer (a stream's "
                           "last event)",
                           {"listener", "route"}, metrics::latency_buckets())) {}

Expected<std::string> load_token(const std::string& path) {
  std::string token;
  if (!path.empty()) {
    std::ifstream in(path);
    if (!in || !std::getline(in, token)) {
      return invalid_argument("cannot read a token from '" + path + "'");
    }
  } else if (const char* env = std::getenv("RD2H_TOKEN")) {
    token = env;
  }
  while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back()))) {
    token.pop_back();
  }
  if (!path.empty() && token.empty()) {
    return invalid_argument("the token file '" + path + "' is empty");
  }
  if (!token.empty() && token.size() < kMinTokenChars) {
    return invalid_argument(
        std::string("the token ") + (path.empty() ? "in $RD2H_TOKEN" : "in '" + path + "'") +
        " has " + std::to_string(token.size()) + " characters; at least " +
        std::to_string(kMinTokenChars) + " are needed (e.g. `openssl rand -hex 16`)");
  }
  return token;
}

std::string bearer(const std::string& token) {
  return token.empty() ? std::string() : "Bearer " + token;
}

bool token_matches(const std::string& header, const std::string& token) {
  const std::string prefix = "Bearer ";
  if (header.compare(0, prefix.size(), prefix) != 0) return false;
  // Equal-length digests compared in constant time: neither the bytes nor the length of
  // the token leak through timing.
  unsigned char a[crypto_generichash_BYTES], b[crypto_generichash_BYTES];
  crypto_generichash(a, sizeof(a),
                     reinterpret_cast<const unsigned char*>(header.data()) + prefix.size(),
                     header.size() - prefix.size(), nullptr, 0);
  crypto_generichash(b, sizeof(b), reinterpret_cast<const unsigned char*>(token.data()),
                     token.size(), nullptr, 0);
  return sodium_memcmp(a, b, sizeof(a)) == 0;
}

HttpServer::HttpServer(HttpServerConfig config)
    : config_(std::move(config)), server_(std::make_unique<Server>(config_)) {
  server_->set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    const double ms =
        std::chrono::duration<double, std::milli>(Clock::now() - Server::request_start()).count();
    if (config_.metrics) {
      // Known routes only: a label per unknown path would let clients grow the series.
      const std::string route = routes_.count(req.path) != 0 ? req.path : "other";
      config_.metrics->requests.with({config_.metrics_name, route, std::to_string(res.status)})
          .inc();
      config_.metrics->duration.with({config_.metrics_name, route}).observe(ms / 1000);
    }
    std::string id = res.get_header_value("X-Request-Id");
    if (id.empty()) id = req.get_header_value("X-Request-Id");
    if (!printable_id(id)) id = "-";
    // A proxy in front names the client's own id too: one id follows a request through the
    // proxy's line and both engines'.
    if (const std::string client = req.get_header_value("X-Client-Request-Id");
        printable_id(client)) {
      id += " client=" + client;
    }
    // Scrapes and probes come every few seconds: their lines only at debug level, unless
    // they fail.
    const bool routine = (req.path == "/metrics" || req.path == "/health") && res.status < 400;
    log::logger().log(config_.access_log && !routine ? spdlog::level::info : spdlog::level::debug,
                      "{}: {} {} {} {} {:.1f} ms", config_.name, id, req.method, req.path,
                      res.status, ms);
  });
  server_->set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    // A route asked for with a method it does not take: 405, naming those it takes.
    if (auto route = methods_.find(req.path);
        route != methods_.end() && route->second.count(req.method) == 0 &&
        !(req.method == "HEAD" && route->second.count("GET"))) {
      std::string allow;
      for (const auto& m : route->second) allow += (allow.empty() ? "" : ", ") + m;
      set_api_error(res, 405, req.method + " " + req.path + " is not served; it takes " + allow);
      res.set_header("Allow", allow);
      res.set_header("Connection", "close");
      close_connection_after_response();  // its body, if any, was not read
      return httplib::Server::HandlerResponse::Handled;
    }
    auto key = key_of_path_.find(req.path);
    if (key != key_of_path_.end() &&
        !token_matches(req.get_header_value("Authorization"), *key->second)) {
      set_api_error(res, 401,
                    key->second == &config_.api_key
                        ? "a valid API key is required (Authorization: Bearer <key>)"
                        : "a valid Authorization: Bearer token is required",
                    "", "invalid_api_key");
      res.set_header("WWW-Authenticate", "Bearer");
      res.set_header("Connection", "close");
      close_connection_after_response();  // its body, if any, was not read
      return httplib::Server::HandlerResponse::Handled;
    }
    if (req.has_header("Content-Length") &&
        req.get_header_value<uint64_t>("Content-Length") > config_.max_body_bytes) {
      set_api_error(res, 413,
                    "the body is larger than " + std::to_string(config_.max_body_bytes) + " bytes");
      res.set_header("Connection", "close");
      close_connection_after_response();
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
}

HttpServer::~HttpServer() {
  stop();
}

void HttpServer::require(const std::string& path, const std::string& method, Auth auth) {
  routes_.insert(path);
  methods_[path].insert(method);
  const std::string* secret = auth == Auth::kToken    ? &config_.token
                              : auth == Auth::kApiKey ? &config_.api_key
                                                      : nullptr;
  if (secret && !secret->empty()) key_of_path_[path] = secret;
}

void HttpServer::post(const std::string& path, Auth auth, Handler handler) {
  require(path, "POST", auth);
  const size_t max = config_.max_body_bytes;
  server_->Post(path, [max, handler = std::move(handler)](const httplib::Request& req,
                                                          httplib::Response& res,
                                                          const httplib::ContentReader& read) {
    // The body is read here, counted whatever its framing (a chunked or unframed body has
    // no Content-Length for httplib to check).
    std::string body;
    bool too_large = false;
    // A request with neither a length nor chunks has no body (RFC 9112 6.3): httplib would
    // read one until the client closes.
    const bool framed = req.has_header("Content-Length") || req.has_header("Transfer-Encoding");
    const bool ok = !framed || read([&](const char* data, size_t n) {
      if (n > max - body.size()) {
        too_large = true;
        return false;
      }
      body.append(data, n);
      return true;
    });
    if (too_large || !ok) {
      close_connection_after_response();
      res.set_header("Connection", "close");
      if (too_large) {
        return set_api_error(res, 413, "the body is larger than " + std::to_string(max) + " bytes");
      }
      return set_api_error(res, 400, "the body could not be read");
    }
    httplib::Request with_body = req;
    with_body.body = std::move(body);
    handler(with_body, res);
  });
}

void HttpServer::get(const std::string& path, Auth auth, Handler handler) {
  require(path, "GET", auth);
  server_->Get(path, std::move(handler));
}

Status HttpServer::start() {
  const std::string where = config_.host + ":" + std::to_string(config_.port);
  errno = 0;
  port_ = config_.port == 0
              ? server_->bind_to_any_port(config_.host)
              : (server_->bind_to_port(config_.host, config_.port) ? config_.port : -1);
  if (port_ <= 0) {
    const int err = errno;
    std::string why = err == EADDRINUSE ? "address in use" : std::strerror(err);
    return unreachable("cannot listen on " + where + " for the " + config_.name + ": " + why);
  }
  if (!server_->set_backlog(config_.backlog)) {
    server_->stop();
    return unreachable("cannot set the listen backlog on " + where + ": " + std::strerror(errno));
  }
  thread_ = std::thread([this] { server_->listen_after_bind(); });
  // stop() only stops a server whose accept loop runs: wait for it (bounded).
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  while (!server_->is_running() && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!server_->is_running()) {
    stop();
    return unreachable("the " + config_.name + " on " + where + " did not start accepting");
  }
  return Status::ok();
}

void HttpServer::stop(std::chrono::milliseconds grace) {
  if (!thread_.joinable()) return;
  server_->stop();  // no new connections
  server_->wait_for_idle(grace);
  server_->wake_all();
  thread_.join();
}

uint64_t HttpServer::rejected_connections() const {
  return server_->rejected();
}

}  // namespace rd2h::http