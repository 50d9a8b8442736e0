// HttpServer's connection handling and limits: a thread per connection up to the bound (a
// 503 beyond it), the keep-alive loop, and a stream whose every wait has a deadline.
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <string>

#include "util/http_server_impl.h"
#include "util/thread_pool.h"

namespace rd2h::http {

namespace {

using Clock = HttpServer::Server::Clock;

thread_local bool t_reject = false;  // the connection being handed over is beyond the bound
thread_local bool t_close = false;   // close the connection after the current answer
thread_local int t_sock = -1;        // the connection this thread serves
thread_local Clock::time_point t_request_start;  // when the current request began to arrive

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

HttpServer::Server::Server(const HttpServerConfig& config) : config_(config) {
  if (int wake[2]; ::pipe2(wake, O_CLOEXEC) == 0) {
    wake_read_.reset(wake[0]);
    wake_write_.reset(wake[1]);
  }
  new_task_queue = [this] { return new ConnectionThreads(config_.max_connections); };
  set_payload_max_length(config_.max_body_bytes);
  set_keep_alive_timeout(std::max<time_t>(
      1, std::chrono::duration_cast<std::chrono::seconds>(config_.keep_alive_timeout).count()));
  set_keep_alive_max_count(std::max<size_t>(1, config_.keep_alive_max_count));
  // SO_REUSEADDR only: httplib's default adds SO_REUSEPORT, which lets a second process
  // bind the same port and take half of its connections.
  set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown exception";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    set_api_error(res, 500, "internal error: " + what);
  });
  // Errors without a body of their own (an unknown route, a wrong method) get one too.
  set_error_handler(
      httplib::Server::HandlerWithResponse([](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
        set_api_error(res, res.status,
                      res.status == 404 ? "no route " + req.method + " " + req.path
                                        : "HTTP " + std::to_string(res.status));
        return httplib::Server::HandlerResponse::Handled;
      }));
}

HttpServer::Server::~Server() = default;

void HttpServer::Server::wake_all() {
  stopping_ = true;
  if (wake_write_.valid()) {
    const char b = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_write_.get(), &b, 1);
  }
}

bool HttpServer::Server::set_backlog(int backlog) {
  return ::listen(svr_sock_, backlog) == 0;
}

HttpServer::Server::Clock::time_point HttpServer::Server::request_start() {
  return t_request_start;
}

bool HttpServer::Server::wait(int sock, short events, Clock::time_point deadline) const {
  for (;;) {
    if (stopping_) return false;
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd fds[2] = {{sock, events, 0}, {wake_read_.get(), POLLIN, 0}};
    const int n = ::poll(fds, wake_read_.valid() ? 2 : 1,
                         static_cast<int>(std::min<long long>(left, 1000 * 60 * 60)));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return false;
    if (n == 0) continue;  // re-checks the deadline
    if (fds[1].revents != 0) return false;
    return fds[0].revents != 0;
  }
}

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

}  // namespace rd2h::http
