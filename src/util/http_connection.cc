// HttpServer's connection handling and limits: a thread per connection up to the bound (a
// 503 beyond it), the keep-alive loop, and a stream whose every wait has a deadline.
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "util/http_server_impl.h"
#include "util/thread_pool.h"

namespace rd2h::http {

namespace {

using Clock = HttpServer::Server::Clock;

thread_local bool t_close = false;   // close the connection after the current answer
thread_local int t_sock = -1;        // the connection this thread serves
thread_local Clock::time_point t_request_start;  // when the current request began to arrive

// The end of a request's head, and the most a head may take.
constexpr std::string_view kEndOfHead = "\r\n\r\n";
constexpr size_t kMaxHeadBytes = 64 * 1024;
// The longest chunk-size line of a chunked body that is waited for (hex digits and
// extensions); a longer one goes to httplib's parser, which refuses it.
constexpr size_t kMaxChunkLine = 1024;
// Threads kept for what must be served while every connection thread is busy: /health and
// requests carrying the server's token (rendezvous posts, the proxy's calls).
constexpr size_t kReserveThreads = 8;

}  // namespace

// What serves the listener's connections. A connection holds no thread while its request is
// arriving: one thread waits on all of them (poll), gives each head `header_timeout` to
// arrive whole (and an idle keep-alive connection `keep_alive_timeout` to begin the next),
// then reads its body (Content-Length or chunked, up to `max_body_bytes`; the whole request
// within `request_timeout`), and only then hands the connection to a thread of the pool.
// Slow or idle clients therefore cost a socket and what they sent, not one of the
// `max_connections` threads; what all waiting connections sent is bounded by
// `max_waiting_bytes` (past it, the longest waiting are closed). A request that finds every
// thread busy is answered 503 and closed, unless it is for /health or carries the server's
// token (then a reserve thread serves it). A request whose framing is unclear (a bad
// Content-Length, a body over the limit) goes to a thread at once, for httplib to refuse.
class HttpServer::Server::Connections final : public httplib::TaskQueue {
 public:
  explicit Connections(Server& server)
      : server_(server), pool_(server.config_.max_connections), reserve_(kReserveThreads) {
    if (int fds[2]; ::pipe2(fds, O_CLOEXEC | O_NONBLOCK) == 0) {
      wake_read_.reset(fds[0]);
      wake_write_.reset(fds[1]);
    }
    gatherer_ = std::thread([this] { gather(); });
  }
  ~Connections() override { shutdown(); }

  // Runs the accept loop's job here: process_and_close_socket hands the new connection to
  // the gatherer (t_connections says so) and returns at once.
  void enqueue(std::function<void()> fn) override {
    t_connections = this;
    fn();
    t_connections = nullptr;
  }
  void shutdown() override {
    {
      std::lock_guard lock(mu_);
      if (stopped_) return;
      stopped_ = true;
    }
    wake();
    if (gatherer_.joinable()) gatherer_.join();
    pool_.stop();
    reserve_.stop();
  }

  // A connection whose next request's head is awaited (`requests_left` more may come on
  // it); closed if the gatherer stopped.
  void add(int sock, bool fresh, size_t requests_left) {
    {
      std::lock_guard lock(mu_);
      if (!stopped_) {
        inbox_.push_back({sock, fresh, requests_left});
        sock = -1;
      }
    }
    if (sock >= 0) {
      ::shutdown(sock, SHUT_RDWR);
      ::close(sock);
      return;
    }
    wake();
  }

  static thread_local Connections* t_connections;

 private:
  struct Arrival {
    int sock;
    bool fresh;
    size_t requests_left;
  };
  struct Waiting {
    int sock = -1;
    std::string peer;  // the client's address
    size_t requests_left = 0;
    Clock::time_point deadline;  // for the head (or, idle, for its first byte)
    bool begun = false;          // a byte of the head arrived
    Clock::time_point started;   // when
    std::string head;            // what arrived: the head, then the body
    // Once the head is whole: where it ends, and how the body is framed.
    size_t head_end = std::string::npos;
    bool whole = false;    // the request arrived (or its framing is for httplib to judge)
    size_t need = 0;       // Content-Length: the bytes of head and body together
    bool chunked = false;  // chunked: where the scan is, and the bytes of chunk data left
    size_t scan = 0;
    size_t chunk_left = 0;
    bool trailers = false;
    size_t body_bytes = 0;
  };

