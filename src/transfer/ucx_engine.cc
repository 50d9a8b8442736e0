// UCX backend of TransferEngine: the facade over its parts.
//
// One ucp context per engine (ucx_context.h) and the memory registered in it
// (ucx_memory.h). A serving worker, whose address is exported, is progressed by its own
// thread (ucx_serving.h), so peers' reads are served without the application's help. Each
// session (ucx_session.h) has a worker of its own, progressed by the thread that reads on
// it (ucx_read.h): reads on different sessions do not contend. Notifications travel on
// the same connections (ucx_notifications.h).
#include <unistd.h>

#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <unordered_map>
#include <utility>

#include "common/format.h"
#include "rd2h/transfer/transfer_engine.h"
#include "transfer/peer_liveness.h"
#include "transfer/ucx_context.h"
#include "transfer/ucx_memory.h"
#include "transfer/ucx_metadata.h"
#include "transfer/ucx_notifications.h"
#include "transfer/ucx_read.h"
#include "transfer/ucx_serving.h"
#include "transfer/ucx_session.h"

namespace rd2h::transfer {

namespace {

std::string local_hostname() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

bool same_regions(const UcxMetadata& a, const UcxMetadata& b) {
  if (a.worker_address != b.worker_address || a.regions.size() != b.regions.size()) return false;
  for (size_t i = 0; i < a.regions.size(); ++i) {
    if (a.regions[i].base != b.regions[i].base || a.regions[i].length != b.regions[i].length ||
        a.regions[i].packed_rkey != b.regions[i].packed_rkey) {
      return false;
    }
  }
  return true;
}

class UcxEngine final : public TransferEngine {
 public:
  explicit UcxEngine(EngineConfig config) : config_(std::move(config)) {
    if (config_.hostname.empty()) config_.hostname = local_hostname();
    identity_ = HostIdentity::of_this_process();
    std::random_device rd;
    uint64_t nonce = (static_cast<uint64_t>(rd()) << 32) | rd();
    session_id_ = "ucx:" + config_.hostname + ":" + std::to_string(identity_.pid) + ":" +
                  hex(nonce).substr(2);
  }

  // In this order: the notification channels, the sessions, the serving worker (its unfinished
  // replies may still read registered memory), the registrations, the context.
  ~UcxEngine() override {
    notifications_.reset();
    if (serving_) serving_->stop();
    std::vector<std::shared_ptr<Session>> held;
    {
      std::lock_guard lock(sessions_mu_);
      for (const auto& w : made_) {
        if (auto s = w.lock()) held.push_back(std::move(s));
      }
      sessions_.clear();
      made_.clear();
    }
    // A handle may outlive the engine: what it holds is released here, with the context.
    for (const auto& s : held) {
      std::lock_guard lock(s->mu);
      (void)s->fail(failed_precondition("the transfer engine is gone"));
    }
    held.clear();
    serving_.reset();
    registrations_.reset();
    context_.reset();
  }

  Status init() {
    RD2H_TRY(context, create_ucx_context(config_));
    context_ = std::move(context);
    registrations_ = std::make_unique<Registrations>(context_.get(), config_);
    auto serving = ServingWorker::start(context_.get(), *registrations_);
    if (!serving) return serving.status().with_context("starting the serving worker");
    serving_ = std::move(*serving);
    auto notifications =
        EngineNotifications::create(*serving_, config_.connect_timeout, config_.read_timeout);
    if (!notifications) return notifications.status();
    notifications_ = std::move(*notifications);
    return Status::ok();
  }

  std::string_view backend_name() const override { return "ucx"; }
  const EngineConfig& config() const override { return config_; }
  const std::string& session_id() const override { return session_id_; }

  Status register_memory(void* addr, size_t length) override {
    return registrations_->add(addr, length, /*allocate=*/false).status();
  }

  Expected<MemoryRegion> allocate_memory(size_t length) override {
    return registrations_->add(nullptr, length, /*allocate=*/true);
  }

  Status unregister_memory(void* addr) override { return registrations_->remove(addr); }

  Expected<std::vector<std::byte>> export_metadata() const override {
    UcxMetadata m;
    m.session_id = session_id_;
    m.hostname = config_.hostname;
    m.transport = std::string(to_string(config_.transport));
    m.identity = identity_;
    m.worker_address = serving_->address();
    m.regions = registrations_->exported();
    return encode_ucx_metadata(m);
  }

