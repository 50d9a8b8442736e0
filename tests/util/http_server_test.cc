// rd2h's HTTP servers under load and abuse, over real sockets on loopback: the listen
// backlog, one owner per port, idle and slow-loris connections, the connection bound, body
// limits whatever the framing, bearer tokens; and the proxy (client API and metaserver)
// behind them.
#include "util/http_server.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdio>
#include <future>
#include <mutex>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "metaserver/client.h"
#include "rd2h/metaserver/proxy.h"
#include "support/http_server.h"

namespace rd2h::http {
namespace {

using metaserver::Client;
using metaserver::ClientConfig;
using metaserver::Proxy;
using metaserver::ProxyConfig;
using nlohmann::json;
using rd2h::testing::eventually;
using namespace std::chrono_literals;

// A starved server answers after its idle or request deadlines (5 s, 30 s); a served one
// within a second, or a few under a sanitizer on a loaded machine.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr auto kAnsweredWithin = std::chrono::milliseconds(3000);
#else
constexpr auto kAnsweredWithin = std::chrono::milliseconds(1000);
#endif

// A raw TCP connection to 127.0.0.1:port (connected, or fd -1).
class RawConnection {
 public:
  explicit RawConnection(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~RawConnection() {
    if (fd_ >= 0) ::close(fd_);
  }
  RawConnection(const RawConnection&) = delete;
  RawConnection& operator=(const RawConnection&) = delete;
  bool ok() const { return fd_ >= 0; }
  bool send(const std::string& s) {
    size_t done = 0;
    while (done < s.size()) {
      const ssize_t n = ::send(fd_, s.data() + done, s.size() - done, MSG_NOSIGNAL);
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
  }
  // Everything until the server closes (or `limit` passes): what it answered.
  std::string read_until_closed(std::chrono::milliseconds limit = 10s) {
    std::string out;
    const auto deadline = std::chrono::steady_clock::now() + limit;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) {
        timed_out_ = true;
        return out;
      }
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char buf[4096];
      const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
      if (n <= 0) return out;
      out.append(buf, static_cast<size_t>(n));
    }
  }
  // What arrives first (within `limit`): one read's worth.
  std::string read_some(std::chrono::milliseconds limit = 10s) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(limit.count())) <= 0) return {};
    char buf[4096];
    const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
  }
  bool timed_out() const { return timed_out_; }

 private:
  int fd_ = -1;
  bool timed_out_ = false;
};

struct Echo {
  HttpServerConfig config;
  std::unique_ptr<HttpServer> server;
  std::atomic<int> served{0};
  std::atomic<int> holding{0};  // GET /hold requests being served
  std::mutex mu;
  std::condition_variable cv;
  bool released = false;  // guarded by mu

  explicit Echo(HttpServerConfig c) : config(std::move(c)) {
    server = std::make_unique<HttpServer>(config);
    server->post("/echo", HttpServer::Auth::kToken,
                 [this](const httplib::Request& req, httplib::Response& res) {
                   ++served;
                   res.set_content(std::to_string(req.body.size()), "text/plain");
                 });
    server->get("/open", HttpServer::Auth::kNone,
                [](const httplib::Request&, httplib::Response& res) {
                  res.set_content("open", "text/plain");
                });
    // Holds its thread until release() (or 30 s).
    server->get("/hold", HttpServer::Auth::kNone,
                [this](const httplib::Request&, httplib::Response& res) {
                  ++holding;
                  std::unique_lock lock(mu);
                  cv.wait_for(lock, 30s, [this] { return released; });
                  --holding;
                  res.set_content("held", "text/plain");
                });
    Status st = server->start();
    EXPECT_TRUE(st) << st.to_string();
  }
  ~Echo() {
    release();
    server.reset();
  }
  void release() {
    {
      std::lock_guard lock(mu);
      released = true;
    }
    cv.notify_all();
  }
  std::string origin() const { return "http://127.0.0.1:" + std::to_string(server->port()); }
};

