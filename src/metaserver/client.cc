#include "metaserver/client.h"

#include <arpa/inet.h>
#include <httplib.h>

#include <algorithm>
#include <cctype>
#include <optional>

#include "util/http_server.h"
#include "util/log.h"
#include "util/token.h"

namespace rd2h::metaserver {

Expected<Url> parse_url(const std::string& url) {
  const std::string scheme = "http://";
  if (url.rfind(scheme, 0) != 0) {
    return invalid_argument("metaserver URL '" + url + "' does not start with http://");
  }
  const size_t slash = url.find('/', scheme.size());
  Url u;
  u.origin = url.substr(0, slash);
  u.path = slash == std::string::npos ? "/" : url.substr(slash);
  if (u.origin.size() == scheme.size()) {
    return invalid_argument("metaserver URL '" + url + "' has no host");
  }
  return u;
}

namespace {

// Why `host` is neither a host name nor an IP address, if it is not.
std::optional<std::string> bad_host(const std::string& host) {
  if (host.empty()) return "it has no host";
  if (host.front() == '[') {
    in6_addr v6{};
    const std::string inside = host.back() == ']' ? host.substr(1, host.size() - 2) : "";
    if (inet_pton(AF_INET6, inside.c_str(), &v6) == 1) return std::nullopt;
    return "'" + host + "' is not an IPv6 address";
  }
  if (host.size() > 253) return "its host is longer than 253 characters";
  size_t start = 0;
  std::string last;
  for (;;) {
    const size_t dot = std::min(host.find('.', start), host.size());
    const std::string label = host.substr(start, dot - start);
    const bool ok = !label.empty() && label.size() <= 63 && label.front() != '-' &&
                    label.back() != '-' && std::all_of(label.begin(), label.end(), [](char c) {
                      return std::isalnum(static_cast<unsigned char>(c)) || c == '-';
                    });
    if (!ok) return "'" + host + "' is not a valid host name or address";
    last = label;
    if (dot == host.size()) break;
    start = dot + 1;
  }
  // A name whose last label is all digits can only be an IPv4 address.
  if (std::all_of(last.begin(), last.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    in_addr v4{};
    if (inet_pton(AF_INET, host.c_str(), &v4) != 1) {
      return "'" + host + "' is not a valid IPv4 address";
    }
  }
  return std::nullopt;
}

}  // namespace

std::string http_origin(const std::string& host, int port) {
  const bool v6 = host.find(':') != std::string::npos && host.front() != '[';
  return "http://" + (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

Expected<Url> parse_origin(const std::string& origin) {
  auto wrong = [&](const std::string& why) {
    return invalid_argument("'" + origin + "' is not http://host:port: " + why);
  };
  const std::string scheme = "http://";
  if (origin.rfind(scheme, 0) != 0) return wrong("it does not start with http://");
  const std::string rest = origin.substr(scheme.size());
  if (rest.find('/') != std::string::npos) return wrong("it has a path");
  const size_t colon = rest.rfind(':');
  const size_t bracket = rest.rfind(']');
  if (colon == std::string::npos || (bracket != std::string::npos && colon < bracket)) {
    return wrong("it has no port");
  }
  const std::string host = rest.substr(0, colon), port = rest.substr(colon + 1);
  if (auto why = bad_host(host)) return wrong(*why);
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
      std::stoi(port) < 1 || std::stoi(port) > 65535) {
    return wrong("its port '" + port + "' is not in 1..65535");
  }
  return Url{origin, "/"};
}

Client::Client(ClientConfig config) : config_(config), pool_(config.threads) {
  if (config_.threads == 0) config_.threads = 1;
  if (config_.attempts < 1) config_.attempts = 1;
  for (size_t i = 0; i < config_.threads; ++i) pool_.run([this] { run(); });
}

Client::~Client() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    queue_.clear();
  }
  cv_.notify_all();
  pool_.stop();
}

Status Client::post(const std::string& key, const std::string& url, std::string json) {
  auto parsed = parse_url(url);
  if (!parsed) return parsed.status().with_context("request " + key);
  {
    std::lock_guard lock(mu_);
    if (!keys_.insert(key).second) {
      return already_exists("request " + key + " already has a rendezvous post pending");
    }
    queue_.emplace(Clock::now(), Job{key, std::move(*parsed), std::move(json), 0});
  }
  cv_.notify_one();
  return Status::ok();
}

void Client::cancel(const std::string& key) {
  std::lock_guard lock(mu_);
  if (keys_.erase(key) == 0) return;
  ++stats_.cancelled;
  for (auto it = queue_.begin(); it != queue_.end();) {
    it = it->second.key == key ? queue_.erase(it) : std::next(it);
  }
}

bool Client::pending(const std::string& key) const {
  std::lock_guard lock(mu_);
  return keys_.count(key) != 0;
}

ClientStats Client::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

void Client::run() {
  std::unique_lock lock(mu_);
  while (!stopping_) {
    if (queue_.empty()) {
      cv_.wait(lock);
      continue;
    }
    const auto when = queue_.begin()->first;
    if (Clock::now() < when) {
      cv_.wait_until(lock, when);
      continue;
    }
    Job job = std::move(queue_.begin()->second);
    queue_.erase(queue_.begin());
    lock.unlock();
    attempt(std::move(job));
    lock.lock();
  }
}

void Client::attempt(Job job) {
  httplib::Client http(job.url.origin);
  http.set_connection_timeout(config_.timeout);
  http.set_read_timeout(config_.timeout);
  http.set_write_timeout(config_.timeout);
  httplib::Headers headers;
  if (!config_.token.empty()) headers.emplace("Authorization", http::bearer(config_.token));
  auto res = http.Post(job.url.path, headers, job.body, "application/json");

  std::lock_guard lock(mu_);
  if (keys_.count(job.key) == 0) return;  // cancelled while in flight
  if (res) {
    keys_.erase(job.key);
    if (res->status >= 200 && res->status < 300) {
      ++stats_.delivered;
    } else {
      // Older proxies answer errors for requests they handled: delivered, as the spec says.
      ++stats_.http_errors;
      log::warn("metaserver: request {}: HTTP {} from {}{}: {}", job.key, res->status,
                job.url.origin, job.url.path, http::error_text(res->body));
    }
    return;
  }
  ++stats_.transport_errors;
  ++job.attempts;
  const auto delay =
      job.attempts < config_.attempts ? config_.backoff * job.attempts : config_.resubmit;
  if (job.attempts == config_.attempts) {
    log::warn(
        "metaserver: request {}: {}{} unreachable after {} attempts ({}); resubmitting every "
        "{} ms",
        job.key, job.url.origin, job.url.path, job.attempts, httplib::to_string(res.error()),
        static_cast<long long>(config_.resubmit.count()));
  }
  if (stopping_) return;
  queue_.emplace(Clock::now() + delay, std::move(job));
  cv_.notify_one();
}

}  // namespace rd2h::metaserver
