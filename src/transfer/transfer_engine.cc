#include "rd2h/transfer/transfer_engine.h"

#include <poll.h>

#include <mutex>

#include "rd2h/common/deadline.h"

namespace rd2h::transfer {

std::string_view to_string(Role role) {
  return role == Role::kPrefill ? "prefill" : "decode";
}

Expected<Role> parse_role(std::string_view text) {
  if (text == "prefill") return Role::kPrefill;
  if (text == "decode") return Role::kDecode;
  return invalid_argument("role '" + std::string(text) + "' is not one of prefill, decode");
}

std::string_view to_string(Transport transport) {
  switch (transport) {
    case Transport::kShm:
      return "shm";
    case Transport::kTcp:
      return "tcp";
    case Transport::kAuto:
      return "auto";
  }
  return "unknown";
}

Expected<Transport> parse_transport(std::string_view text) {
  if (text == "shm") return Transport::kShm;
  if (text == "tcp") return Transport::kTcp;
  if (text == "auto") return Transport::kAuto;
  return invalid_argument("transport '" + std::string(text) + "' is not one of shm, tcp, auto");
}

std::string_view to_string(ReadPath path) {
  switch (path) {
    case ReadPath::kAuto:
      return "auto";
    case ReadPath::kRma:
      return "rma";
    case ReadPath::kActiveMessage:
      return "am";
  }
  return "unknown";
}

Expected<ReadPath> parse_read_path(std::string_view text) {
  if (text == "auto") return ReadPath::kAuto;
  if (text == "rma") return ReadPath::kRma;
  if (text == "am") return ReadPath::kActiveMessage;
  return invalid_argument("read path '" + std::string(text) + "' is not one of auto, rma, am");
}

Status TransferEngine::batch_read_sync(const SessionHandle& session, std::span<const ReadOp> ops) {
  auto request = post_reads(session, ops);
  if (!request) return request.status();
  return (*request)->wait();
}

namespace {

std::mutex g_process_engine_mu;
std::shared_ptr<TransferEngine> g_process_engine;

}  // namespace

Expected<std::shared_ptr<TransferEngine>> bind_process_engine(const EngineConfig& config) {
  std::lock_guard lock(g_process_engine_mu);
  if (g_process_engine) {
    const EngineConfig& bound = g_process_engine->config();
    auto differs = [](std::string_view what, auto have, auto want) {
      return failed_precondition("the process-wide transfer engine is bound to " +
                                 std::string(what) + " " + have + "; cannot bind it to " + want);
    };
    if (bound.role != config.role) {
      return differs("role", std::string(to_string(bound.role)),
                     std::string(to_string(config.role)));
    }
    if (bound.device_id != config.device_id) {
      return differs("device id", std::to_string(bound.device_id),
                     std::to_string(config.device_id));
    }
    if (!config.hostname.empty() && bound.hostname != config.hostname) {
      return differs("hostname", bound.hostname, config.hostname);
    }
    if (bound.transport != config.transport) {
      return differs("transport", std::string(to_string(bound.transport)),
                     std::string(to_string(config.transport)));
    }
    return g_process_engine;
  }
  RD2H_TRY(engine, create_ucx_engine(config));
  g_process_engine = std::shared_ptr<TransferEngine>(std::move(engine));
  return g_process_engine;
}

void unbind_process_engine() {
  std::shared_ptr<TransferEngine> released;
  {
    std::lock_guard lock(g_process_engine_mu);
    released = std::move(g_process_engine);
  }
}

}  // namespace rd2h::transfer

namespace rd2h::transfer {

namespace {
Status no_notifications(const TransferEngine& engine) {
  return failed_precondition("the '" + std::string(engine.backend_name()) +
                             "' transfer backend has no notifications");
}
}  // namespace

Status TransferEngine::listen_notifications(uint64_t) {
  return no_notifications(*this);
}
Status TransferEngine::open_notifications(const SessionHandle&, uint64_t) {
  return no_notifications(*this);
}
Status TransferEngine::send_notification(uint64_t, std::span<const std::byte>) {
  return no_notifications(*this);
}
void TransferEngine::close_notifications(uint64_t) {}
bool TransferEngine::get_notifications(std::vector<Notification>&, bool) {
  return true;
}

size_t TransferEngine::wait_notifications(std::vector<Notification>& out,
                                          std::chrono::milliseconds timeout) {
  const size_t before = out.size();
  const Deadline deadline(timeout);
  for (;;) {
    const bool armed = get_notifications(out);
    if (out.size() > before || deadline.expired()) return out.size() - before;
    if (!armed) continue;  // more may be in already
    const int fd = notification_fd();
    if (fd < 0) return 0;
    pollfd p{fd, POLLIN, 0};
    ::poll(&p, 1, deadline.remaining_ms());
  }
}

}  // namespace rd2h::transfer