// The backlog of the listening socket on `port`, as the kernel reports it (ss: Send-Q).
int listen_backlog(int port) {
  const std::string cmd = "ss -Hltn 'sport = :" + std::to_string(port) + "' 2>/dev/null";
  FILE* f = ::popen(cmd.c_str(), "r");
  if (f == nullptr) return -1;
  char line[512];
  int backlog = -1;
  if (std::fgets(line, sizeof(line), f) != nullptr) {
    char state[64];
    int recv_q = 0;
    if (std::sscanf(line, "%63s %d %d", state, &recv_q, &backlog) != 3) backlog = -1;
  }
  ::pclose(f);
  return backlog;
}

TEST(HttpServer, ListensWithARealBacklogAndAnswers128SimultaneousClients) {
  Echo echo(HttpServerConfig{});
  EXPECT_EQ(listen_backlog(echo.server->port()), 1024) << "httplib's own backlog is 5";
  // 128 clients connect and post at once; every one is answered.
  std::promise<void> go;
  std::shared_future<void> start = go.get_future().share();
  std::vector<std::future<int>> answers;
  for (int i = 0; i < 128; ++i) {
    answers.push_back(std::async(std::launch::async, [&, start] {
      start.wait();
      httplib::Client c(echo.origin());
      c.set_connection_timeout(10s);
      c.set_read_timeout(10s);
      auto r = c.Post("/echo", "hello", "text/plain");
      return r ? r->status : -1;
    }));
  }
  go.set_value();
  int ok = 0;
  for (auto& a : answers) ok += a.get() == 200;
  EXPECT_EQ(ok, 128);
  EXPECT_EQ(echo.served.load(), 128);
}

TEST(HttpServer, ASecondServerOnAPortInUseFailsWithAddressInUse) {
  Echo first(HttpServerConfig{});
  HttpServerConfig c;
  c.port = first.server->port();
  c.name = "second";
  HttpServer second(c);
  Status st = second.start();
  ASSERT_FALSE(st) << "two servers bound one port (SO_REUSEPORT)";
  EXPECT_NE(st.message().find("address in use"), std::string::npos) << st.to_string();
  EXPECT_NE(st.message().find(std::to_string(c.port)), std::string::npos) << st.to_string();
  // Not even a socket that asks for SO_REUSEPORT itself may share it.
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int yes = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &yes, sizeof(yes));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(c.port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_NE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ::close(fd);
}

std::vector<std::unique_ptr<RawConnection>> slow_loris(int port, int n);
std::vector<std::unique_ptr<RawConnection>> idle_connections(int port, int n);

