#include "util/http_server.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sodium.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <vector>

#include "util/log.h"
#include "util/thread_pool.h"

namespace rd2h::metaserver {

namespace {

using Clock = std::chrono::steady_clock;

thread_local bool t_reject = false;  // the connection being handed over is beyond the bound
thread_local bool t_close = false;   // close the connection after the current answer
thread_local int t_sock = -1;        // the connection this thread serves
thread_local Clock::time_point t_request_start;  // when the current request began to arrive

void set_error(httplib::Response& res, int code, const std::string& message) {
  set_api_error(res, code, message);
}

// One thread per connection (from a pool started on demand up to `max`, joined at
// shutdown). A task that no thread can take at once is not queued: it runs here, marked as
// rejected, and the server closes its connection.
class ConnectionThreads final : public httplib::TaskQueue {
 public:
  explicit ConnectionThreads(size_t max) : pool_(max) {}
  ~ConnectionThreads() override { shutdown(); }

  void enqueue(std::function<void()> fn) override {
    if (pool_.try_run(fn)) return;
    t_reject = true;
    fn();
    t_reject = false;
  }
  void shutdown() override { pool_.stop(); }

 private:
  ThreadPool pool_;
};

}  // namespace

// httplib's server with rd2h's connection handling: its own keep-alive loop and stream, so
// that every wait has a deadline and stop() wakes every connection.
class HttpServer::Server final : public httplib::Server {
 public:
  explicit Server(const HttpServerConfig& config) : config_(config) {
    if (::pipe2(wake_, O_CLOEXEC) != 0) wake_[0] = wake_[1] = -1;
    new_task_queue = [this] { return new ConnectionThreads(config_.max_connections); };
  }
  ~Server() override {
    for (int fd : wake_) {
      if (fd >= 0) ::close(fd);
    }
  }

  // Stops the accept loop and wakes every connection (they see the wake pipe readable).
  void wake_all() {
    stopping_ = true;
    if (wake_[1] >= 0) {
      const char b = 1;
      [[maybe_unused]] ssize_t n = ::write(wake_[1], &b, 1);
    }
  }
  // httplib listens with a backlog of 5; Linux takes a new one from a second listen().
  bool set_backlog(int backlog) { return ::listen(svr_sock_, backlog) == 0; }
  uint64_t rejected() const { return rejected_; }
  // Waits (bounded) until no request is being handled or answered.
  void wait_for_idle(std::chrono::milliseconds bound) {
    std::unique_lock lock(active_mu_);
    active_cv_.wait_for(lock, bound, [this] { return active_ == 0; });
  }
  void begin_active() {
    std::lock_guard lock(active_mu_);
    ++active_;
  }
  void end_active() {
    {
      std::lock_guard lock(active_mu_);
      --active_;
    }
    active_cv_.notify_all();
  }

 private:
  class Connection;

  bool process_and_close_socket(socket_t sock) override;

  // Waits until `sock` has `events` or until `deadline`; false on the deadline or stop.
  bool wait(int sock, short events, Clock::time_point deadline) const {
    for (;;) {
      if (stopping_) return false;
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return false;
      pollfd fds[2] = {{sock, events, 0}, {wake_[0], POLLIN, 0}};
      const int n = ::poll(fds, wake_[0] >= 0 ? 2 : 1,
                           static_cast<int>(std::min<long long>(left, 1000 * 60 * 60)));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return false;
      if (n == 0) continue;  // re-checks the deadline
      if (fds[1].revents != 0) return false;
      return fds[0].revents != 0;
    }
  }

  const HttpServerConfig& config_;
  int wake_[2] = {-1, -1};
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> rejected_{0};
  std::mutex active_mu_;
  std::condition_variable active_cv_;
  size_t active_ = 0;  // requests being handled or answered
};

// A connection's byte stream for httplib's request parser: reads are buffered and bounded
// by the current request's deadline, writes by the write timeout.
class HttpServer::Server::Connection final : public httplib::Stream {
 public:
  Connection(const Server& server, int sock) : server_(server), sock_(sock) {}

