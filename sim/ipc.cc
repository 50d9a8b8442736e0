#include "sim/ipc.h"

namespace rd2h::sim {

namespace {

void set_options(zmq::socket_t& s) {
  s.set(zmq::sockopt::linger, 0);
  s.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(kMaxIpcMessageBytes));
  // Nothing is dropped or refused for being queued: a job or answer waits for its peer.
  s.set(zmq::sockopt::sndhwm, 0);
  s.set(zmq::sockopt::rcvhwm, 0);
}

std::vector<std::byte> bytes_of(const zmq::message_t& m) {
  const auto* p = static_cast<const std::byte*>(m.data());
  return {p, p + m.size()};
}

// Whether a message is ready on `s` within `timeout`.
Expected<bool> wait_readable(zmq::socket_t& s, std::chrono::milliseconds timeout) {
  zmq::pollitem_t item{s.handle(), 0, ZMQ_POLLIN, 0};
  try {
    return zmq::poll(&item, 1, timeout) > 0;
  } catch (const zmq::error_t& e) {
    if (e.num() == EINTR) return false;
    return internal_error(std::string("polling the simulator's IPC: ") + e.what());
  }
}

// The frames of one message; more than `max_frames` are read off and refused.
Expected<std::vector<zmq::message_t>> receive_frames(zmq::socket_t& s, size_t max_frames) {
  std::vector<zmq::message_t> frames;
  try {
    bool more = true;
    while (more) {
      zmq::message_t m;
      if (!s.recv(m, zmq::recv_flags::dontwait)) break;
      more = m.more();
      if (frames.size() < max_frames) frames.push_back(std::move(m));
    }
  } catch (const zmq::error_t& e) {
    return internal_error(std::string("receiving on the simulator's IPC: ") + e.what());
  }
  return frames;
}

}  // namespace

Expected<IpcRouter> IpcRouter::bind(const std::string& endpoint) {
  IpcRouter r;
  try {
    r.socket_ = zmq::socket_t(r.context_, zmq::socket_type::router);
    set_options(r.socket_);
    r.socket_.set(zmq::sockopt::router_mandatory, 1);
    r.socket_.bind(endpoint);
    r.url_ = r.socket_.get(zmq::sockopt::last_endpoint);
  } catch (const zmq::error_t& e) {
    return unreachable("cannot bind the simulator's IPC at " + endpoint + ": " + e.what());
  }
  return r;
}

Expected<std::optional<IpcRouter::Inbound>> IpcRouter::receive(std::chrono::milliseconds timeout) {
  RD2H_TRY(ready, wait_readable(socket_, timeout));
  if (!ready) return std::optional<Inbound>{};
  RD2H_TRY(frames, receive_frames(socket_, 3));
  if (frames.size() != 2) return std::optional<Inbound>{};  // not one of ours: dropped
  return std::optional<Inbound>(Inbound{frames[0].to_string(), bytes_of(frames[1])});
}

Status IpcRouter::send(const std::string& identity, std::span<const std::byte> payload) {
  try {
    socket_.send(zmq::buffer(identity), zmq::send_flags::sndmore);
    socket_.send(zmq::const_buffer(payload.data(), payload.size()), zmq::send_flags::none);
  } catch (const zmq::error_t& e) {
    return unreachable("the simulator's IPC peer " + identity + " is gone: " + e.what());
  }
  return Status::ok();
}

Expected<IpcDealer> IpcDealer::connect(const std::string& url) {
  IpcDealer d;
  try {
    d.socket_ = zmq::socket_t(d.context_, zmq::socket_type::dealer);
    set_options(d.socket_);
    d.socket_.connect(url);
  } catch (const zmq::error_t& e) {
    return unreachable("cannot connect the simulator's IPC to " + url + ": " + e.what());
  }
  d.url_ = url;
  return d;
}

Expected<std::optional<std::vector<std::byte>>> IpcDealer::receive(
    std::chrono::milliseconds timeout) {
  using Out = std::optional<std::vector<std::byte>>;
  RD2H_TRY(ready, wait_readable(socket_, timeout));
  if (!ready) return Out{};
  RD2H_TRY(frames, receive_frames(socket_, 2));
  if (frames.size() != 1) return Out{};  // not one of ours: dropped
  return Out(bytes_of(frames[0]));
}

Status IpcDealer::send(std::span<const std::byte> payload) {
  try {
    if (!socket_.send(zmq::const_buffer(payload.data(), payload.size()),
                      zmq::send_flags::dontwait)) {
      return unreachable("the simulator's IPC to " + url_ + " cannot take a message now");
    }
  } catch (const zmq::error_t& e) {
    return unreachable("sending on the simulator's IPC to " + url_ + ": " + e.what());
  }
  return Status::ok();
}

}  // namespace rd2h::sim
