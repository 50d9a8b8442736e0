#include "control/zap.h"

#include "util/log.h"

namespace rd2h::control {

namespace {

constexpr const char* kZapEndpoint = "inproc://zeromq.zap.01";

std::string z85(const zmq::message_t& binary_key) {
  if (binary_key.size() != 32) return "(not a 32-byte key)";
  char text[41] = {};
  zmq_z85_encode(text, static_cast<const uint8_t*>(binary_key.data()), 32);
  return text;
}

}  // namespace

Expected<std::unique_ptr<ZapHandler>> ZapHandler::start(zmq::context_t& context) {
  try {
    zmq::socket_t socket(context, zmq::socket_type::rep);
    socket.set(zmq::sockopt::linger, 0);
    socket.bind(kZapEndpoint);
    auto handler = std::unique_ptr<ZapHandler>(new ZapHandler(std::move(socket)));
    handler->thread_ = std::thread([h = handler.get()] { h->run(); });
    return handler;
  } catch (const zmq::error_t& e) {
    return internal_error(std::string("cannot start the CURVE authentication handler: ") +
                          e.what());
  }
}

ZapHandler::ZapHandler(zmq::socket_t socket) : socket_(std::move(socket)) {}

ZapHandler::~ZapHandler() {
  stopping_.store(true);
  if (thread_.joinable()) thread_.join();
}

std::string ZapHandler::add_domain(const std::vector<std::string>& clients) {
  std::lock_guard lock(mu_);
  std::string name = "rd2h-" + std::to_string(next_domain_++);
  domains_[name] = std::set<std::string>(clients.begin(), clients.end());
  return name;
}

void ZapHandler::remove_domain(const std::string& domain) {
  std::lock_guard lock(mu_);
  domains_.erase(domain);
}

void ZapHandler::run() {
  while (!stopping_.load()) {
    try {
      zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
      if (zmq::poll(&item, 1, std::chrono::milliseconds(50)) == 0) continue;
      std::vector<zmq::message_t> request;
      for (;;) {
        zmq::message_t frame;
        if (!socket_.recv(frame, zmq::recv_flags::dontwait)) break;
        const bool more = frame.more();
        request.push_back(std::move(frame));
        if (!more || request.size() > 16) break;
      }
      if (!request.empty()) answer(request);
    } catch (const zmq::error_t& e) {
      if (e.num() == ETERM) return;
      log::error("control: CURVE authentication handler: {}", e.what());
    }
  }
}

// Request: version, request id, domain, address, routing id, mechanism, credentials...
// Reply: version, request id, status code, status text, user id, metadata.
void ZapHandler::answer(std::vector<zmq::message_t>& request) {
  const std::string id = request.size() > 1 ? request[1].to_string() : std::string();
  bool ok = false;
  std::string why = "malformed authentication request";
  std::string address = "?";
  if (request.size() >= 7 && request[0].to_string() == "1.0") {
    const std::string domain = request[2].to_string();
    address = request[3].to_string();
    const std::string mechanism = request[5].to_string();
    const std::string key = z85(request[6]);
    std::lock_guard lock(mu_);
    auto d = domains_.find(domain);
    if (mechanism != "CURVE") {
      why = "mechanism " + mechanism + " instead of CURVE";
    } else if (d == domains_.end()) {
      why = "unknown ZAP domain '" + domain + "'";
    } else if (d->second.count(key) == 0) {
      why = "its public key " + key + " is not trusted";
    } else {
      ok = true;
    }
  }
  if (!ok) {
    refused_.fetch_add(1);
    uint64_t held_back = 0;
    if (refusal_log_.allow(&held_back)) {
      log::warn(
          "control: refused a control connection from {}: {} ({} more since the last such "
          "line)",
          address, why, held_back);
    }
  }
  const std::string code = ok ? "200" : "400";
  const std::string text = ok ? "OK" : "not trusted";
  socket_.send(zmq::buffer(std::string("1.0")), zmq::send_flags::sndmore);
  socket_.send(zmq::buffer(id), zmq::send_flags::sndmore);
  socket_.send(zmq::buffer(code), zmq::send_flags::sndmore);
  socket_.send(zmq::buffer(text), zmq::send_flags::sndmore);
  socket_.send(zmq::message_t(), zmq::send_flags::sndmore);
  socket_.send(zmq::message_t(), zmq::send_flags::none);
}

}  // namespace rd2h::control