// `n` connections, each with a request whose head arrived and whose body has not.
std::vector<std::unique_ptr<RawConnection>> mid_body(int port, int n) {
  std::vector<std::unique_ptr<RawConnection>> out;
  for (int i = 0; i < n; ++i) {
    out.push_back(std::make_unique<RawConnection>(port));
    EXPECT_TRUE(out.back()->send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nx"));
  }
  return out;
}

// `n` connections whose requests each hold a thread of `echo`'s server, once they are served.
std::vector<std::unique_ptr<RawConnection>> holding(Echo& echo, int n) {
  std::vector<std::unique_ptr<RawConnection>> out;
  for (int i = 0; i < n; ++i) {
    out.push_back(std::make_unique<RawConnection>(echo.server->port()));
    EXPECT_TRUE(out.back()->send("GET /hold HTTP/1.1\r\nHost: x\r\n\r\n"));
  }
  EXPECT_TRUE(eventually([&] { return echo.holding.load() == n; }));
  return out;
}

TEST(HttpServer, ARequestBeyondTheBoundIsRefused503NotQueuedAndTheBoundFreesUp) {
  HttpServerConfig c;
  c.max_connections = 4;
  Echo echo(c);
  auto held = holding(echo, 4);
  // A fifth request, while the four are being served: a 503, and closed.
  ASSERT_TRUE(eventually([&] {
    RawConnection extra(echo.server->port());
    extra.send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx");
    const std::string answer = extra.read_until_closed(5s);
    return answer.find("503") != std::string::npos;
  }));
  EXPECT_GE(echo.server->rejected_connections(), 1u);
  echo.release();
  ASSERT_TRUE(eventually([&] {
    httplib::Client client(echo.origin());
    auto r = client.Post("/echo", "x", "text/plain");
    return r && r->status == 200;
  }));
}

// A request to `echo` is served at once, and no connection was refused so far.
void expect_served(Echo& echo) {
  httplib::Client client(echo.origin());
  client.set_read_timeout(5s);
  auto r = client.Post("/echo", "hello", "text/plain");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(echo.server->rejected_connections(), 0u);
}

TEST(HttpServer, ConnectionsWaitingForTheirRequestHoldNoThread) {
  HttpServerConfig c;
  c.max_connections = 4;
  Echo echo(c);
  // Far more idle and half-sent connections than threads: a request is still served.
  auto idle = idle_connections(echo.server->port(), 100);
  auto slow = slow_loris(echo.server->port(), 100);
  ASSERT_NO_FATAL_FAILURE(expect_served(echo));
}

TEST(HttpServer, RequestsWhoseBodyArrivesSlowlyHoldNoThread) {
  HttpServerConfig c;
  c.max_connections = 4;
  Echo echo(c);
  // Far more bodies on their way than threads, by Content-Length and chunked.
  auto slow = mid_body(echo.server->port(), 50);
  std::vector<std::unique_ptr<RawConnection>> chunked;
  for (int i = 0; i < 50; ++i) {
    chunked.push_back(std::make_unique<RawConnection>(echo.server->port()));
    ASSERT_TRUE(chunked.back()->send(
        "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel"));
  }
  ASSERT_NO_FATAL_FAILURE(expect_served(echo));
  // The slow ones are served once whole: their bodies arrived as sent.
  ASSERT_TRUE(slow.front()->send(std::string(99, 'y')));
  const std::string answer = slow.front()->read_until_closed(2s);
  EXPECT_NE(answer.find("\r\n\r\n100"), std::string::npos) << answer;
  ASSERT_TRUE(chunked.front()->send("lo\r\n6\r\n world\r\n0\r\n\r\n"));
  const std::string chunked_answer = chunked.front()->read_until_closed(2s);
  EXPECT_NE(chunked_answer.find("\r\n\r\n11"), std::string::npos) << chunked_answer;
}

TEST(HttpServer, AClientExpecting100ContinueGetsItOnceAndIsServed) {
  Echo echo(HttpServerConfig{});
  RawConnection c(echo.server->port());
  ASSERT_TRUE(
      c.send("POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n"
             "Connection: close\r\n\r\n"));
  // It sends its body only once told to.
  const std::string go = c.read_some(5s);
  ASSERT_EQ(go, "HTTP/1.1 100 Continue\r\n\r\n");
  ASSERT_TRUE(c.send("hello"));
  const std::string answer = c.read_until_closed(5s);
  EXPECT_EQ(answer.rfind("HTTP/1.1 200", 0), 0u) << answer;
  EXPECT_EQ(answer.find("100 Continue"), std::string::npos) << "told twice: " << answer;
  EXPECT_NE(answer.find("\r\n\r\n5"), std::string::npos) << answer;
}

TEST(HttpServer, WhatWaitingRequestsHoldIsBoundedTheLongestWaitingClosedFirst) {
  HttpServerConfig c;
  c.max_body_bytes = 16 << 10;
  c.max_waiting_bytes = 0;  // the least it can be: one whole request (16 KiB + 128 KiB)
  Echo echo(c);
  // 30 requests, each 15 KiB into a 16 KiB body: 450 KiB held.
  std::vector<std::unique_ptr<RawConnection>> partial;
  for (int i = 0; i < 30; ++i) {
    partial.push_back(std::make_unique<RawConnection>(echo.server->port()));
    ASSERT_TRUE(
        partial.back()->send("POST /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                             "Content-Length: 16384\r\n\r\n" +
                             std::string(15 << 10, 'z')));
  }
  // The first ones made room...
  partial.front()->read_until_closed(10s);
  EXPECT_FALSE(partial.front()->timed_out())
      << "the bound on what waiting requests hold was not kept";
  // ...the last one is served once whole.
  ASSERT_TRUE(partial.back()->send(std::string(1 << 10, 'z')));
  const std::string answer = partial.back()->read_until_closed(5s);
  EXPECT_NE(answer.find("\r\n\r\n16384"), std::string::npos) << answer;
}

TEST(HttpServer, AWrongMethodIs405NamingTheMethodsTheRouteTakes) {
  Echo echo(HttpServerConfig{});
  httplib::Client client(echo.origin());
  auto get = client.Get("/echo");
  ASSERT_TRUE(get) << httplib::to_string(get.error());
  EXPECT_EQ(get->status, 405) << get->body;
  EXPECT_EQ(get->get_header_value("Allow"), "POST");
  EXPECT_NE(get->body.find("GET /echo is not served; it takes POST"), std::string::npos)
      << get->body;
  auto post = client.Post("/open", "x", "text/plain");
  ASSERT_TRUE(post);
  EXPECT_EQ(post->status, 405);
  EXPECT_EQ(post->get_header_value("Allow"), "GET");
  auto head = client.Head("/open");  // HEAD goes with GET
  ASSERT_TRUE(head);
  EXPECT_EQ(head->status, 200);
  EXPECT_EQ(client.Get("/nowhere")->status, 404);
  EXPECT_EQ(echo.served.load(), 0) << "a handler ran for a wrong method";
}

TEST(HttpServer, APostWithoutLengthOrChunksHasAnEmptyBodyAndIsServedAtOnce) {
  Echo echo(HttpServerConfig{});
  RawConnection c(echo.server->port());
  // What `curl -X POST` sends: no Content-Length, no body, and the connection kept open.
  ASSERT_TRUE(c.send("POST /echo HTTP/1.1\r\nHost: x\r\n\r\n"));
  std::string answer = c.read_some(5s);
  if (answer.size() >= 4 && answer.compare(answer.size() - 4, 4, "\r\n\r\n") == 0) {
    answer += c.read_some(5s);  // the body, sent on its own
  }
  EXPECT_EQ(answer.rfind("HTTP/1.1 200", 0), 0u) << answer;
  EXPECT_NE(answer.find("\r\n\r\n0"), std::string::npos) << answer;
}

TEST(HttpServer, OneClientsWaitingConnectionsAreCappedItsOldestClosedFirst) {
  HttpServerConfig c;
  c.max_waiting_per_client = 8;
  c.header_timeout = 60s;  // what closes them here is the cap, not a deadline
  c.keep_alive_timeout = 60s;
  Echo echo(c);
  auto first = idle_connections(echo.server->port(), 12);
  auto newest = idle_connections(echo.server->port(), 8);
  // The 12 that came first make room for the 8 newest, oldest first.
  for (auto& conn : first) {
    conn->read_until_closed(20s);
    EXPECT_FALSE(conn->timed_out()) << "a connection past the cap was kept";
  }
  // The newest still wait: a request on one is served.
  ASSERT_TRUE(newest.back()->send("GET /open HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"));
  EXPECT_NE(newest.back()->read_until_closed(10s).find("200 OK"), std::string::npos);
}

TEST(HttpServer, WithEveryThreadBusyHealthAndTokenRequestsAreServedByTheReserve) {
  HttpServerConfig c;
  c.max_connections = 2;
  c.token = "a-token-of-sixteen-chars";
  Echo echo(c);
  echo.server->get("/health", HttpServer::Auth::kNone, [](const auto&, httplib::Response& res) {
    res.set_content("ok", "text/plain");
  });
  auto held = holding(echo, 2);
  // Every thread is busy: an ordinary request is refused...
  ASSERT_TRUE(eventually([&] {
    RawConnection extra(echo.server->port());
    extra.send("GET /open HTTP/1.1\r\nHost: x\r\n\r\n");
    return extra.read_until_closed(5s).find("503") != std::string::npos;
  }));
  // ...and /health and a request with the token are served.
  httplib::Client client(echo.origin());
  client.set_read_timeout(5s);
  auto health = client.Get("/health");
  ASSERT_TRUE(health) << httplib::to_string(health.error());
  EXPECT_EQ(health->status, 200);
  auto with_token =
      client.Post("/echo", {{"Authorization", "Bearer " + c.token}}, "hello", "text/plain");
  ASSERT_TRUE(with_token) << httplib::to_string(with_token.error());
  EXPECT_EQ(with_token->status, 200) << with_token->body;
  auto wrong_token = client.Post("/echo", {{"Authorization", "Bearer not-the-token-at-all"}},
                                 "hello", "text/plain");
  ASSERT_TRUE(wrong_token);
  EXPECT_EQ(wrong_token->status, 503) << "a wrong token reached the reserve";
}

TEST(HttpServer, IdleAndSlowLorisConnectionsAreClosedAtTheirDeadlines) {
  HttpServerConfig c;
  c.keep_alive_timeout = 300ms;
  c.header_timeout = 300ms;
  c.request_timeout = 300ms;
  Echo echo(c);
  RawConnection idle(echo.server->port());
  RawConnection slow(echo.server->port());
  ASSERT_TRUE(idle.ok() && slow.ok());
  ASSERT_TRUE(slow.send("POST /echo HTTP/1.1\r\nHo"));  // and never the rest
  auto body = mid_body(echo.server->port(), 1);         // a body that never ends
  body.front()->read_until_closed(20s);
  EXPECT_FALSE(body.front()->timed_out()) << "a body that never ends was waited for";
  idle.read_until_closed(20s);
  EXPECT_FALSE(idle.timed_out()) << "an idle connection was kept";
  const std::string answer = slow.read_until_closed(20s);
  EXPECT_FALSE(slow.timed_out()) << "a request that never completes was waited for";
}

// Each of `n` connections sends a partial request one byte at a time, a few bytes each.
std::vector<std::unique_ptr<RawConnection>> slow_loris(int port, int n) {
  std::vector<std::unique_ptr<RawConnection>> out;
  for (int i = 0; i < n; ++i) {
    out.push_back(std::make_unique<RawConnection>(port));
    EXPECT_TRUE(out.back()->ok());
  }
  const std::string partial = "POST /v1/metaserver HTTP/1.1\r\nHost: x\r\nContent-Len";
  for (size_t k = 0; k < 8; ++k) {
    for (auto& c : out) c->send(partial.substr(k, 1));
  }
  return out;
}

std::vector<std::unique_ptr<RawConnection>> idle_connections(int port, int n) {
  std::vector<std::unique_ptr<RawConnection>> out;
  for (int i = 0; i < n; ++i) {
    out.push_back(std::make_unique<RawConnection>(port));
    EXPECT_TRUE(out.back()->ok());
  }
  return out;
}

class ProxyHttp : public ::testing::Test {
 protected:
  void start(ProxyConfig config = {}) {
    config.prefill = {"http://127.0.0.1:9"};
    config.decode = {"http://127.0.0.1:9"};
    if (config.max_body_bytes == ProxyConfig{}.max_body_bytes) config.max_body_bytes = 1 << 20;
    auto p = Proxy::start(config);
    ASSERT_TRUE(p) << p.status().to_string();
    proxy_ = std::move(*p);
    const auto url = proxy_->metaserver_url();
    meta_origin_ = url.substr(0, url.find("/v1"));
    meta_port_ = std::stoi(meta_origin_.substr(meta_origin_.rfind(':') + 1));
  }
  // A rendezvous post (of a request the proxy does not know): answered 404 when served.
  std::pair<int, std::chrono::milliseconds> rendezvous(const std::string& token = "") {
    httplib::Client c(meta_origin_);
    c.set_connection_timeout(5s);
    c.set_read_timeout(5s);
    httplib::Headers h;
    if (!token.empty()) h.emplace("Authorization", "Bearer " + token);
    const auto t0 = std::chrono::steady_clock::now();
    auto r = c.Post("/v1/metaserver", h, R"({"request_id":"cmpl-x-0"})", "application/json");
    const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - t0);
    return {r ? r->status : -1, took};
  }
  httplib::Result client_post(const json& body) {
    httplib::Client c(proxy_->url());
    c.set_read_timeout(10s);
    return c.Post("/v1/completions", body.dump(), "application/json");
  }

  std::unique_ptr<Proxy> proxy_;
  std::string meta_origin_;
  int meta_port_ = 0;
};