  void begin_request() { deadline_ = Clock::now() + server_.config_.request_timeout; }
  bool wait_for_request() const {
    return size_ > pos_ ||
           server_.wait(sock_, POLLIN, Clock::now() + server_.config_.keep_alive_timeout);
  }

  bool is_readable() const override {
    return size_ > pos_ || server_.wait(sock_, POLLIN, deadline_);
  }
  bool is_writable() const override {
    if (!server_.wait(sock_, POLLOUT, Clock::now() + server_.config_.write_timeout)) return false;
    char b;  // a peer that closed reads as end of stream
    return ::recv(sock_, &b, 1, MSG_PEEK | MSG_DONTWAIT) != 0;
  }
  ssize_t read(char* ptr, size_t size) override {
    if (pos_ == size_) {
      if (!is_readable()) return -1;
      ssize_t n;
      do {
        n = ::recv(sock_, buffer_, sizeof(buffer_), 0);
      } while (n < 0 && errno == EINTR);
      if (n <= 0) return n;
      pos_ = 0;
      size_ = static_cast<size_t>(n);
    }
    const size_t n = std::min(size, size_ - pos_);
    std::memcpy(ptr, buffer_ + pos_, n);
    pos_ += n;
    return static_cast<ssize_t>(n);
  }
  ssize_t write(const char* ptr, size_t size) override {
    if (!server_.wait(sock_, POLLOUT, Clock::now() + server_.config_.write_timeout)) return -1;
    ssize_t n;
    do {
      n = ::send(sock_, ptr, size, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    return n;
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    address(::getpeername, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    address(::getsockname, ip, port);
  }
  socket_t socket() const override { return sock_; }

 private:
  template <typename F>
  void address(F get, std::string& ip, int& port) const {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    if (get(sock_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return;
    char host[NI_MAXHOST], serv[NI_MAXSERV];
    if (::getnameinfo(reinterpret_cast<sockaddr*>(&addr), len, host, sizeof(host), serv,
                      sizeof(serv), NI_NUMERICHOST | NI_NUMERICSERV) == 0) {
      ip = host;
      port = std::atoi(serv);
    }
  }

  const Server& server_;
  int sock_;
  Clock::time_point deadline_ = Clock::now();
  char buffer_[4096];
  size_t pos_ = 0, size_ = 0;
};

bool HttpServer::Server::process_and_close_socket(socket_t sock) {
  bool ret = false;
  if (t_reject) {
    ++rejected_;
    static const std::string busy = [] {
      const std::string body = api_error_json(503,
                                              "the server is serving as many connections as "
                                              "it may; try again later");
      return "HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Type: "
             "application/json\r\nContent-Length: " +
             std::to_string(body.size()) + "\r\n\r\n" + body;
    }();
    [[maybe_unused]] ssize_t n =
        ::send(sock, busy.data(), busy.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  } else {
    Connection conn(*this, sock);
    t_sock = sock;
    for (size_t count = std::max<size_t>(1, config_.keep_alive_max_count); count > 0; --count) {
      if (!conn.wait_for_request()) break;
      t_request_start = Clock::now();
      conn.begin_request();
      bool closed = false;
      t_close = false;
      if (config_.metrics) config_.metrics->in_flight.with({config_.metrics_name}).add(1);
      begin_active();
      ret = process_request(conn, count == 1, closed, nullptr);
      end_active();
      if (config_.metrics) config_.metrics->in_flight.with({config_.metrics_name}).add(-1);
      if (!ret || closed || t_close) break;
    }
    if (t_close) {
      // The answer went out with a body left unread: end our side, then read a little of
      // what the client still sends (bounded) before closing, so that closing on unread
      // bytes (a reset) does not destroy the answer before the client reads it.
      ::shutdown(sock, SHUT_WR);
      const auto until = Clock::now() + std::chrono::seconds(1);
      char sink[16384];
      for (size_t drained = 0; drained < (1u << 20) && wait(sock, POLLIN, until);) {
        const ssize_t n = ::recv(sock, sink, sizeof(sink), 0);
        if (n <= 0) break;
        drained += static_cast<size_t>(n);
      }
    }
  }
  t_sock = -1;
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
  return ret;
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

void close_connection_after_response() {
  t_close = true;
}

bool client_gone() {
  if (t_sock < 0) return false;
  pollfd fd{t_sock, POLLIN | POLLRDHUP, 0};
  if (::poll(&fd, 1, 0) <= 0) return false;
  if ((fd.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) return true;
  // Bytes waiting (a pipelined request) are no sign; the end of the stream is.
  char byte;
  return ::recv(t_sock, &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

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
  server_->set_payload_max_length(config_.max_body_bytes);
  server_->set_keep_alive_timeout(std::max<time_t>(
      1, std::chrono::duration_cast<std::chrono::seconds>(config_.keep_alive_timeout).count()));
  server_->set_keep_alive_max_count(std::max<size_t>(1, config_.keep_alive_max_count));
  // SO_REUSEADDR only: httplib's default adds SO_REUSEPORT, which lets a second process
  // bind the same port and take half of its connections.
  server_->set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  server_->set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown exception";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        set_error(res, 500, "internal error: " + what);
      });
  server_->set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    const double ms =
        std::chrono::duration<double, std::milli>(Clock::now() - t_request_start).count();
    if (config_.metrics) {
      // Known routes only: a label per unknown path would let clients grow the series.
      const std::string route = routes_.count(req.path) != 0 ? req.path : "other";
      config_.metrics->requests.with({config_.metrics_name, route, std::to_string(res.status)})
          .inc();
      config_.metrics->duration.with({config_.metrics_name, route}).observe(ms / 1000);
    }
    std::string id = res.get_header_value("X-Request-Id");
    if (id.empty()) id = req.get_header_value("X-Request-Id");
    log::logger().log(config_.access_log ? spdlog::level::info : spdlog::level::debug,
                      "{}: {} {} {} {} {:.1f} ms", config_.name, id.empty() ? "-" : id, req.method,
                      req.path, res.status, ms);
  });
  // Errors without a body of their own (an unknown route, a wrong method) get one too.
  server_->set_error_handler(
      httplib::Server::HandlerWithResponse([](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
        set_api_error(res, res.status,
                      res.status == 404 ? "no route " + req.method + " " + req.path
                                        : "HTTP " + std::to_string(res.status));
        return httplib::Server::HandlerResponse::Handled;
      }));
  server_->set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
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
      set_error(res, 413,
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

void HttpServer::require(const std::string& path, Auth auth) {
  routes_.insert(path);
  const std::string* secret = auth == Auth::kToken    ? &config_.token
                              : auth == Auth::kApiKey ? &config_.api_key
                                                      : nullptr;
  if (secret && !secret->empty()) key_of_path_[path] = secret;
}

void HttpServer::post(const std::string& path, Auth auth, Handler handler) {
  require(path, auth);
  const size_t max = config_.max_body_bytes;
  server_->Post(
      path, [max, handler = std::move(handler)](const httplib::Request& req, httplib::Response& res,
                                                const httplib::ContentReader& read) {
        // The body is read here, counted whatever its framing (a chunked or unframed body has
        // no Content-Length for httplib to check).
        std::string body;
        bool too_large = false;
        const bool ok = read([&](const char* data, size_t n) {
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
            return set_error(res, 413, "the body is larger than " + std::to_string(max) + " bytes");
          }
          return set_error(res, 400, "the body could not be read");
        }
        httplib::Request with_body = req;
        with_body.body = std::move(body);
        handler(with_body, res);
      });
}

void HttpServer::get(const std::string& path, Auth auth, Handler handler) {
  require(path, auth);
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

}  // namespace rd2h::metaserver