  void wake() {
    if (!wake_write_.valid()) return;
    const char b = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_write_.get(), &b, 1);
  }

  void gather();
  // Reads what `w`'s socket has; false if the connection is to be closed (its end, an
  // error, a head too large).
  bool take(Waiting& w);
  // Once `w`'s head is whole: how its body is framed (and a 100 Continue if it asks).
  void frame(Waiting& w);
  // Whether `w`'s chunked body arrived whole, scanning what came since the last call.
  bool chunks_arrived(Waiting& w) const;
  void dispatch(Waiting w);
  bool reserved(const std::string& head) const;
  // The client address of `sock` (empty if unknown).
  static std::string peer_of(int sock) {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    char host[NI_MAXHOST];
    if (::getpeername(sock, reinterpret_cast<sockaddr*>(&addr), &len) != 0 ||
        ::getnameinfo(reinterpret_cast<sockaddr*>(&addr), len, host, sizeof(host), nullptr, 0,
                      NI_NUMERICHOST) != 0) {
      return {};
    }
    return host;
  }
  static void close(int sock) {
    ::shutdown(sock, SHUT_RDWR);
    ::close(sock);
  }

  Server& server_;
  ThreadPool pool_, reserve_;
  UniqueFd wake_read_, wake_write_;
  std::mutex mu_;
  std::vector<Arrival> inbox_;  // guarded by mu_
  bool stopped_ = false;        // guarded by mu_
  std::thread gatherer_;
};

thread_local HttpServer::Server::Connections* HttpServer::Server::Connections::t_connections =
    nullptr;

