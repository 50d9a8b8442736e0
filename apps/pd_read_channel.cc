#include "pd_read_channel.h"

#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string_view>

namespace rd2h::tools {

namespace {

using namespace std::chrono_literals;

// What the destination says; the source answers the first with the handshake and the
// verdicts with kAcknowledged. Anything else a source receives is not a pd-read peer's.
constexpr std::string_view kAskHandshake = "pd-read: handshake?";
constexpr std::string_view kVerified = "pd-read: verified";
constexpr std::string_view kFailed = "pd-read: failed";
constexpr std::string_view kAcknowledged = "pd-read: acknowledged";

// How often a wait looks at the connection between messages: how soon a peer that went
// away is noticed.
constexpr std::chrono::milliseconds kPeerCheck = 100ms;
// How long a source waits for its destination to close after the acknowledgement (which
// closing the ROUTER would otherwise discard unsent).
constexpr std::chrono::seconds kCloseWait = 5s;

std::string_view as_text(std::span<const std::byte> payload) {
  return {reinterpret_cast<const char*>(payload.data()), payload.size()};
}

std::span<const std::byte> as_payload(std::string_view text) {
  return std::as_bytes(std::span(text.data(), text.size()));
}

std::chrono::milliseconds slice(const Deadline& deadline) {
  return std::min(std::chrono::milliseconds(deadline.remaining_ms()), kPeerCheck);
}

bool contains(const std::vector<std::string>& identities, const std::string& identity) {
  return std::find(identities.begin(), identities.end(), identity) != identities.end();
}

// The address a host name resolves to: ZeroMQ binds to addresses and interface names only.
Expected<std::string> bind_host(const std::string& host) {
  if (host.empty() || host == "*") return std::string("*");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found); rc != 0) {
    return unreachable("cannot resolve " + host + ": " + ::gai_strerror(rc));
  }
  char numeric[NI_MAXHOST];
  const int rc = ::getnameinfo(found->ai_addr, found->ai_addrlen, numeric, sizeof(numeric), nullptr,
                               0, NI_NUMERICHOST);
  ::freeaddrinfo(found);
  if (rc != 0) return unreachable("cannot resolve " + host + ": " + ::gai_strerror(rc));
  return std::string(numeric);
}

}  // namespace

Expected<std::pair<std::string, int>> split_host_port(const std::string& host_port) {
  auto colon = host_port.rfind(':');
  if (colon == std::string::npos) {
    return invalid_argument("address '" + host_port + "' is not host:port");
  }
  std::string host = host_port.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  std::string port_text = host_port.substr(colon + 1);
  char* end = nullptr;
  long port = std::strtol(port_text.c_str(), &end, 10);
  if (port_text.empty() || *end != '\0' || port < 0 || port > 65535) {
    return invalid_argument("port '" + port_text + "' in '" + host_port +
                            "' is not a number in 0..65535");
  }
  return std::pair{host, static_cast<int>(port)};
}

Expected<SourceChannel> SourceChannel::bind(const std::string& host_port) {
  RD2H_TRY(hp, split_host_port(host_port));
  auto host = bind_host(hp.first);
  if (!host) return host.status().with_context("cannot listen on " + host_port);
  auto router = control::RouterChannel::bind(control::Context::create(), *host, hp.second);
  if (!router) return router.status().with_context("cannot listen on " + host_port);
  return SourceChannel(std::move(*router));
}

std::string SourceChannel::address() const {
  const std::string& url = router_->url();
  return url.rfind("tcp://", 0) == 0 ? url.substr(6) : url;
}

Status SourceChannel::serve(std::span<const std::byte> handshake, const Deadline& deadline) {
  for (;;) {
    RD2H_TRY(in, router_->receive(std::chrono::milliseconds(deadline.remaining_ms())));
    if (!in) return timeout_error("no destination asked " + address() + " for the handshake");
    if (as_text(in->payload) != kAskHandshake) continue;
    RD2H_RETURN_IF_ERROR(router_->send(in->identity, handshake));
    reader_ = in->identity;
    return Status::ok();
  }
}