TEST_F(ProxyHttp, ARendezvousIsAnsweredWithin1sWhile200IdleConnectionsAreHeld) {
  start();
  auto held = idle_connections(meta_port_, 200);
  auto [status, took] = rendezvous();
  EXPECT_EQ(status, 404);
  EXPECT_LT(took, kAnsweredWithin) << "the metaserver was starved by idle connections";
}

TEST_F(ProxyHttp, ARendezvousIsAnsweredWithin1sWhile200SlowLorisConnectionsAreHeld) {
  start();
  auto held = slow_loris(meta_port_, 200);
  auto [status, took] = rendezvous();
  EXPECT_EQ(status, 404);
  EXPECT_LT(took, kAnsweredWithin) << "the metaserver was starved by slow-loris connections";
}

TEST_F(ProxyHttp, ARendezvousAndACompletionAreAnsweredWithin1sWhile600SlowLorisConnectionsAreHeld) {
  start();
  auto held_meta = slow_loris(meta_port_, 600);
  auto held_api = slow_loris(proxy_->port(), 600);
  // And as many whose body trickles (more than the client API's threads).
  auto bodies_meta = mid_body(meta_port_, 600);
  auto bodies_api = mid_body(proxy_->port(), 600);
  auto [status, took] = rendezvous();
  EXPECT_EQ(status, 404);
  EXPECT_LT(took, kAnsweredWithin) << "the metaserver was starved by slow-loris connections";
  const auto t0 = std::chrono::steady_clock::now();
  auto r = client_post({{"prompt", "a"}, {"max_tokens", 1}});
  const auto answered = std::chrono::steady_clock::now() - t0;
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->body.find("as many connections as it may"), std::string::npos) << r->body;
  EXPECT_LT(answered, kAnsweredWithin) << "the client API was starved by slow-loris connections";
}

