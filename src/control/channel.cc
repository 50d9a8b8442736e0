#include "control/channel.h"

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <zmq.hpp>

#include "control/zap.h"
#include "protocol/messages.h"
#include "rd2h/common/deadline.h"
#include "util/log.h"

namespace rd2h::control {

static_assert(kMaxFrameBytes == protocol::kMaxMessageBytes,
              "a control frame carries exactly one protocol message");

struct Context::Impl {
  zmq::context_t ctx{1};
  std::mutex zap_mu;
  std::unique_ptr<ZapHandler> zap;  // started by the first secured ROUTER; stops before ctx
};

struct RouterChannel::Impl {
  explicit Impl(zmq::socket_t s) : socket(std::move(s)) {}
  zmq::socket_t socket;
  std::string zap_domain;                     // of a secured ROUTER
  zmq::socket_t monitor;                      // PAIR receiving the ROUTER's disconnect events
  log::RateLimit handshake_log;               // (and its failed handshakes, logged)
  std::map<int, std::string> identity_of_fd;  // the connection each identity spoke on
  std::vector<std::string> gone;              // identities whose connection closed
};

struct DealerChannel::Impl {
  zmq::socket_t socket;
  zmq::socket_t monitor;  // PAIR receiving the DEALER's disconnect events
  bool secured = false;   // CURVE
};

namespace {

std::vector<std::byte> to_bytes(const zmq::message_t& m) {
  const auto* p = static_cast<const std::byte*>(m.data());
  return {p, p + m.size()};
}

// The frames of the multipart message that is in, if one is; never waits.
std::vector<zmq::message_t> take_frames(zmq::socket_t& socket) {
  std::vector<zmq::message_t> frames;
  for (;;) {
    zmq::message_t frame;
    if (!socket.recv(frame, zmq::recv_flags::dontwait)) break;
    const bool more = frame.more();
    frames.push_back(std::move(frame));
    if (!more) break;
  }
  return frames;
}

// Receives one multipart message if one arrives within `timeout`; gives up early (with
// nothing) when one of `wake_fds` becomes readable.
Expected<std::optional<std::vector<zmq::message_t>>> receive_multipart(
    zmq::socket_t& socket, std::chrono::milliseconds timeout, std::span<const int> wake_fds = {}) {
  try {
    constexpr size_t kMaxWakeFds = 4;
    zmq::pollitem_t items[1 + kMaxWakeFds] = {{socket.handle(), 0, ZMQ_POLLIN, 0}};
    size_t n = 1;
    for (int fd : wake_fds.first(std::min(wake_fds.size(), kMaxWakeFds))) {
      items[n++] = {nullptr, fd, ZMQ_POLLIN, 0};
    }
    if (zmq::poll(items, n, timeout) == 0 || (items[0].revents & ZMQ_POLLIN) == 0) {
      return std::optional<std::vector<zmq::message_t>>{};
    }
    std::vector<zmq::message_t> frames = take_frames(socket);
    if (frames.empty()) return std::optional<std::vector<zmq::message_t>>{};
    return std::optional<std::vector<zmq::message_t>>(std::move(frames));
  } catch (const zmq::error_t& e) {
    return transport_error(std::string("zmq receive: ") + e.what());
  }
}

// The one non-empty frame among `frames[from..]`, if there is exactly one.
const zmq::message_t* single_payload(const std::vector<zmq::message_t>& frames, size_t from) {
  const zmq::message_t* payload = nullptr;
  for (size_t i = from; i < frames.size(); ++i) {
    if (frames[i].size() == 0) continue;
    if (payload != nullptr) return nullptr;
    payload = &frames[i];
  }
  return payload;
}

std::chrono::milliseconds remaining(const Deadline& d) {
  return std::chrono::milliseconds(d.remaining_ms());
}

void set_common_options(zmq::socket_t& s) {
  s.set(zmq::sockopt::linger, 0);
  // A frame larger than any legal message closes its connection as soon as its header is
  // read, before anything is allocated for it.
  s.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(kMaxFrameBytes));
  // No high-water mark: at a mark ZeroMQ drops a ROUTER's messages or blocks a DEALER's
  // send, either of which breaks the one-answer-per-readiness pairing both ends count on.
  // The protocol bounds the queues instead: a Prefill has at most its slots' readiness in
  // flight per Decode (its slot gates wait for the answers), and Decode answers each one,
  // reading as fast as they come and dropping a connection past its hold limits
  // (ReaderConfig::max_held). Only authenticated peers (CURVE) or loopback ones get here.
  s.set(zmq::sockopt::sndhwm, 0);
  s.set(zmq::sockopt::rcvhwm, 0);
}

// Handshakes that failed before any authentication could name the peer (a plaintext
// connection to a keyed listener, a protocol mismatch): libzmq reports them with the
// listening endpoint only.
constexpr int kHandshakeFailures = ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                                   ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                                   ZMQ_EVENT_HANDSHAKE_FAILED_AUTH;

// Why libzmq failed a handshake, from its event value.
std::string handshake_failure(uint16_t id, uint32_t value) {
  if (id == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) return "its authentication failed";
  if (id == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) return "it ended before its handshake did";
  if (value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH) {
    return "its security mechanism differs (a plaintext peer of a keyed listener, or the "
           "reverse)";
  }
  return "it broke the ZMTP handshake (protocol error " + std::to_string(value) + ")";
}

// Watches a socket's disconnects through a PAIR connected to its monitor (and, for a
// keyed ROUTER, its failed handshakes).
Status watch_disconnects(zmq::context_t& ctx, zmq::socket_t& socket, zmq::socket_t& monitor,
                         const std::string& what, bool handshakes = false) {
  static std::atomic<uint64_t> monitors{0};
  const std::string name = "inproc://rd2h-monitor-" + std::to_string(monitors++);
  const int events = ZMQ_EVENT_DISCONNECTED | (handshakes ? kHandshakeFailures : 0);
  if (zmq_socket_monitor(socket.handle(), name.c_str(), events) != 0) {
    return unreachable("cannot monitor the control " + what + ": " + zmq_strerror(zmq_errno()));
  }
  monitor = zmq::socket_t(ctx, zmq::socket_type::pair);
  monitor.set(zmq::sockopt::linger, 0);
  monitor.connect(name);
  return Status::ok();
}

// The file descriptors of connections that closed, as the monitor reported them. Failed
// handshakes it reports are logged through `handshakes`.
std::vector<int> disconnected_fds(zmq::socket_t& monitor, log::RateLimit* handshakes = nullptr) {
  std::vector<int> fds;
  for (;;) {
    zmq::message_t event;
    if (!monitor.recv(event, zmq::recv_flags::dontwait)) break;
    if (event.size() >= 6) {
      uint16_t id = 0;
      uint32_t value = 0;
      std::memcpy(&id, event.data(), sizeof(id));
      std::memcpy(&value, static_cast<const char*>(event.data()) + 2, sizeof(value));
      if (id == ZMQ_EVENT_DISCONNECTED) fds.push_back(static_cast<int>(value));
      if ((id & kHandshakeFailures) != 0) {
        zmq::message_t endpoint;
        if (event.more() && monitor.recv(endpoint, zmq::recv_flags::dontwait)) {
          event = std::move(endpoint);
        }
        uint64_t held_back = 0;
        if (handshakes != nullptr && handshakes->allow(&held_back)) {
          log::warn("control: refused a connection to {}: {} ({} more since the last such line)",
                    event.to_string(), handshake_failure(id, value), held_back);
        }
      }
    }
    while (event.more()) {  // the event's second frame: the endpoint
      if (!monitor.recv(event, zmq::recv_flags::dontwait)) break;
    }
  }
  return fds;
}

}  // namespace

