#include "tool_socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace rd2h::tools {

namespace {

Status wait_fd(int fd, short events, const Deadline& deadline, const char* what) {
  for (;;) {
    pollfd p{fd, events, 0};
    int r = ::poll(&p, 1, deadline.remaining_ms());
    if (r > 0) return Status::ok();
    if (r == 0) return timeout_error(std::string(what) + " timed out");
    if (errno != EINTR) return internal_error(std::string(what) + ": " + std::strerror(errno));
  }
}

Expected<addrinfo*> resolve(const std::string& host, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), std::to_string(port).c_str(),
                         &hints, &res);
  if (rc != 0) return unreachable("cannot resolve " + host + ": " + ::gai_strerror(rc));
  return res;
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

Expected<Socket> Socket::listen(const std::string& host_port) {
  RD2H_TRY(hp, split_host_port(host_port));
  RD2H_TRY(res, resolve(hp.first, hp.second, true));
  Status last = unreachable("no address for " + host_port);
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    Socket s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (s.fd() < 0) continue;
    int one = 1;
    ::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(s.fd(), ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(s.fd(), 4) == 0) {
      ::freeaddrinfo(res);
      return s;
    }
    last = unreachable("cannot listen on " + host_port + ": " + std::strerror(errno));
  }
  ::freeaddrinfo(res);
  return last;
}

Expected<Socket> Socket::connect(const std::string& host_port, const Deadline& deadline) {
  RD2H_TRY(hp, split_host_port(host_port));
  RD2H_TRY(res, resolve(hp.first, hp.second, false));
  Status last = unreachable("no address for " + host_port);
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    Socket s(
        ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
    if (s.fd() < 0) continue;
    int rc = ::connect(s.fd(), ai->ai_addr, ai->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      Status w = wait_fd(s.fd(), POLLOUT, deadline, "connect");
      if (!w.is_ok()) {
        last = unreachable("cannot connect to " + host_port + ": " + w.message());
        continue;
      }
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
      rc = err == 0 ? 0 : -1;
      errno = err;
    }
    if (rc == 0) {
      ::freeaddrinfo(res);
      int one = 1;
      ::setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      return s;
    }
    last = unreachable("cannot connect to " + host_port + ": " + std::strerror(errno));
  }
  ::freeaddrinfo(res);
  return last;
}

Expected<Socket> Socket::accept(const Deadline& deadline) {
  RD2H_RETURN_IF_ERROR(wait_fd(fd(), POLLIN, deadline, "waiting for a connection"));
  const int accepted = ::accept4(fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (accepted < 0) return internal_error(std::string("accept: ") + std::strerror(errno));
  return Socket(accepted);
}

std::string Socket::local_address() const {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (::getsockname(fd(), reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  char host[NI_MAXHOST], port[NI_MAXSERV];
  if (::getnameinfo(reinterpret_cast<sockaddr*>(&ss), len, host, sizeof(host), port, sizeof(port),
                    NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return "?";
  }
  std::string h = host;
  if (h.find(':') != std::string::npos) h = "[" + h + "]";
  return h + ":" + port;
}

Status Socket::send_all(std::span<const std::byte> data, const Deadline& deadline) {
  size_t sent = 0;
  while (sent < data.size()) {
    ssize_t n = ::send(fd(), data.data() + sent, data.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      RD2H_RETURN_IF_ERROR(wait_fd(fd(), POLLOUT, deadline, "send"));
      continue;
    }
    return peer_dead(std::string("send: ") + std::strerror(errno));
  }
  return Status::ok();
}

Status Socket::recv_exact(std::span<std::byte> out, const Deadline& deadline) {
  size_t got = 0;
  while (got < out.size()) {
    ssize_t n = ::recv(fd(), out.data() + got, out.size() - got, MSG_DONTWAIT);
    if (n > 0) {
      got += static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return peer_dead("the peer closed the connection");
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      RD2H_RETURN_IF_ERROR(wait_fd(fd(), POLLIN, deadline, "receive"));
      continue;
    }
    return peer_dead(std::string("recv: ") + std::strerror(errno));
  }
  return Status::ok();
}

Status Socket::send_frame(std::span<const std::byte> data, const Deadline& deadline) {
  uint32_t n = static_cast<uint32_t>(data.size());
  std::byte len[4];
  for (int i = 0; i < 4; ++i) len[i] = static_cast<std::byte>((n >> (8 * i)) & 0xff);
  RD2H_RETURN_IF_ERROR(send_all(len, deadline));
  return send_all(data, deadline);
}

Expected<std::vector<std::byte>> Socket::recv_frame(size_t max_len, const Deadline& deadline) {
  std::byte len[4];
  RD2H_RETURN_IF_ERROR(recv_exact(len, deadline));
  uint32_t n = 0;
  for (int i = 0; i < 4; ++i) n |= std::to_integer<uint32_t>(len[i]) << (8 * i);
  if (n > max_len) {
    return invalid_argument("frame of " + std::to_string(n) + " bytes exceeds the limit of " +
                            std::to_string(max_len));
  }
  std::vector<std::byte> out(n);
  RD2H_RETURN_IF_ERROR(recv_exact(out, deadline));
  return out;
}

}  // namespace rd2h::tools