TEST_F(ProxyHttp, ARendezvousNestedTooDeepIs400AndTheProxyStaysUp) {
  // Deep enough to overflow the stack of a recursive copy, far within the body limit.
  start();
  const std::string deep = R"({"request_id":"cmpl-x-0","a":)" + std::string(100000, '[') +
                           std::string(100000, ']') + "}";
  httplib::Client c(meta_origin_);
  c.set_read_timeout(10s);
  auto r = c.Post("/v1/metaserver", deep, "application/json");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 400) << r->body;
  EXPECT_NE(r->body.find("deeper than 64 levels"), std::string::npos) << r->body;
  EXPECT_EQ(rendezvous().first, 404) << "the proxy serves on";
}

TEST_F(ProxyHttp, AChunkedBodyOverTheLimitIs413AndTheProxyStaysUp) {
  start();  // 1 MiB bodies
  for (int port : {proxy_->port(), meta_port_}) {
    RawConnection c(port);
    ASSERT_TRUE(c.ok());
    const std::string path = port == meta_port_ ? "/v1/metaserver" : "/v1/completions";
    ASSERT_TRUE(c.send("POST " + path +
                       " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       "Transfer-Encoding: chunked\r\n\r\n"));
    const std::string chunk(64 << 10, ' ');
    char size[32];
    std::snprintf(size, sizeof(size), "%zx\r\n", chunk.size());
    // 1.5 MiB in 64 KiB chunks; the server stops reading past 1 MiB.
    for (int i = 0; i < 24; ++i) {
      if (!c.send(size + chunk + "\r\n")) break;
    }
    const std::string answer = c.read_until_closed();
    EXPECT_EQ(answer.rfind("HTTP/1.1 413", 0), 0u) << port << ": " << answer.substr(0, 200);
  }
  // An announced length over the limit is refused before its body is read.
  RawConnection big(proxy_->port());
  ASSERT_TRUE(
      big.send("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000"
               "\r\n\r\n{"));
  EXPECT_EQ(big.read_until_closed().rfind("HTTP/1.1 413", 0), 0u);
  // Still serving.
  EXPECT_EQ(rendezvous().first, 404);
  auto r = client_post({{"prompt", 5}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
}

TEST_F(ProxyHttp, WrongFieldTypesAndOverlongListsAre400NamingTheField) {
  ProxyConfig config;
  config.max_prompts = 8;
  config.max_prompt_tokens = 100;
  start(config);
  const std::vector<std::pair<json, std::string>> cases = {
      {{{"prompt", 5}}, "prompt"},
      {{{"prompt", json::array({"a", 5})}}, "prompt[1]"},
      {{{"prompt", json::array({json::array({1, 2}), json::array({1, "x"})})}}, "prompt[1]"},
      {{{"prompt", "a"}, {"max_tokens", "x"}}, "max_tokens"},
      {{{"prompt", "a"}, {"max_tokens", -1}}, "max_tokens"},
      {{{"prompt", "a"}, {"stream", "yes"}}, "stream"},
      {{{"prompt", "a"}, {"kv_transfer_params", "str"}}, "kv_transfer_params"},
      {{{"prompt", std::vector<std::string>(9, "a")}}, "limit is 8"},
      {{{"prompt", std::vector<int>(101, 1)}}, "limit is 100"},
      {{{"prompt", {std::vector<int>(3, 1), std::vector<int>(101, 1)}}}, "prompt[1]"},
  };
  for (const auto& [body, field] : cases) {
    auto r = client_post(body);
    ASSERT_TRUE(r) << body.dump();
    EXPECT_EQ(r->status, 400) << body.dump() << " -> " << r->body;
    EXPECT_NE(r->body.find(field), std::string::npos) << body.dump() << " -> " << r->body;
  }
  httplib::Client chat(proxy_->url());
  // What a message holds is the engines' to judge; that there is a list of them, the proxy's.
  auto r = chat.Post("/v1/chat/completions", R"({"messages": 5})", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_NE(r->body.find(R"("param":"messages")"), std::string::npos) << r->body;
  EXPECT_EQ(proxy_->stats().requests, 0u) << "a refused body was registered";
}

TEST_F(ProxyHttp, TheMetaserverNeedsTheTokenTheClientApiDoesNot) {
  ProxyConfig config;
  config.token = "s3cret-token";
  start(config);
  EXPECT_EQ(rendezvous().first, 401);
  EXPECT_EQ(rendezvous("wrong").first, 401);
  EXPECT_EQ(rendezvous("s3cret-token-and-more").first, 401);
  EXPECT_EQ(rendezvous("s3cret-token").first, 404) << "served: the id is unknown";
  EXPECT_EQ(proxy_->stats().unknown_rendezvous, 1u) << "a refused post was handled";
  // The client API's /v1/metaserver needs it too; its completions do not.
  httplib::Client api(proxy_->url());
  auto r = api.Post("/v1/metaserver", R"({"request_id":"cmpl-x-0"})", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
  r = api.Post("/v1/completions", R"({"prompt": 5})", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
}

TEST_F(ProxyHttp, TheMetaserverClientSendsTheToken) {
  ProxyConfig config;
  config.token = "s3cret-token";
  start(config);
  ClientConfig cc;
  cc.token = "s3cret-token";
  Client with(cc);
  ASSERT_TRUE(with.post("a", proxy_->metaserver_url(), R"({"request_id":"cmpl-x-0"})"));
  ClientConfig none;
  Client without(none);
  ASSERT_TRUE(without.post("b", proxy_->metaserver_url(), R"({"request_id":"cmpl-x-1"})"));
  ASSERT_TRUE(eventually([&] { return !with.pending("a") && !without.pending("b"); }));
  // Both were answered (an HTTP error counts as delivered); only the first got past the
  // token to be looked up.
  EXPECT_EQ(proxy_->stats().unknown_rendezvous, 1u);
}

TEST(ProxyIds, RequestIdsAreWellFormedVersion4UuidsDistinctAcrossTwoProxies) {
  // Two proxies started at the same instant hand their Decode ids from the OS's random
  // source: a time-seeded generator would repeat across them.
  std::mutex mu;
  std::vector<std::string> ids;
  httplib::Server decode;
  decode.Post("/v1/completions", [&](const httplib::Request& req, httplib::Response& res) {
    std::lock_guard lock(mu);
    ids.push_back(req.get_header_value("X-Request-Id"));
    res.status = 500;
    res.set_content("no", "text/plain");
  });
  rd2h::testing::reuse_address_only(decode);
  const int port = decode.bind_to_any_port("127.0.0.1");
  std::thread t([&] { decode.listen_after_bind(); });
  ASSERT_TRUE(eventually([&] { return decode.is_running(); }));
  {
    ProxyConfig c;
    c.prefill = {"http://127.0.0.1:9"};
    c.decode = {"http://127.0.0.1:" + std::to_string(port)};
    auto a = Proxy::start(c);
    auto b = Proxy::start(c);
    ASSERT_TRUE(a && b);
    for (auto* p : {&*a, &*b}) {
      for (int i = 0; i < 20; ++i) {
        httplib::Client client((*p)->url());
        ASSERT_TRUE(client.Post("/v1/completions", R"({"prompt":"x"})", "application/json"));
      }
    }
  }
  decode.stop();
  t.join();
  ASSERT_EQ(ids.size(), 40u);
  const std::regex uuid4("[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}");
  for (const auto& id : ids) EXPECT_TRUE(std::regex_match(id, uuid4)) << id;
  EXPECT_EQ(std::set<std::string>(ids.begin(), ids.end()).size(), ids.size());
}

TEST(Token, LoadsFromAFileOrTheEnvironmentAndComparesWholeTokens) {
  char dir[] = "/tmp/rd2h-token-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/token";
  {
    FILE* f = std::fopen(path.c_str(), "w");
    std::fputs("abc123-of-16-chars\n", f);
    std::fclose(f);
  }
  auto t = load_token(path);
  ASSERT_TRUE(t);
  EXPECT_EQ(*t, "abc123-of-16-chars");
  EXPECT_FALSE(load_token(std::string(dir) + "/missing"));
  ::setenv("RD2H_TOKEN", "from-the-environment", 1);
  EXPECT_EQ(*load_token(""), "from-the-environment");
  // A token short enough to guess is refused, naming where it came from and the minimum.
  ::setenv("RD2H_TOKEN", "abc", 1);
  auto short_token = load_token("");
  ASSERT_FALSE(short_token);
  EXPECT_EQ(short_token.status().message(),
            "the token in $RD2H_TOKEN has 3 characters; at least 16 are needed (e.g. `openssl "
            "rand -hex 16`)");
  ::unsetenv("RD2H_TOKEN");
  EXPECT_EQ(*load_token(""), "");
  EXPECT_TRUE(token_matches("Bearer abc123", "abc123"));
  EXPECT_FALSE(token_matches("Bearer abc12", "abc123"));
  EXPECT_FALSE(token_matches("Bearer abc1234", "abc123"));
  EXPECT_FALSE(token_matches("abc123", "abc123"));
  EXPECT_FALSE(token_matches("", "abc123"));
  std::remove(path.c_str());
  ::rmdir(dir);
}

}  // namespace
}  // namespace rd2h::http