std::string endpoint_url(const std::string& host, int port) {
  const bool ipv6 = host.find(':') != std::string::npos;
  return "tcp://" + (ipv6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

Context::Context() : impl_(std::make_unique<Impl>()) {}
Context::~Context() = default;

std::shared_ptr<Context> Context::create() {
  return std::shared_ptr<Context>(new Context());
}

RouterChannel::RouterChannel(std::shared_ptr<Context> context, std::unique_ptr<Impl> impl,
                             std::string url)
    : context_(std::move(context)), impl_(std::move(impl)), url_(std::move(url)) {}

RouterChannel::~RouterChannel() {
  if (impl_) zmq_socket_monitor(impl_->socket.handle(), nullptr, 0);
  if (impl_ && !impl_->zap_domain.empty()) {
    std::lock_guard lock(context_->impl().zap_mu);
    if (context_->impl().zap) context_->impl().zap->remove_domain(impl_->zap_domain);
  }
}

namespace {

// Makes `socket` a CURVE server that accepts only the trusted clients of `security`.
Status secure_server(Context::Impl& context, zmq::socket_t& socket, const ServerSecurity& security,
                     std::string& domain) {
  if (!is_curve_key(security.self.public_key) || !is_curve_key(security.self.secret_key)) {
    return invalid_argument("the control ROUTER's CURVE key pair is not two Z85 keys");
  }
  if (security.trusted_clients.empty()) {
    return invalid_argument("a CURVE control ROUTER needs at least one trusted client key");
  }
  std::lock_guard lock(context.zap_mu);
  if (!context.zap) {
    RD2H_TRY(zap, ZapHandler::start(context.ctx));
    context.zap = std::move(zap);
  }
  domain = context.zap->add_domain(security.trusted_clients);
  socket.set(zmq::sockopt::zap_domain, domain);
  socket.set(zmq::sockopt::curve_server, 1);
  socket.set(zmq::sockopt::curve_secretkey, security.self.secret_key);
  return Status::ok();
}

}  // namespace

Expected<std::unique_ptr<RouterChannel>> RouterChannel::bind(
    std::shared_ptr<Context> context, const std::string& host, int port,
    const std::optional<ServerSecurity>& security) {
  if (port < 0 || port > 65535) {
    return invalid_argument("port " + std::to_string(port) + " is outside 0..65535");
  }
  const std::string url =
      port == 0 ? endpoint_url(host, 0).substr(0, endpoint_url(host, 0).rfind(':')) + ":*"
                : endpoint_url(host, port);
  try {
    auto impl =
        std::make_unique<Impl>(zmq::socket_t(context->impl().ctx, zmq::socket_type::router));
    set_common_options(impl->socket);
    if (security) {
      RD2H_RETURN_IF_ERROR(
          secure_server(context->impl(), impl->socket, *security, impl->zap_domain));
    }
    RD2H_RETURN_IF_ERROR(watch_disconnects(context->impl().ctx, impl->socket, impl->monitor,
                                           "ROUTER at " + url, security.has_value()));
    impl->socket.set(zmq::sockopt::router_mandatory, 1);
    if (host.find(':') != std::string::npos) impl->socket.set(zmq::sockopt::ipv6, 1);
    impl->socket.bind(url);
    std::string bound = impl->socket.get(zmq::sockopt::last_endpoint);
    return std::unique_ptr<RouterChannel>(
        new RouterChannel(std::move(context), std::move(impl), std::move(bound)));
  } catch (const zmq::error_t& e) {
    return unreachable("cannot bind the control ROUTER at " + url + ": " + e.what());
  }
}

Expected<std::optional<Inbound>> RouterChannel::receive(std::chrono::milliseconds timeout,
                                                        std::span<const int> wake_fds) {
  Deadline deadline(timeout);
  for (;;) {
    RD2H_TRY(frames, receive_multipart(impl_->socket, remaining(deadline), wake_fds));
    if (!frames.has_value()) return std::optional<Inbound>{};
    auto& f = *frames;
    // Disconnects reported so far are handled first: a closed connection's descriptor may
    // be reused by the connection this message came on.
    note_disconnects();
    if (const int fd = f.back().get(ZMQ_SRCFD); fd >= 0) {
      impl_->identity_of_fd[fd] = f[0].to_string();
    }
    // A legitimate message is [identity, "", payload]. libzmq hands a multipart message
    // over only once it is whole (each frame bounded by maxmsgsize on its header), so the
    // bounds on the whole message apply here: it is refused, and freed, at once.
    size_t bytes = 0, payloads = 0;
    const zmq::message_t* first = nullptr;
    for (size_t i = 1; i < f.size(); ++i) {
      bytes += f[i].size();
      if (f[i].size() == 0) continue;
      ++payloads;
      if (first == nullptr) first = &f[i];
    }
    std::string malformed;
    if (f.size() > kMaxMessageParts) {
      malformed = "the message has " + std::to_string(f.size() - 1) + " frames (at most " +
                  std::to_string(kMaxMessageParts - 1) + ")";
    } else if (bytes > kMaxFrameBytes) {
      malformed = "the message carries " + std::to_string(bytes) + " bytes (at most " +
                  std::to_string(kMaxFrameBytes) + ")";
    } else if (payloads != 1) {
      malformed = "the message has " + std::to_string(payloads) + " payload frames (one expected)";
    }
    if (malformed.empty()) {
      return std::optional<Inbound>(Inbound{f[0].to_string(), to_bytes(*first), {}});
    }
    ++dropped_;
    if (deliver_malformed_) {
      // Its owner may still answer it: the first payload frame, if any, says for what.
      return std::optional<Inbound>(
          Inbound{f[0].to_string(), first != nullptr ? to_bytes(*first) : std::vector<std::byte>{},
                  std::move(malformed)});
    }
  }
}

void RouterChannel::note_disconnects() {
  try {
    for (int fd : disconnected_fds(impl_->monitor, &impl_->handshake_log)) {
      auto it = impl_->identity_of_fd.find(fd);
      if (it == impl_->identity_of_fd.end()) continue;
      impl_->gone.push_back(std::move(it->second));
      impl_->identity_of_fd.erase(it);
    }
  } catch (const zmq::error_t&) {
  }
}

std::vector<std::string> RouterChannel::take_disconnected() {
  note_disconnects();
  std::vector<std::string> gone;
  gone.swap(impl_->gone);
  return gone;
}

Status RouterChannel::send(const std::string& identity, std::span<const std::byte> payload) {
  try {
    impl_->socket.send(zmq::buffer(identity), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
    impl_->socket.send(zmq::message_t(), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
    impl_->socket.send(zmq::const_buffer(payload.data(), payload.size()),
                       zmq::send_flags::dontwait);
    return Status::ok();
  } catch (const zmq::error_t& e) {
    if (e.num() == EHOSTUNREACH) {
      return peer_dead("no connection with this identity on " + url_ + " (the peer is gone)");
    }
    return transport_error("zmq send on " + url_ + ": " + e.what());
  }
}

DealerChannel::DealerChannel(std::shared_ptr<Context> context, std::unique_ptr<Impl> impl,
                             std::string url)
    : context_(std::move(context)), impl_(std::move(impl)), url_(std::move(url)) {}
DealerChannel::~DealerChannel() {
  if (impl_) zmq_socket_monitor(impl_->socket.handle(), nullptr, 0);
}

bool DealerChannel::connection_lost() {
  bool lost = false;
  try {
    for (;;) {
      zmq::message_t event;
      if (!impl_->monitor.recv(event, zmq::recv_flags::dontwait)) break;
      if (event.size() >= 2) {
        uint16_t id = 0;
        std::memcpy(&id, event.data(), sizeof(id));
        lost = lost || id == ZMQ_EVENT_DISCONNECTED;
        if (id == ZMQ_EVENT_CONNECT_RETRIED && !lost && refusal_.empty()) {
          // A connect that failed (refused: nothing listens there). A Decode listens before
          // it takes requests, so whoever is there later is not the one addressed now.
          refusal_ = "nothing listens at " + url_ + " (Decode restarted or died, or is not running)";
        } else if (id == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
          refusal_ = "Decode at " + url_ + " refused this Prefill's CURVE key";
        } else if ((id == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL ||
                    id == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) &&
                   impl_->secured) {
          refusal_ = "the CURVE handshake with " + url_ +
                     " failed (the peer does not hold the trusted key, or does not use CURVE)";
        } else if (id == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL ||
                   id == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) {
          // Without CURVE this is a peer that went away mid-handshake (a Decode that died),
          // or one that does not speak ZeroMQ's protocol.
          refusal_ = "the connection to " + url_ +
                     " closed (Decode restarted or died) during its ZeroMQ handshake";
        }
      }
      while (event.more()) {  // the event's second frame: the endpoint
        if (!impl_->monitor.recv(event, zmq::recv_flags::dontwait)) break;
      }
    }
  } catch (const zmq::error_t&) {
    lost = true;
  }
  return lost || !refusal_.empty();
}

Expected<std::unique_ptr<DealerChannel>> DealerChannel::connect(
    std::shared_ptr<Context> context, const std::string& url,
    const std::optional<ClientSecurity>& security) {
  if (security &&
      (!is_curve_key(security->self.public_key) || !is_curve_key(security->self.secret_key) ||
       !is_curve_key(security->server_key))) {
    return invalid_argument("the CURVE keys for the control DEALER to " + url +
                            " are not Z85 keys");
  }
  try {
    auto impl =
        std::make_unique<Impl>(Impl{zmq::socket_t(context->impl().ctx, zmq::socket_type::dealer),
                                    zmq::socket_t(context->impl().ctx, zmq::socket_type::pair)});
    set_common_options(impl->socket);
    impl->secured = security.has_value();
    if (security) {
      impl->socket.set(zmq::sockopt::curve_serverkey, security->server_key);
      impl->socket.set(zmq::sockopt::curve_publickey, security->self.public_key);
      impl->socket.set(zmq::sockopt::curve_secretkey, security->self.secret_key);
    }
    if (url.find('[') != std::string::npos) impl->socket.set(zmq::sockopt::ipv6, 1);
    // A peer that goes away and comes back is reconnected by ZeroMQ behind our back, as a
    // new connection the peer knows nothing of: watch for the disconnect.
    static std::atomic<uint64_t> monitors{0};
    const std::string monitor = "inproc://rd2h-dealer-monitor-" + std::to_string(monitors++);
    if (zmq_socket_monitor(impl->socket.handle(), monitor.c_str(),
                           ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_CONNECT_RETRIED |
                               ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
                               ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                               ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) != 0) {
      return unreachable("cannot monitor the control DEALER to " + url + ": " +
                         zmq_strerror(zmq_errno()));
    }
    impl->monitor.set(zmq::sockopt::linger, 0);
    impl->monitor.connect(monitor);
    impl->socket.connect(url);
    return std::unique_ptr<DealerChannel>(
        new DealerChannel(std::move(context), std::move(impl), url));
  } catch (const zmq::error_t& e) {
    return unreachable("cannot connect the control DEALER to " + url + ": " + e.what());
  }
}

Status DealerChannel::send(std::span<const std::byte> payload) {
  try {
    // With no high-water mark a DEALER queues while its peer is away: this never blocks.
    if (!impl_->socket.send(zmq::const_buffer(payload.data(), payload.size()),
                            zmq::send_flags::dontwait)) {
      return transport_error("zmq send to " + url_ + " would block");
    }
    return Status::ok();
  } catch (const zmq::error_t& e) {
    return transport_error("zmq send to " + url_ + ": " + e.what());
  }
}

Expected<std::optional<std::vector<std::byte>>> DealerChannel::receive(
    std::chrono::milliseconds timeout) {
  Deadline deadline(timeout);
  for (;;) {
    RD2H_TRY(frames, receive_multipart(impl_->socket, remaining(deadline)));
    if (!frames.has_value()) return std::optional<std::vector<std::byte>>{};
    const zmq::message_t* payload = single_payload(*frames, 0);
    if (payload != nullptr) return std::optional<std::vector<std::byte>>(to_bytes(*payload));
    ++dropped_;
  }
}

Expected<std::optional<std::vector<std::byte>>> DealerChannel::try_receive() {
  try {
    for (;;) {
      if ((impl_->socket.get(zmq::sockopt::events) & ZMQ_POLLIN) == 0) {
        return std::optional<std::vector<std::byte>>{};
      }
      std::vector<zmq::message_t> frames = take_frames(impl_->socket);
      if (frames.empty()) return std::optional<std::vector<std::byte>>{};
      const zmq::message_t* payload = single_payload(frames, 0);
      if (payload != nullptr) return std::optional<std::vector<std::byte>>(to_bytes(*payload));
      ++dropped_;
    }
  } catch (const zmq::error_t& e) {
    return transport_error("zmq receive from " + url_ + ": " + e.what());
  }
}

int DealerChannel::notify_fd() const {
  return impl_->socket.get(zmq::sockopt::fd);
}

Expected<std::unique_ptr<RouterChannel>> RouterChannel::bind_ipc(std::shared_ptr<Context> context,
                                                                 const std::string& path) {
  const std::string url = "ipc://" + path;
  try {
    auto impl =
        std::make_unique<Impl>(zmq::socket_t(context->impl().ctx, zmq::socket_type::router));
    set_common_options(impl->socket);
    RD2H_RETURN_IF_ERROR(
        watch_disconnects(context->impl().ctx, impl->socket, impl->monitor, "ROUTER at " + url));
    impl->socket.set(zmq::sockopt::router_mandatory, 1);
    impl->socket.bind(url);
    return std::unique_ptr<RouterChannel>(
        new RouterChannel(std::move(context), std::move(impl), url));
  } catch (const zmq::error_t& e) {
    return unreachable("cannot bind the control ROUTER at " + url + ": " + e.what());
  }
}

}  // namespace rd2h::control