Expected<bool> SourceChannel::await_verdict(const Deadline& deadline) {
  RD2H_TRY(ok, receive_verdict(deadline));
  await_close(Deadline::at(std::min(deadline.time_point(), Deadline::Clock::now() + kCloseWait)));
  return ok;
}

Expected<bool> SourceChannel::receive_verdict(const Deadline& deadline) {
  while (!deadline.expired()) {
    RD2H_TRY(in, router_->receive(slice(deadline)));
    const std::string_view text = in ? as_text(in->payload) : std::string_view();
    if (in && in->identity == reader_ && (text == kVerified || text == kFailed)) {
      RD2H_RETURN_IF_ERROR(router_->send(reader_, as_payload(kAcknowledged)));
      return text == kVerified;
    }
    if (contains(router_->take_disconnected(), reader_)) {
      return peer_dead("the destination closed its connection to " + address() +
                       " without a verdict");
    }
  }
  return timeout_error("no verdict from the destination served at " + address());
}

void SourceChannel::await_close(const Deadline& deadline) {
  while (!deadline.expired() && !contains(router_->take_disconnected(), reader_)) {
    // Nothing more is expected; the receive is the bounded wait between looks.
    (void)router_->receive(slice(deadline));
  }
}

Expected<DestChannel> DestChannel::connect(const std::string& host_port) {
  RD2H_TRY(hp, split_host_port(host_port));
  if (hp.first.empty() || hp.second == 0) {
    return invalid_argument("address '" + host_port + "' names no source (host:port, port > 0)");
  }
  auto dealer = control::DealerChannel::connect(control::Context::create(),
                                                control::endpoint_url(hp.first, hp.second));
  if (!dealer) return dealer.status().with_context("cannot connect to " + host_port);
  return DestChannel(std::move(*dealer), host_port);
}

Expected<std::vector<std::byte>> DestChannel::fetch_handshake(const Deadline& deadline) {
  if (!dealer_) return failed_precondition("the verdict was sent already");
  RD2H_RETURN_IF_ERROR(dealer_->send(as_payload(kAskHandshake)));
  auto reply = receive(deadline);
  if (reply) return reply;
  switch (reply.status().code()) {
    case StatusCode::kTimeout:
      return timeout_error("no pd-read source at " + address_ +
                           " answered before the deadline (is one running there?)");
    case StatusCode::kPeerDead:
      return unreachable("cannot connect to " + address_ +
                         ": the connection was refused or closed (is a pd-read source "
                         "listening there?)");
    default:
      return reply.status().with_context("asking " + address_ + " for the handshake");
  }
}

Status DestChannel::send_verdict(bool ok, const Deadline& deadline) {
  if (!dealer_) return failed_precondition("the verdict was sent already");
  RD2H_RETURN_IF_ERROR(dealer_->send(as_payload(ok ? kVerified : kFailed)));
  auto reply = receive(deadline);
  dealer_.reset();
  if (!reply) {
    return reply.status().with_context("the source at " + address_ +
                                       " did not acknowledge the verdict");
  }
  if (as_text(*reply) != kAcknowledged) {
    return invalid_argument("the source at " + address_ + " answered the verdict with " +
                            std::to_string(reply->size()) + " bytes that are no acknowledgement");
  }
  return Status::ok();
}

Expected<std::vector<std::byte>> DestChannel::receive(const Deadline& deadline) {
  while (!deadline.expired()) {
    RD2H_TRY(payload, dealer_->receive(slice(deadline)));
    if (payload) return std::move(*payload);
    if (dealer_->connection_lost()) return peer_dead("the connection was refused or closed");
  }
  return timeout_error("nothing came before the deadline");
}

}  // namespace rd2h::tools