  Expected<SessionHandle> connect(std::span<const std::byte> peer_metadata) override {
    RD2H_TRY(decoded, decode_ucx_metadata(peer_metadata));
    UcxMetadata peer = std::move(decoded);

    std::lock_guard connect_lock(connect_mu_);
    {
      std::lock_guard lock(sessions_mu_);
      auto it = sessions_.find(peer.session_id);
      if (it != sessions_.end() && !it->second->broken.load() &&
          same_regions(it->second->peer, peer)) {
        return SessionHandle{peer.session_id, it->second};
      }
    }
    auto session = std::make_shared<Session>();
    {
      std::lock_guard lock(session->mu);
      RD2H_RETURN_IF_ERROR(session->open(context_.get(), config_, identity_, std::move(peer)));
    }
    SessionHandle handle{session->id, session};
    std::lock_guard lock(sessions_mu_);
    std::erase_if(made_, [](const std::weak_ptr<Session>& w) { return w.expired(); });
    made_.push_back(session);
    sessions_[handle.id] = std::move(session);  // a replaced session is released with its last user
    return handle;
  }

  Status disconnect(const SessionHandle& session) override {
    RD2H_TRY(s, mine(session));
    {
      std::lock_guard lock(sessions_mu_);
      auto it = sessions_.find(session.id);
      if (it == sessions_.end() || it->second != s) return not_found("no session " + session.id);
      sessions_.erase(it);
    }
    std::lock_guard lock(s->mu);
    // A reader that found the session before it left the table sees it broken, not empty.
    (void)s->fail(failed_precondition("disconnected"));
    return Status::ok();
  }

  Expected<SessionInfo> session_info(const SessionHandle& session) const override {
    RD2H_TRY(s, mine(session));
    std::lock_guard lock(s->mu);
    SessionInfo info;
    info.session_id = s->id;
    info.transport = s->transport;
    info.colocated = s->colocated;
    info.broken = s->broken.load();
    info.broken_reason = s->broken_reason;
    return info;
  }

  Expected<std::unique_ptr<ReadRequest>> post_reads(const SessionHandle& session,
                                                    std::span<const ReadOp> ops) override {
    RD2H_TRY(s, mine(session));
    return transfer::post_reads(s, *registrations_, ops, config_.read_timeout);
  }

  bool supports_notifications() const override { return true; }
  Status listen_notifications(uint64_t channel) override { return notifications_->listen(channel); }
  Status open_notifications(const SessionHandle& session, uint64_t channel) override {
    RD2H_TRY(s, mine(session));
    return notifications_->open(s, channel);
  }
  Status send_notification(uint64_t channel, std::span<const std::byte> message) override {
    return notifications_->send(channel, message);
  }
  void close_notifications(uint64_t channel) override { notifications_->close(channel); }
  bool get_notifications(std::vector<Notification>& out, bool arm) override {
    return notifications_->poll(out, arm);
  }
  int notification_fd() override { return notifications_->fd(); }

 private:
  // The session behind a handle this engine gave out.
  static Expected<std::shared_ptr<Session>> mine(const SessionHandle& session) {
    auto s = std::dynamic_pointer_cast<Session>(session.state);
    if (!s) {
      return invalid_argument("session '" + session.id + "' is not a session of this UCX engine" +
                              (session.state ? "" : " (not connected)"));
    }
    return s;
  }

  EngineConfig config_;
  HostIdentity identity_;
  std::string session_id_;

  UcxContext context_;
  std::unique_ptr<Registrations> registrations_;
  std::unique_ptr<ServingWorker> serving_;

  std::mutex connect_mu_;  // one connect at a time, so two callers do not race to open one peer
  mutable std::mutex sessions_mu_;
  std::unordered_map<std::string, std::shared_ptr<Session>> sessions_;
  std::vector<std::weak_ptr<Session>> made_;  // every session given out that may still live

  std::unique_ptr<EngineNotifications> notifications_;
};

}  // namespace

Expected<std::unique_ptr<TransferEngine>> create_ucx_engine(const EngineConfig& config) {
  if (config.read_timeout.count() <= 0) {
    return invalid_argument("read_timeout must be positive, got " +
                            std::to_string(config.read_timeout.count()) + " ms");
  }
  if (config.connect_timeout.count() <= 0) {
    return invalid_argument("connect_timeout must be positive, got " +
                            std::to_string(config.connect_timeout.count()) + " ms");
  }
  if (config.device_id < 0) {
    return invalid_argument("device id must be >= 0, got " + std::to_string(config.device_id));
  }
  auto engine = std::make_unique<UcxEngine>(config);
  RD2H_RETURN_IF_ERROR(engine->init().with_context("UCX transfer engine"));
  return std::unique_ptr<TransferEngine>(std::move(engine));
}

}  // namespace rd2h::transfer