HttpServer::Server::Server(const HttpServerConfig& config) : config_(config) {
  if (int wake[2]; ::pipe2(wake, O_CLOEXEC) == 0) {
    wake_read_.reset(wake[0]);
    wake_write_.reset(wake[1]);
  }
  new_task_queue = [this] { return new Connections(*this); };
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
  // `head`: what already arrived of the first request (its whole head, maybe more).
  Connection(const Server& server, int sock, std::string head)
      : server_(server), sock_(sock), head_(std::move(head)) {}

  // The request that began to arrive at `start` must be whole within request_timeout.
  void begin_request(Clock::time_point start) {
    deadline_ = start + server_.config_.request_timeout;
  }
  // Bytes of a next request already read (a pipelined request).
  bool buffered() const { return head_pos_ < head_.size() || size_ > pos_; }

  bool is_readable() const override { return buffered() || server_.wait(sock_, POLLIN, deadline_); }
  bool is_writable() const override {
    if (!server_.wait(sock_, POLLOUT, Clock::now() + server_.config_.write_timeout)) return false;
    char b;  // a peer that closed reads as end of stream
    return ::recv(sock_, &b, 1, MSG_PEEK | MSG_DONTWAIT) != 0;
  }
  ssize_t read(char* ptr, size_t size) override {
    if (head_pos_ < head_.size()) {
      const size_t n = std::min(size, head_.size() - head_pos_);
      std::memcpy(ptr, head_.data() + head_pos_, n);
      head_pos_ += n;
      if (head_pos_ == head_.size()) {
        std::string().swap(head_);
        head_pos_ = 0;
      }
      return static_cast<ssize_t>(n);
    }
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
  std::string head_;  // read by the gatherer, served first
  size_t head_pos_ = 0;
  Clock::time_point deadline_ = Clock::now();
  char buffer_[4096];
  size_t pos_ = 0, size_ = 0;
};

bool HttpServer::Server::process_and_close_socket(socket_t sock) {
  // Called on the accept loop: the connection waits for its head without a thread.
  if (Connections::t_connections != nullptr) {
    Connections::t_connections->add(sock, /*fresh=*/true, config_.keep_alive_max_count);
    return true;
  }
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
  return false;
}

void HttpServer::Server::reject(int sock) {
  ++rejected_;
  static const std::string busy = [] {
    const std::string body = api_error_json(503,
                                            "the server is serving as many connections as "
                                            "it may; try again later");
    return "HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Type: "
           "application/json\r\nContent-Length: " +
           std::to_string(body.size()) + "\r\n\r\n" + body;
  }();
  [[maybe_unused]] ssize_t n = ::send(sock, busy.data(), busy.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
}

void HttpServer::Server::serve(Connections& from, int sock, std::string head,
                               Clock::time_point started, size_t requests_left) {
  Connection conn(*this, sock, std::move(head));
  t_sock = sock;
  bool keep = false;
  for (; requests_left > 0; --requests_left) {
    t_request_start = started;
    conn.begin_request(started);
    bool closed = false;
    t_close = false;
    if (config_.metrics) config_.metrics->in_flight.with({config_.metrics_name}).add(1);
    begin_active();
    const bool ok = process_request(conn, requests_left == 1, closed, nullptr);
    end_active();
    if (config_.metrics) config_.metrics->in_flight.with({config_.metrics_name}).add(-1);
    if (!ok || closed || t_close || requests_left == 1 || stopping_) break;
    if (!conn.buffered()) {
      // Idle until the next request: the connection waits without this thread.
      keep = true;
      --requests_left;
      break;
    }
    started = Clock::now();  // a pipelined request, already here
  }
  t_sock = -1;
  if (keep) return from.add(sock, /*fresh=*/false, requests_left);
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
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
}

void HttpServer::Server::Connections::gather() {
  const auto& config = server_.config_;
  std::vector<Waiting> waiting;
  std::vector<pollfd> fds;
  std::vector<Arrival> arrived;
  for (;;) {
    {
      std::lock_guard lock(mu_);
      if (stopped_) break;
      arrived.swap(inbox_);
    }
    if (!arrived.empty()) {
      const auto now = Clock::now();
      std::map<std::string, size_t> per_client;
      for (const Waiting& w : waiting) ++per_client[w.peer];
      for (const Arrival& a : arrived) {
        Waiting w;
        w.sock = a.sock;
        w.peer = peer_of(a.sock);
        w.requests_left = a.requests_left;
        // A new connection's head is due from its first byte on; an idle one's first.
        w.deadline = now + (a.fresh ? config.header_timeout : config.keep_alive_timeout);
        if (++per_client[w.peer] > config.max_waiting_per_client) {
          // That client's longest waiting connection makes room.
          auto oldest = std::find_if(waiting.begin(), waiting.end(),
                                     [&](const Waiting& o) { return o.peer == w.peer; });
          if (oldest != waiting.end()) {
            close(oldest->sock);
            waiting.erase(oldest);
            --per_client[w.peer];
          }
        }
        waiting.push_back(std::move(w));
      }
      arrived.clear();
    }
    // Past the bounds, the connections waiting longest make room.
    while (waiting.size() > config.max_waiting_connections) {
      close(waiting.front().sock);
      waiting.erase(waiting.begin());
    }
    // (The bound always has room for one whole request.)
    const size_t max_bytes =
        std::max(config.max_waiting_bytes, config.max_body_bytes + 2 * kMaxHeadBytes);
    size_t buffered = 0;
    for (const Waiting& w : waiting) buffered += w.head.capacity();
    while (buffered > max_bytes && !waiting.empty()) {
      buffered -= waiting.front().head.capacity();
      close(waiting.front().sock);
      waiting.erase(waiting.begin());
    }
    fds.assign(1, pollfd{wake_read_.get(), POLLIN, 0});
    auto next = Clock::now() + std::chrono::seconds(1);
    for (const Waiting& w : waiting) {
      fds.push_back({w.sock, POLLIN, 0});
      next = std::min(next, w.deadline);
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now());
    const int n =
        ::poll(fds.data(), fds.size(), static_cast<int>(std::max<long long>(0, left.count())));
    if (n < 0 && errno != EINTR) break;
    if (fds[0].revents != 0) {
      char drain[64];
      while (::read(wake_read_.get(), drain, sizeof(drain)) > 0) {
      }
    }
    const auto now = Clock::now();
    std::vector<Waiting> still;
    still.reserve(waiting.size());
    for (size_t i = 0; i < waiting.size(); ++i) {
      Waiting& w = waiting[i];
      if (n > 0 && fds[i + 1].revents != 0) {
        if (!take(w)) {
          close(w.sock);
          continue;
        }
        if (w.whole) {
          dispatch(std::move(w));
          continue;
        }
      }
      if (now >= w.deadline) {
        close(w.sock);  // a request that did not arrive in time, or an idle connection
        continue;
      }
      still.push_back(std::move(w));
    }
    waiting.swap(still);
  }
  for (const Waiting& w : waiting) close(w.sock);
  std::lock_guard lock(mu_);
  for (const Arrival& a : inbox_) close(a.sock);
  inbox_.clear();
}

bool HttpServer::Server::Connections::take(Waiting& w) {
  char buffer[16384];
  const ssize_t n = ::recv(w.sock, buffer, sizeof(buffer), MSG_DONTWAIT);
  if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
  if (n == 0) return false;  // the client closed
  if (!w.begun) {
    // The head's time runs from its first byte.
    w.begun = true;
    w.started = Clock::now();
    w.deadline = w.started + server_.config_.header_timeout;
  }
  const size_t had = w.head.size();
  if (w.need > 0 && w.head.size() + static_cast<size_t>(n) > w.head.capacity()) {
    // A declared length: the buffer grows to it, not past it.
    w.head.reserve(std::min(w.need, std::max(w.head.capacity() * 2, had + n)));
  }
  w.head.append(buffer, static_cast<size_t>(n));
  if (w.head_end == std::string::npos) {
    const size_t end = w.head.find(kEndOfHead, had >= 3 ? had - 3 : 0);
    if (end == std::string::npos) return w.head.size() <= kMaxHeadBytes;
    w.head_end = end + kEndOfHead.size();
    frame(w);
  }
  if (!w.whole) w.whole = w.chunked ? chunks_arrived(w) : w.head.size() >= w.need;
  return true;
}

namespace {

// `head`'s header `name` (case-insensitive), if it has one: its value, and where its line
// begins (at its CRLF) and ends (before the next CRLF).
struct HeaderLine {
  std::string_view value;
  size_t begin = 0, end = 0;
};
std::optional<HeaderLine> header_line(std::string_view head, std::string_view name) {
  const size_t end = head.find(kEndOfHead);
  for (size_t at = head.find("\r\n"); at != std::string_view::npos && at < end;) {
    const size_t next = head.find("\r\n", at + 2);
    const std::string_view line = head.substr(at + 2, next - at - 2);
    const size_t begin = at;
    at = next;
    const size_t colon = line.find(':');
    if (colon != name.size() || strncasecmp(line.data(), name.data(), colon) != 0) continue;
    std::string_view value = line.substr(colon + 1);
    while (!value.empty() && (value.front() == ' ' || value.front() == '\t'))
      value.remove_prefix(1);
    while (!value.empty() && (value.back() == ' ' || value.back() == '\t')) value.remove_suffix(1);
    return HeaderLine{value, begin, next};
  }
  return std::nullopt;
}
std::optional<std::string_view> header_value(std::string_view head, std::string_view name) {
  if (auto line = header_line(head, name)) return line->value;
  return std::nullopt;
}

bool equals_nocase(std::string_view a, std::string_view b) {
  return a.size() == b.size() && strncasecmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace

void HttpServer::Server::Connections::frame(Waiting& w) {
  const std::string_view head(w.head.data(), w.head_end);
  const size_t limit = server_.config_.max_body_bytes;
  if (auto te = header_value(head, "Transfer-Encoding")) {
    if (!equals_nocase(*te, "chunked")) {
      w.whole = true;  // a coding httplib refuses
      return;
    }
    w.chunked = true;
    w.scan = w.head_end;
  } else if (auto cl = header_value(head, "Content-Length")) {
    size_t length = 0;
    const auto [end, ec] = std::from_chars(cl->data(), cl->data() + cl->size(), length);
    if (ec != std::errc() || end != cl->data() + cl->size() || length > limit) {
      w.whole = true;  // for httplib to answer (400, 413)
      return;
    }
    w.need = w.head_end + length;
  } else {
    w.need = w.head_end;
  }
  // The whole request is due within request_timeout of its first byte.
  w.deadline = w.started + server_.config_.request_timeout;
  const auto expect = header_line(head, "Expect");
  if (expect && equals_nocase(expect->value, "100-continue") &&
      !(w.chunked ? chunks_arrived(w) : w.head.size() >= w.need)) {
    // The client waits for leave to send its body: given here, and the header dropped so
    // that httplib does not give it again.
    static constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
    [[maybe_unused]] ssize_t n =
        ::send(w.sock, kContinue.data(), kContinue.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    const size_t erased = expect->end - expect->begin;
    w.head.erase(expect->begin, erased);
    w.head_end -= erased;
    if (w.need > 0) w.need -= erased;
    if (w.chunked) w.scan -= erased;
  }
}

bool HttpServer::Server::Connections::chunks_arrived(Waiting& w) const {
  const size_t limit = server_.config_.max_body_bytes;
  for (;;) {
    if (w.chunk_left > 0) {  // chunk data and its CRLF
      const size_t have = std::min(w.chunk_left, w.head.size() - w.scan);
      w.scan += have;
      w.chunk_left -= have;
      if (w.chunk_left > 0) return false;
    }
    if (w.trailers) {  // after the last chunk: trailer lines up to an empty one
      if (w.head.size() - w.scan < 2) return false;
      if (w.head.compare(w.scan, 2, "\r\n") == 0) return true;
      return w.head.find(kEndOfHead, w.scan) != std::string::npos;
    }
    const size_t eol = w.head.find("\r\n", w.scan);
    if (eol == std::string::npos) return w.head.size() - w.scan > kMaxChunkLine;
    size_t size = 0;
    const char* digits = w.head.data() + w.scan;
    const auto [end, ec] = std::from_chars(digits, w.head.data() + eol, size, 16);
    if (ec != std::errc() || end == digits ||
        (end != w.head.data() + eol && *end != ';' && *end != ' ' && *end != '\t')) {
      return true;  // a bad chunk line, for httplib to refuse
    }
    w.body_bytes += size;
    if (w.body_bytes > limit) return true;  // for httplib to answer 413
    w.scan = eol + 2;
    if (size == 0) {
      w.trailers = true;
    } else {
      w.chunk_left = size + 2;
    }
  }
}

bool HttpServer::Server::Connections::reserved(const std::string& head) const {
  if (head.rfind("GET /health ", 0) == 0 || head.rfind("GET /health?", 0) == 0) return true;
  const std::string& token = server_.config_.token;
  if (token.empty()) return false;
  // An Authorization header carrying the token.
  const auto value = header_value(head, "Authorization");
  return value && token_matches(std::string(*value), token);
}

void HttpServer::Server::Connections::dispatch(Waiting w) {
  const bool may_reserve = reserved(w.head);
  std::function<void()> job = [this, sock = w.sock, head = std::move(w.head), started = w.started,
                               left = w.requests_left]() mutable {
    server_.serve(*this, sock, std::move(head), started, left);
  };
  if (pool_.try_run(job)) return;
  if (may_reserve && reserve_.try_run(job)) return;
  server_.reject(w.sock);
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
