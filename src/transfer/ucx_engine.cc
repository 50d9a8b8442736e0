// UCX backend of TransferEngine.
//
// One ucp context per engine. A "server" worker, whose address is exported, is progressed
// by the engine's own progress thread (event-driven: it sleeps on the worker's event fd),
// so peers' reads are served without the application's help. Each session has a worker of
// its own, progressed by the thread that reads on it: reads on different sessions do not
// contend, and a failed session is torn down by destroying its worker, which cancels
// whatever it had in flight without touching other sessions.
//
// Failure detection: UCX's shared-memory transports do not support peer error handling,
// and asking for it makes UCX fall back to TCP. So endpoints to co-located peers use no
// error handling and the session watches the peer process through a pidfd; endpoints to
// remote peers (or over TCP) use UCP_ERR_HANDLING_MODE_PEER. Every batch has a deadline.
//
// Read paths, chosen per region and session:
//  - mapped: a co-located peer's region is mapped into this process: by UCX (ucp_rkey_ptr)
//    where the peer's engine allocated it, or from the memfd a Prefill engine moved the
//    caller's registered pages into (shared_backing.h). A read is a copy, with no protocol
//    and no help from the peer.
//  - rma: ucp_get, where the endpoint's RMA lanes are hardware (RDMA).
//  - am: otherwise. UCX 1.13 emulates get in software on TCP and shared memory, and its
//    emulation aborts the serving process when a reader vanishes with reads in flight.
//    So the reader asks with an active message and the server answers each range with one,
//    whose failures UCX reports through callbacks like any send.
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <shared_mutex>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <utility>

#include "common/format.h"
#include "common/log.h"
#include "rd2h/common/deadline.h"
#include "rd2h/transfer/transfer_engine.h"
#include "transfer/peer_liveness.h"
#include "transfer/shared_backing.h"
#include "transfer/stream_copy.h"
#include "transfer/ucx_lanes.h"
#include "transfer/ucx_link.h"
#include "transfer/ucx_metadata.h"
#include "transfer/ucx_session.h"

namespace rd2h::transfer {

namespace {

// UCX settings for engines that move data over TCP, by the name ucp_config_modify takes
// (the environment variable is UCX_<name>, except that TCP_ options take it without TCP_).
struct UcxSetting {
  const char* name;
  const char* env;
  const char* value;
};
constexpr UcxSetting kTcpTuning[] = {
    {"TX_SEG_SIZE", "UCX_TCP_TX_SEG_SIZE", "1M"},
    {"RX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE", "2M"},
    {"ZCOPY_THRESH", "UCX_ZCOPY_THRESH", "inf"},
};

bool host_has_rdma() {
  std::error_code ec;
  std::filesystem::directory_iterator it("/sys/class/infiniband", ec);
  return !ec && it != std::filesystem::directory_iterator();
}

// The network interface that holds `host` (an address, or "localhost").
Expected<std::string> interface_of(const std::string& host) {
  addrinfo hints{};
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0 || found == nullptr) {
    return invalid_argument("cannot resolve the listen address " + host);
  }
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) != 0) {
    freeaddrinfo(found);
    return internal_error(std::string("getifaddrs: ") + std::strerror(errno));
  }
  std::string device;
  for (addrinfo* a = found; a != nullptr && device.empty(); a = a->ai_next) {
    for (ifaddrs* i = ifs; i != nullptr; i = i->ifa_next) {
      if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != a->ai_family) continue;
      const bool same =
          a->ai_family == AF_INET
              ? reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr ==
                    reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr.s_addr
              : a->ai_family == AF_INET6 &&
                    std::memcmp(&reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr,
                                &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr,
                                sizeof(in6_addr)) == 0;
      if (same) {
        device = i->ifa_name;
        break;
      }
    }
  }
  freeifaddrs(ifs);
  freeaddrinfo(found);
  if (device.empty()) {
    return invalid_argument("no network interface of this host has the address " + host);
  }
  return device;
}

Status ucs_error(std::string_view what, ucs_status_t st) {
  return transport_error(std::string(what) + ": " + ucs_status_string(st));
}

std::string local_hostname() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

// Replies the server is sending from one registration. UCX reads a reply's bytes until
// its send completes, so unregistering waits for them to drain.
struct ReplyTracker {
  std::mutex mu;
  std::condition_variable drained;
  int in_flight = 0;

  void add() {
    std::lock_guard lock(mu);
    ++in_flight;
  }
  void done() {
    {
      std::lock_guard lock(mu);
      --in_flight;
    }
    drained.notify_all();
  }
  bool wait_drained(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mu);
    return drained.wait_for(lock, timeout, [this] { return in_flight == 0; });
  }
};

struct LocalRegistration {
  uint64_t length = 0;
  ucp_mem_h memh = nullptr;
  std::vector<std::byte> packed_rkey;
  // Caller memory moved into a memfd for co-located readers (fd -1: none), owned.
  SharedBacking shared;
  uint64_t file_offset = 0;  // of the registration's start in the memfd
  std::shared_ptr<ReplyTracker> replies = std::make_shared<ReplyTracker>();
};

// One reply of the am read path while UCX sends it.
struct AmReply {
  AmReadReplyHeader header;
  std::shared_ptr<ReplyTracker> tracker;  // null for a refusal, which carries no data

  void finish() {
    if (tracker) tracker->done();
    delete this;
  }
};

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

  ~UcxEngine() override { shutdown(); }

  Status init() {
    ucp_config_t* cfg = nullptr;
    ucs_status_t st = ucp_config_read(nullptr, nullptr, &cfg);
    if (st != UCS_OK) return ucs_error("ucp_config_read", st);
    const char* tls = nullptr;
    if (config_.transport == Transport::kShm) tls = "sm";
    if (config_.transport == Transport::kTcp) tls = "tcp";
    if (tls != nullptr) {
      st = ucp_config_modify(cfg, "TLS", tls);
      if (st != UCS_OK) {
        ucp_config_release(cfg);
        return ucs_error("setting UCX transports", st);
      }
    }
    if (!config_.listen_host.empty() && std::getenv("UCX_NET_DEVICES") == nullptr) {
      auto device = interface_of(config_.listen_host);
      if (!device) {
        ucp_config_release(cfg);
        return device.status();
      }
      st = ucp_config_modify(cfg, "NET_DEVICES", device->c_str());
      if (st != UCS_OK) {
        ucp_config_release(cfg);
        return ucs_error("setting UCX's network device to " + *device, st);
      }
    }
    // Reads over TCP are active messages of at most one TX segment each (8 KiB by default);
    // larger segments cut per-message overhead several-fold. Zero-copy sends are off: UCX
    // 1.13 aborts a process whose TCP zero-copy sends are purged when a reader vanishes.
    // Without RDMA, "auto" reaches other hosts over TCP and gets the same settings. Whatever
    // the UCX_* environment sets stays as set.
    const bool over_tcp = config_.transport == Transport::kTcp ||
                          (config_.transport == Transport::kAuto && !host_has_rdma());
    if (over_tcp) {
      for (const auto& setting : kTcpTuning) {
        if (std::getenv(setting.env) != nullptr) continue;
        st = ucp_config_modify(cfg, setting.name, setting.value);
        if (st != UCS_OK) {
          ucp_config_release(cfg);
          return ucs_error(std::string("setting ") + setting.env, st);
        }
      }
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 1;
    st = ucp_init(&params, cfg, &context_);
    ucp_config_release(cfg);
    if (st != UCS_OK) {
      context_ = nullptr;
      return ucs_error("ucp_init (transport " + std::string(to_string(config_.transport)) + ")",
                       st);
    }

    auto server = create_worker();
    if (!server) return server.status().with_context("creating the serving worker");
    server_worker_ = *server;
    RD2H_RETURN_IF_ERROR(set_am_handler(server_worker_, kAmReadRequest, on_am_read_request, this));
    served_links_ = std::make_unique<ServedLinks>(server_worker_);
    RD2H_RETURN_IF_ERROR(served_links_->install());
    ucp_worker_attr_t attr{};
    attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
    st = ucp_worker_query(server_worker_, &attr);
    if (st != UCS_OK) return ucs_error("ucp_worker_query", st);
    const auto* a = reinterpret_cast<const std::byte*>(attr.address);
    server_address_.assign(a, a + attr.address_length);
    ucp_worker_release_address(server_worker_, attr.address);

    RD2H_RETURN_IF_ERROR(start_progress_thread());
    return Status::ok();
  }

  std::string_view backend_name() const override { return "ucx"; }
  const EngineConfig& config() const override { return config_; }
  const std::string& session_id() const override { return session_id_; }

  Status register_memory(void* addr, size_t length) override {
    return add_registration(addr, length, /*allocate=*/false).status();
  }

  Expected<MemoryRegion> allocate_memory(size_t length) override {
    return add_registration(nullptr, length, /*allocate=*/true);
  }

  Status unregister_memory(void* addr) override {
    const auto base = reinterpret_cast<uintptr_t>(addr);
    std::unique_lock lock(regs_mu_);
    auto it = regs_.find(base);
    if (it == regs_.end()) return not_found("no registration starts at " + hex(base));
    // Out of the table first, so no new reply is sent from it; then wait for those in flight.
    LocalRegistration reg = std::move(it->second);
    regs_.erase(it);
    lock.unlock();
    const std::string range = range_text(base, reg.length);
    Status result;
    if (!reg.replies->wait_drained(config_.read_timeout)) {
      result = timeout_error("replies from " + range + " were still being sent after " +
                             std::to_string(config_.read_timeout.count()) +
                             " ms; the range stays registered");
    } else if (ucs_status_t st = ucp_mem_unmap(context_, reg.memh); st != UCS_OK) {
      result = ucs_error("unregistering " + range + " (it stays registered)", st);
    } else {
      // Its pages stay shared-backed for the caller; readers that mapped them see it gone.
      reg.shared.release();
      return Status::ok();
    }
    lock.lock();
    regs_.emplace(base, std::move(reg));
    return result;
  }

  Expected<std::vector<std::byte>> export_metadata() const override {
    UcxMetadata m;
    m.session_id = session_id_;
    m.hostname = config_.hostname;
    m.transport = std::string(to_string(config_.transport));
    m.identity = identity_;
    m.worker_address = server_address_;
    std::shared_lock lock(regs_mu_);
    for (const auto& [base, reg] : regs_) {
      m.regions.push_back({base, reg.length, reg.packed_rkey, reg.shared.fd, reg.shared.inode,
                           reg.file_offset, reg.shared.live_offset});
    }
    return encode_ucx_metadata(m);
  }

  Expected<std::string> connect(std::span<const std::byte> peer_metadata) override {
    auto decoded = decode_ucx_metadata(peer_metadata);
    if (!decoded) return decoded.status();
    UcxMetadata peer = std::move(*decoded);

    std::lock_guard connect_lock(connect_mu_);
    {
      std::lock_guard lock(sessions_mu_);
      auto it = sessions_.find(peer.session_id);
      if (it != sessions_.end() && !it->second->broken.load() &&
          same_regions(it->second->peer, peer)) {
        return peer.session_id;
      }
    }
    auto session = std::make_shared<Session>();
    RD2H_RETURN_IF_ERROR(open_session(*session, std::move(peer)));
    std::string id = session->id;
    std::lock_guard lock(sessions_mu_);
    sessions_[id] = std::move(session);  // a replaced session is released with its last user
    return id;
  }

  Status disconnect(std::string_view session) override {
    std::shared_ptr<Session> s;
    {
      std::lock_guard lock(sessions_mu_);
      auto it = sessions_.find(std::string(session));
      if (it == sessions_.end()) return not_found("no session " + std::string(session));
      s = std::move(it->second);
      sessions_.erase(it);
    }
    std::lock_guard lock(s->mu);
    // A reader that found the session before it left the table sees it broken, not empty.
    s->mark_broken(failed_precondition("disconnected"));
    s->release();
    return Status::ok();
  }

  Expected<SessionInfo> session_info(std::string_view session) const override {
    auto s = find_session(session);
    if (!s) return not_found("no session " + std::string(session));
    std::lock_guard lock(s->mu);
    SessionInfo info;
    info.session_id = s->id;
    info.transport = s->transport;
    info.colocated = s->colocated;
    info.broken = s->broken.load();
    info.broken_reason = s->broken_reason;
    return info;
  }

  Status batch_read_sync(std::string_view session, std::span<const uintptr_t> local,
                         std::span<const uintptr_t> remote,
                         std::span<const size_t> length) override {
    if (local.size() != remote.size() || local.size() != length.size()) {
      return invalid_argument("batch_read_sync: " + std::to_string(local.size()) +
                              " local addresses, " + std::to_string(remote.size()) +
                              " remote addresses and " + std::to_string(length.size()) +
                              " lengths; they must match");
    }
    auto s = find_session(session);
    if (!s) return not_found("batch_read_sync: no session " + std::string(session));
    std::lock_guard session_lock(s->mu);
    if (s->broken.load()) {
      return failed_precondition("session " + s->id + " is broken (" + s->broken_reason +
                                 "); connect again to read");
    }
    // Held for the whole batch so no local registration disappears under a read.
    std::shared_lock regs_lock(regs_mu_);

    std::vector<ucp_mem_h> local_memh(local.size());
    std::vector<ucp_rkey_h> rkey(local.size());
    std::vector<const std::byte*> mapped_src(local.size());
    for (size_t i = 0; i < local.size(); ++i) {
      if (length[i] == 0) continue;
      auto op = [i] { return "read " + std::to_string(i) + ": "; };
      if (local[i] + length[i] < local[i] || remote[i] + length[i] < remote[i]) {
        return out_of_range(op() + "length " + std::to_string(length[i]) +
                            " wraps the address space");
      }
      const LocalRegistration* reg = find_local(local[i], length[i]);
      if (reg == nullptr) {
        return out_of_range(op() + "local range " + range_text(local[i], length[i]) +
                            " is not inside one local registration");
      }
      local_memh[i] = reg->memh;
      auto region = find_remote(*s, remote[i], length[i]);
      if (region < 0) {
        return out_of_range(op() + "remote range " + range_text(remote[i], length[i]) +
                            " is not inside one region exported by " + s->id);
      }
      const auto r = static_cast<size_t>(region);
      rkey[i] = s->rkeys[r];
      if (r < s->file_maps.size() && s->file_maps[r].data() != nullptr && !s->file_maps[r].live()) {
        // What a serving peer would answer: checked before anything is read.
        return fail_session(
            *s, out_of_range(op() + "remote range " + range_text(remote[i], length[i]) + " of " +
                             s->id + ": range not registered there (any more)"));
      }
      if (s->mapped[r] != nullptr)
        mapped_src[i] = s->mapped[r] + (remote[i] - s->peer.regions[r].base);
    }

    if (s->watch.exited()) return fail_session(*s, peer_dead("peer " + s->id + " has exited"));

    Deadline deadline(config_.read_timeout);
    BatchState batch;
    s->active = &batch;
    struct ClearActive {
      Session* s;
      ~ClearActive() { s->active = nullptr; }
    } clear_active{s.get()};
    batch.id = s->next_batch_id++;
    batch.local = local;
    batch.length = length;
    ucs_status_t post_error = UCS_OK;
    if (s->rma_get) {
      post_error = post_rma_reads(*s, batch, local, remote, length, mapped_src, local_memh, rkey);
    } else {
      post_error = post_am_requests(*s, batch, remote, length, mapped_src);
    }

    // Mapped reads are copied while the posted ones are in flight.
    if (post_error == UCS_OK) {
      for (size_t i = 0; i < local.size(); ++i) {
        if (mapped_src[i] != nullptr && length[i] != 0) {
          stream_copy(reinterpret_cast<void*>(local[i]), mapped_src[i], length[i]);
        }
      }
      stream_copy_fence();
    }

    // Busy-polls: this thread exists to drive its reads. Liveness is checked once a
    // millisecond, not on every spin. After a failed post nothing is awaited: the session's
    // teardown cancels what was posted.
    auto next_check = Deadline::Clock::now();
    while (batch.outstanding > 0 && post_error == UCS_OK) {
      ucp_worker_progress(s->worker);
      auto now = Deadline::Clock::now();
      if (now < next_check) continue;
      next_check = now + std::chrono::milliseconds(1);
      if (s->ep_error != UCS_OK) break;
      if (s->watch.exited()) {
        return fail_session(*s, peer_dead("peer " + s->id + " exited during a batch of " +
                                          std::to_string(local.size()) + " reads"));
      }
      if (deadline.expired()) {
        return fail_session(
            *s, timeout_error("batch of " + std::to_string(local.size()) + " reads from " + s->id +
                              " took longer than " + std::to_string(config_.read_timeout.count()) +
                              " ms; " + std::to_string(batch.outstanding) + " still in flight"));
      }
    }
    if (s->ep_error != UCS_OK) {
      return fail_session(
          *s, peer_dead("connection to " + s->id + " failed: " + ucs_status_string(s->ep_error)));
    }
    if (post_error != UCS_OK) {
      return fail_session(*s, ucs_error("posting a read to " + s->id, post_error));
    }
    if (!batch.refusal.empty()) {
      return fail_session(*s, out_of_range(batch.refusal + " (" + s->id + ")"));
    }
    if (batch.first_error != UCS_OK) {
      return fail_session(*s, ucs_error("read from " + s->id, batch.first_error));
    }
    if (s->watch.exited()) {
      return fail_session(*s, peer_dead("peer " + s->id + " exited before the batch completed"));
    }
    return Status::ok();
  }

  bool supports_links() const override { return true; }

  Status expect_link(uint64_t token, LinkHandler handler) override {
    std::lock_guard lock(link_tokens_mu_);
    if (link_sessions_.count(token) != 0) return token_taken(token);
    return served_links_->expect(token, std::move(handler));
  }

  Status open_link(std::string_view session, uint64_t token, LinkHandler handler) override {
    auto s = find_session(session);
    if (!s) return not_found("open_link: no session " + std::string(session));
    RD2H_RETURN_IF_ERROR(start_link_thread());
    {
      std::lock_guard lock(link_tokens_mu_);
      if (link_sessions_.count(token) != 0 || served_links_->has(token)) return token_taken(token);
      link_sessions_[token] = s;
    }
    Status st = open_session_link(s, token, std::move(handler));
    if (!st) {
      std::lock_guard lock(link_tokens_mu_);
      link_sessions_.erase(token);
    }
    return st;
  }

  Status send_on_link(uint64_t token, std::span<const std::byte> message) override {
    if (message.size() > kMaxLinkMessageBytes) {
      return invalid_argument("a link message of " + std::to_string(message.size()) +
                              " bytes is over the limit of " +
                              std::to_string(kMaxLinkMessageBytes));
    }
    if (served_links_->has(token)) return served_links_->send(token, message);
    std::shared_ptr<Session> s;
    {
      std::lock_guard lock(link_tokens_mu_);
      auto it = link_sessions_.find(token);
      if (it != link_sessions_.end()) s = it->second.lock();
    }
    const auto closed = [token] {
      return failed_precondition("link " + std::to_string(token) + " is not open");
    };
    if (!s) return closed();
    std::lock_guard lock(s->mu);
    if (s->worker == nullptr || s->links.count(token) == 0) return closed();
    const LinkMessageHeader h{token};
    return send_and_wait(*s, kAmLinkMessage, &h, sizeof(h), message, config_.read_timeout);
  }

  int link_fd() override {
    std::lock_guard lock(link_thread_mu_);
    return make_link_fds().is_ok() ? driver_epoll_fd_ : -1;
  }

  void drive_links(bool on) override {
    if (on) {
      ++link_drivers_;
      return;
    }
    --link_drivers_;
    wake_link_thread();
  }

  bool progress_links() override {
    const bool sessions = progress_sessions();
    // One progress of the serving worker, which may be busy serving reads: a driver comes
    // back to check what it waits for, and calls again.
    std::lock_guard lock(served_links_->mu);
    const unsigned events = ucp_worker_progress(server_worker_);
    served_links_->after_progress();
    return events == 0 && ucp_worker_arm(server_worker_) != UCS_ERR_BUSY && sessions;
  }

  void close_link(uint64_t token) override {
    served_links_->close(token);
    std::shared_ptr<Session> s;
    {
      std::lock_guard lock(link_tokens_mu_);
      auto it = link_sessions_.find(token);
      if (it == link_sessions_.end()) return;
      s = it->second.lock();
      link_sessions_.erase(it);
    }
    if (!s) return;
    std::lock_guard lock(s->mu);
    s->links.erase(token);
  }

 private:
  static Status token_taken(uint64_t token) {
    return already_exists("link " + std::to_string(token) + " is in use on this engine");
  }

  Status open_session_link(const std::shared_ptr<Session>& s, uint64_t token, LinkHandler handler) {
    std::lock_guard lock(s->mu);
    if (s->broken.load() || s->worker == nullptr) {
      return failed_precondition("session " + s->id + " is broken (" + s->broken_reason +
                                 "); connect again to open a link");
    }
    // Known before the peer can answer: nobody progresses the worker until this returns.
    s->links[token] = std::move(handler);
    const LinkOpenHeader h{token, s->err_mode == UCP_ERR_HANDLING_MODE_PEER ? 1u : 0u, 0};
    if (Status st = send_and_wait(*s, kAmLinkOpen, &h, sizeof(h), s->worker_address,
                                  config_.connect_timeout);
        !st) {
      s->links.erase(token);
      return st.with_context("opening link " + std::to_string(token));
    }
    if (!s->watched) {
      int fd = -1;
      if (ucs_status_t st = ucp_worker_get_efd(s->worker, &fd); st != UCS_OK) {
        s->links.erase(token);
        return ucs_error("ucp_worker_get_efd", st);
      }
      epoll_event ev{};
      ev.events = EPOLLIN;
      if (::epoll_ctl(link_epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0 ||
          ::epoll_ctl(driver_epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
        s->links.erase(token);
        return internal_error("epoll_ctl(session worker fd) failed");
      }
      s->watched = true;
      std::lock_guard watch_lock(link_thread_mu_);
      watched_.push_back(s);
      wake_link_thread();  // it arms the new worker before it sleeps again
    }
    return Status::ok();
  }

  // Sends one eager active message on the session's endpoint and progresses the session's
  // worker until it is sent (within `timeout`); a failure breaks the session. Caller holds
  // s.mu.
  Status send_and_wait(Session& s, uint16_t id, const void* header, size_t header_length,
                       std::span<const std::byte> data, std::chrono::milliseconds timeout) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_EAGER;
    void* req = ucp_am_send_nbx(s.ep, id, header, header_length, data.data(), data.size(), &p);
    if (req == nullptr) return Status::ok();
    if (UCS_PTR_IS_ERR(req)) {
      return fail_session(s, peer_dead("sending to " + s.id +
                                       " failed: " + ucs_status_string(UCS_PTR_STATUS(req))));
    }
    Deadline deadline(timeout);
    auto next_check = Deadline::Clock::now();
    Status result = Status::ok();
    while (ucp_request_check_status(req) == UCS_INPROGRESS) {
      ucp_worker_progress(s.worker);
      const auto now = Deadline::Clock::now();
      if (now < next_check) continue;
      next_check = now + std::chrono::milliseconds(1);
      if (s.ep_error != UCS_OK || s.watch.exited()) {
        result = peer_dead("peer " + s.id + " failed while a message was sent to it");
        break;
      }
      if (deadline.expired()) {
        result = timeout_error("a message to " + s.id + " was not sent within " +
                               std::to_string(timeout.count()) + " ms");
        break;
      }
    }
    if (result.is_ok()) {
      if (ucs_status_t st = ucp_request_check_status(req); st != UCS_OK) {
        result = peer_dead("sending to " + s.id + " failed: " + ucs_status_string(st));
      }
    }
    ucp_request_free(req);  // one still in flight goes with the worker, next
    return result.is_ok() ? result : fail_session(s, std::move(result));
  }

  void wake_link_thread() {
    if (link_wake_fd_ < 0) return;
    uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(link_wake_fd_, &one, sizeof(one));
  }

  Status start_link_thread() {
    std::lock_guard lock(link_thread_mu_);
    RD2H_RETURN_IF_ERROR(make_link_fds());
    if (!link_thread_.joinable()) link_thread_ = std::thread([this] { link_loop(); });
    return Status::ok();
  }

  // The link thread's epoll set (the sessions' worker fds and its wake-up fd) and a driver's
  // (the same sessions, and the serving worker). Caller holds link_thread_mu_.
  Status make_link_fds() {
    if (driver_epoll_fd_ >= 0) return Status::ok();
    link_epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
    link_wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    const int driver = ::epoll_create1(EPOLL_CLOEXEC);
    if (link_epoll_fd_ < 0 || link_wake_fd_ < 0 || driver < 0) {
      if (driver >= 0) ::close(driver);
      return internal_error("cannot create the links' fds");
    }
    epoll_event ev{};
    ev.events = EPOLLIN;
    if (::epoll_ctl(link_epoll_fd_, EPOLL_CTL_ADD, link_wake_fd_, &ev) != 0 ||
        ::epoll_ctl(driver, EPOLL_CTL_ADD, worker_efd_, &ev) != 0) {
      ::close(driver);
      return internal_error("epoll_ctl(links) failed");
    }
    driver_epoll_fd_ = driver;
    return Status::ok();
  }

  // Progresses the workers of sessions with links while nobody reads on them, sleeping on
  // their event fds, unless a caller drives them. A session being read is progressed by its
  // reader meanwhile, which delivers its link messages just the same.
  void link_loop() {
    while (!links_stopping_.load()) {
      if (link_drivers_.load() > 0) {
        pollfd wake{link_wake_fd_, POLLIN, 0};
        ::poll(&wake, 1, 100);
      } else if (progress_sessions()) {
        epoll_event events[8];
        // The timeout only bounds how long a missed wake-up could delay a message.
        ::epoll_wait(link_epoll_fd_, events, 8, 100);
      }
      uint64_t count;
      [[maybe_unused]] auto n = ::read(link_wake_fd_, &count, sizeof(count));
    }
  }

  // One pass over the sessions with links: progresses each and arms it for its event fd.
  // False when one had more events already (no time to sleep).
  bool progress_sessions() {
    std::vector<std::shared_ptr<Session>> sessions;
    {
      std::lock_guard lock(link_thread_mu_);
      std::erase_if(watched_, [](const std::weak_ptr<Session>& w) { return w.expired(); });
      for (const auto& w : watched_) {
        if (auto s = w.lock()) sessions.push_back(std::move(s));
      }
    }
    bool armed = true;
    std::vector<const Session*> released;
    for (const auto& s : sessions) {
      std::lock_guard lock(s->mu);
      if (s->worker == nullptr) {
        released.push_back(s.get());
        continue;
      }
      while (ucp_worker_progress(s->worker) != 0) {
      }
      if (ucp_worker_arm(s->worker) == UCS_ERR_BUSY) armed = false;
    }
    if (!released.empty()) {
      // A released session's worker is gone: it is not watched any more.
      std::lock_guard lock(link_thread_mu_);
      std::erase_if(watched_, [&](const std::weak_ptr<Session>& w) {
        auto s = w.lock();
        return !s || std::find(released.begin(), released.end(), s.get()) != released.end();
      });
    }
    return armed;  // a session dropped meanwhile is released with `sessions`, not held
  }

  static ucs_status_t post_rma_reads(Session& s, BatchState& batch,
                                     std::span<const uintptr_t> local,
                                     std::span<const uintptr_t> remote,
                                     std::span<const size_t> length,
                                     const std::vector<const std::byte*>& mapped_src,
                                     const std::vector<ucp_mem_h>& local_memh,
                                     const std::vector<ucp_rkey_h>& rkey) {
    ucp_request_param_t param{};
    param.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
    param.cb.send = on_request_done;
    param.user_data = &batch;
    for (size_t i = 0; i < local.size(); ++i) {
      if (length[i] == 0 || mapped_src[i] != nullptr) continue;
      param.memh = local_memh[i];
      void* req = ucp_get_nbx(s.ep, reinterpret_cast<void*>(local[i]), length[i], remote[i],
                              rkey[i], &param);
      if (req == nullptr) continue;
      if (UCS_PTR_IS_ERR(req)) return UCS_PTR_STATUS(req);
      ++batch.outstanding;
    }
    return UCS_OK;
  }

  // Asks the peer for every non-mapped range, up to kAmRangesPerRequest per message. Each
  // range then counts as outstanding until its reply has landed.
  static ucs_status_t post_am_requests(Session& s, BatchState& batch,
                                       std::span<const uintptr_t> remote,
                                       std::span<const size_t> length,
                                       const std::vector<const std::byte*>& mapped_src) {
    batch.answered.assign(remote.size(), 1);
    auto& requests = s.am_requests;
    requests.clear();
    for (size_t i = 0; i < remote.size(); ++i) {
      if (length[i] == 0 || mapped_src[i] != nullptr) continue;
      // Ranges of one request are indexed from its first_index, so the cap counts gaps too.
      if (requests.empty() || i - requests.back().header.first_index >= kAmRangesPerRequest) {
        requests.push_back({{batch.id, static_cast<uint32_t>(i), 0}, {}});
        requests.back().ranges.reserve(kAmRangesPerRequest);
      }
      auto& r = requests.back();
      // Indices in one request are consecutive from first_index, so gaps are sent as
      // zero-length ranges the server answers without data.
      while (r.header.first_index + r.ranges.size() < i) r.ranges.push_back({0, 0});
      r.ranges.push_back({remote[i], length[i]});
      batch.answered[i] = 0;
      ++batch.outstanding;
    }
    ucp_request_param_t param{};
    param.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    param.cb.send = on_request_done;
    param.user_data = &batch;
    param.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    for (auto& r : requests) {
      r.header.count = static_cast<uint32_t>(r.ranges.size());
      void* req = ucp_am_send_nbx(s.ep, kAmReadRequest, &r.header, sizeof(r.header),
                                  r.ranges.data(), r.ranges.size() * sizeof(AmRange), &param);
      if (req == nullptr) continue;
      if (UCS_PTR_IS_ERR(req)) return UCS_PTR_STATUS(req);
      ++batch.outstanding;
    }
    return UCS_OK;
  }

  // Server side of the am path, on the progress thread: answers each requested range with
  // its bytes, straight from registered memory.
  static ucs_status_t on_am_read_request(void* arg, const void* header, size_t header_length,
                                         void* data, size_t length,
                                         const ucp_am_recv_param_t* param) {
    auto* engine = static_cast<UcxEngine*>(arg);
    // Requests are sent eager; anything else is not ours, and returning UCS_OK without
    // receiving it lets UCX drop it.
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) return UCS_OK;
    AmReadRequestHeader h;
    if (header_length != sizeof(h) || (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0) {
      return UCS_OK;
    }
    std::memcpy(&h, header, sizeof(h));
    if (length != static_cast<size_t>(h.count) * sizeof(AmRange)) return UCS_OK;
    std::shared_lock lock(engine->regs_mu_);
    for (uint32_t k = 0; k < h.count; ++k) {
      AmRange range;
      std::memcpy(&range, static_cast<const std::byte*>(data) + k * sizeof(AmRange), sizeof(range));
      if (range.length == 0) continue;
      const LocalRegistration* reg = range.addr + range.length >= range.addr
                                         ? engine->find_local(range.addr, range.length)
                                         : nullptr;
      auto* reply = new AmReply{{h.batch_id, h.first_index + k, reg == nullptr ? 1u : 0u},
                                reg == nullptr ? nullptr : reg->replies};
      if (reply->tracker) reply->tracker->add();
      ucp_request_param_t p{};
      p.op_attr_mask =
          UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
      // Eager: UCX 1.13's rendezvous over TCP can abort the sender when the reader vanishes
      // mid-transfer; eager sends fail through their callback instead.
      p.flags = UCP_AM_SEND_FLAG_EAGER;
      p.cb.send = [](void* request, ucs_status_t, void* user_data) {
        static_cast<AmReply*>(user_data)->finish();
        ucp_request_free(request);
      };
      p.user_data = reply;
      void* req =
          ucp_am_send_nbx(param->reply_ep, kAmReadReply, &reply->header, sizeof(reply->header),
                          reg != nullptr ? reinterpret_cast<const void*>(range.addr) : nullptr,
                          reg != nullptr ? range.length : 0, &p);
      if (req == nullptr) {
        reply->finish();
      } else if (UCS_PTR_IS_ERR(req)) {
        reply->finish();
        break;  // the reader is gone; its other ranges need no answer
      }
    }
    return UCS_OK;
  }

  Expected<ucp_worker_h> create_worker() {
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    ucp_worker_h w = nullptr;
    ucs_status_t st = ucp_worker_create(context_, &wp, &w);
    if (st != UCS_OK) return ucs_error("ucp_worker_create", st);
    return w;
  }

  Expected<MemoryRegion> add_registration(void* addr, size_t length, bool allocate) {
    if (length == 0) return invalid_argument("cannot register a zero-length range");
    if (!allocate && addr == nullptr) return invalid_argument("cannot register a null address");
    auto base = reinterpret_cast<uintptr_t>(addr);
    if (!allocate && base + length < base) {
      return invalid_argument("range " + range_text(base, length) + " wraps the address space");
    }

    std::unique_lock lock(regs_mu_);
    if (!allocate) {
      if (auto conflict = overlapping(base, length)) {
        return already_exists("range " + range_text(base, length) + " overlaps registered range " +
                              range_text(conflict->first, conflict->second.length));
      }
    }

    // A Prefill's own KV memory is read by co-located Decode processes: its pages move into
    // a memfd they map, so those reads need nothing of this process. Where they cannot move
    // (a file or shared mapping), readers are answered over the am path.
    std::optional<SharedBacking> shared;
    if (!allocate && config_.role == Role::kPrefill && config_.transport != Transport::kTcp &&
        config_.share_registered) {
      auto moved = share_in_place(addr, length);
      if (moved) {
        shared = *moved;
      } else {
        log::info("transfer: {}; co-located peers read it through this process",
                  moved.status().message());
      }
    }
    struct ReleaseUnlessKept {
      std::optional<SharedBacking>& shared;
      ~ReleaseUnlessKept() {
        if (shared) shared->release();
      }
    } release_unless_kept{shared};

    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                    UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.address = addr;
    mp.length = length;
    mp.flags = allocate ? UCP_MEM_MAP_ALLOCATE : 0;
    ucp_mem_h memh = nullptr;
    ucs_status_t st = ucp_mem_map(context_, &mp, &memh);
    if (st != UCS_OK) {
      return ucs_error((allocate ? "allocating " : "registering ") + range_text(base, length), st);
    }
    ucp_mem_attr_t attr{};
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    st = ucp_mem_query(memh, &attr);
    if (st != UCS_OK) {
      ucp_mem_unmap(context_, memh);
      return ucs_error("ucp_mem_query", st);
    }
    void* rkey_buf = nullptr;
    size_t rkey_size = 0;
    st = ucp_rkey_pack(context_, memh, &rkey_buf, &rkey_size);
    if (st != UCS_OK) {
      ucp_mem_unmap(context_, memh);
      return ucs_error("ucp_rkey_pack", st);
    }
    LocalRegistration reg;
    reg.memh = memh;
    // Expose exactly what the caller asked for, even if UCX rounded the allocation up.
    reg.length = length;
    const auto* rb = static_cast<const std::byte*>(rkey_buf);
    reg.packed_rkey.assign(rb, rb + rkey_size);
    ucp_rkey_buffer_release(rkey_buf);

    // Caller memory is known by the caller's address (UCX may report its page instead).
    const uintptr_t actual = allocate ? reinterpret_cast<uintptr_t>(attr.address) : base;
    if (allocate && overlapping(actual, length)) {
      // Cannot happen for fresh memory unless a caller registered a range it did not own.
      ucp_mem_unmap(context_, memh);
      return internal_error("allocated memory " + range_text(actual, length) +
                            " overlaps an existing registration");
    }
    if (shared) {
      reg.shared = *shared;
      reg.file_offset = actual - shared->base;
      shared.reset();  // the registration owns it now
    }
    regs_.emplace(actual, std::move(reg));
    return MemoryRegion{reinterpret_cast<void*>(actual), length};
  }

  // The registration overlapping [base, base+len), if any. Caller holds regs_mu_.
  const std::pair<const uintptr_t, LocalRegistration>* overlapping(uintptr_t base,
                                                                   size_t len) const {
    auto it = regs_.lower_bound(base + len);  // first registration starting at or after end
    if (it == regs_.begin()) return nullptr;
    --it;
    if (it->first + it->second.length > base) return &*it;
    return nullptr;
  }

  // The registration covering the whole range, or null. Caller holds regs_mu_.
  const LocalRegistration* find_local(uintptr_t addr, size_t len) const {
    auto it = regs_.upper_bound(addr);
    if (it == regs_.begin()) return nullptr;
    --it;
    if (addr + len > it->first + it->second.length) return nullptr;
    return &it->second;
  }

  static int64_t find_remote(const Session& s, uint64_t addr, uint64_t len) {
    const auto& regions = s.peer.regions;
    auto it = std::upper_bound(regions.begin(), regions.end(), addr,
                               [](uint64_t a, const ExportedRegion& r) { return a < r.base; });
    if (it == regions.begin()) return -1;
    --it;
    if (addr + len > it->base + it->length) return -1;
    return it - regions.begin();
  }

  static bool same_regions(const UcxMetadata& a, const UcxMetadata& b) {
    if (a.worker_address != b.worker_address || a.regions.size() != b.regions.size()) return false;
    for (size_t i = 0; i < a.regions.size(); ++i) {
      if (a.regions[i].base != b.regions[i].base || a.regions[i].length != b.regions[i].length ||
          a.regions[i].packed_rkey != b.regions[i].packed_rkey) {
        return false;
      }
    }
    return true;
  }

  std::shared_ptr<Session> find_session(std::string_view id) const {
    std::lock_guard lock(sessions_mu_);
    auto it = sessions_.find(std::string(id));
    return it == sessions_.end() ? nullptr : it->second;
  }

  // Marks the session broken, cancels its in-flight reads, and returns `why`.
  // Caller holds s.mu.
  static Status fail_session(Session& s, Status why) {
    s.mark_broken(why);
    s.release();
    return why;
  }

  Status open_session(Session& s, UcxMetadata peer) {
    s.id = peer.session_id;
    s.colocated = identity_.same_host_as(peer.identity);
    if (config_.transport == Transport::kShm && !s.colocated) {
      return unreachable("peer " + s.id + " runs on host " + peer.hostname +
                         ", but shared memory reaches only peers on this host (" +
                         config_.hostname + "); use transport tcp or auto");
    }
    if (s.colocated) {
      auto watch = ProcessWatch::open(peer.identity.pid, peer.identity.start_time);
      if (!watch) return watch.status().with_context("connecting to " + s.id);
      s.watch = std::move(*watch);
    }
    // Peer error handling would force UCX off shared memory, so it is used only where the
    // peer is reached over a network transport; co-located peers are watched by pidfd.
    bool network = config_.transport == Transport::kTcp || !s.colocated;
    s.err_mode = network ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;

    auto worker = create_worker();
    if (!worker) return worker.status().with_context("connecting to " + s.id);
    s.worker = *worker;
    RD2H_RETURN_IF_ERROR(set_am_handler(s.worker, kAmReadReply, on_am_read_reply, &s));
    RD2H_RETURN_IF_ERROR(set_am_handler(s.worker, kAmLinkMessage, on_am_link_message, &s));
    ucp_worker_attr_t attr{};
    attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
    ucs_status_t hst = ucp_worker_query(s.worker, &attr);
    if (hst != UCS_OK) return ucs_error("ucp_worker_query", hst);
    const auto* address = reinterpret_cast<const std::byte*>(attr.address);
    s.worker_address.assign(address, address + attr.address_length);
    ucp_worker_release_address(s.worker, attr.address);

    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.address = reinterpret_cast<const ucp_address_t*>(peer.worker_address.data());
    ep.err_mode = s.err_mode;
    if (s.err_mode == UCP_ERR_HANDLING_MODE_PEER) {
      ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.err_handler.cb = on_endpoint_error;
      ep.err_handler.arg = &s;
    }
    ucs_status_t st = ucp_ep_create(s.worker, &ep, &s.ep);
    if (st != UCS_OK) {
      s.ep = nullptr;
      return unreachable("cannot reach peer " + s.id + " (it serves over " + peer.transport +
                         ", this engine uses " + std::string(to_string(config_.transport)) +
                         "): " + ucs_status_string(st));
    }
    for (size_t i = 0; i < peer.regions.size(); ++i) {
      ucp_rkey_h rkey = nullptr;
      st = ucp_ep_rkey_unpack(s.ep, peer.regions[i].packed_rkey.data(), &rkey);
      if (st != UCS_OK) {
        return invalid_metadata("region " + std::to_string(i) + " of peer " + s.id +
                                ": its rkey does not unpack: " + ucs_status_string(st));
      }
      s.rkeys.push_back(rkey);
      const bool mappable = s.colocated && config_.transport != Transport::kTcp;
      const std::byte* mapped = mappable ? map_region(rkey, peer.regions[i]) : nullptr;
      if (mapped == nullptr && mappable && peer.regions[i].fd >= 0) {
        const auto& r = peer.regions[i];
        auto file = PeerMapping::map(peer.identity.pid, r.fd, r.inode, r.file_offset, r.length,
                                     r.live_offset);
        if (file) {
          mapped = file->data();
          s.file_maps.resize(i);
          s.file_maps.push_back(std::move(*file));
        }
        // Otherwise (not permitted here, say) the region is read over the am path.
      }
      s.mapped.push_back(mapped);
    }

    // A flush completes once the endpoint is wired up with the peer: an unreachable peer
    // fails here, within connect_timeout, rather than on the first read.
    ucp_request_param_t fp{};
    void* req = ucp_ep_flush_nbx(s.ep, &fp);
    Deadline deadline(config_.connect_timeout);
    Status result = Status::ok();
    if (UCS_PTR_IS_ERR(req)) {
      result =
          unreachable("cannot reach peer " + s.id + ": " + ucs_status_string(UCS_PTR_STATUS(req)));
    } else if (req != nullptr) {
      while (ucp_request_check_status(req) == UCS_INPROGRESS) {
        ucp_worker_progress(s.worker);
        if (s.watch.exited()) {
          result = peer_dead("peer " + s.id + " exited while connecting");
          break;
        }
        if (deadline.expired()) {
          result = unreachable("peer " + s.id + " did not answer within " +
                               std::to_string(config_.connect_timeout.count()) + " ms");
          break;
        }
      }
      if (result.is_ok()) {
        st = ucp_request_check_status(req);
        if (st != UCS_OK) {
          result = unreachable("cannot reach peer " + s.id + ": " + ucs_status_string(st));
        }
      }
      ucp_request_free(req);
    }
    if (result.is_ok() && s.ep_error != UCS_OK) {
      result = unreachable("cannot reach peer " + s.id + ": " + ucs_status_string(s.ep_error));
    }
    if (!result.is_ok()) return result;
    const LaneTransports lanes = endpoint_lanes(s.ep);
    switch (config_.read_path) {
      case ReadPath::kAuto:
        s.rma_get = rma_is_one_sided(lanes.rma);
        break;
      case ReadPath::kRma:
        s.rma_get = true;
        break;
      case ReadPath::kActiveMessage:
        s.rma_get = false;
        break;
    }
    // Without RMA lanes UCX emulates get over the active-message lanes.
    s.transport = join_transports(s.rma_get && !lanes.rma.empty() ? lanes.rma : lanes.am);
    if (std::any_of(s.mapped.begin(), s.mapped.end(), [](auto p) { return p != nullptr; })) {
      s.transport += "+mapped";
    }
    s.peer = std::move(peer);
    return Status::ok();
  }

  // The local address of a co-located peer's region, when UCX can map it (memory the peer's
  // engine allocated, over shared memory). Its pages are faulted in now, at connect, so the
  // first reads do not pay for them.
  static const std::byte* map_region(ucp_rkey_h rkey, const ExportedRegion& region) {
    void* ptr = nullptr;
    if (ucp_rkey_ptr(rkey, region.base, &ptr) != UCS_OK || ptr == nullptr) return nullptr;
#ifdef MADV_POPULATE_READ
    const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    const uintptr_t start = reinterpret_cast<uintptr_t>(ptr) & ~(page - 1);
    const uintptr_t end = reinterpret_cast<uintptr_t>(ptr) + region.length;
    // Advisory: an older kernel refuses it and the pages fault in on first read instead.
    (void)::madvise(reinterpret_cast<void*>(start), end - start, MADV_POPULATE_READ);
#endif
    return static_cast<const std::byte*>(ptr);
  }

  Status start_progress_thread() {
    ucs_status_t st = ucp_worker_get_efd(server_worker_, &worker_efd_);
    if (st != UCS_OK) return ucs_error("ucp_worker_get_efd", st);
    stop_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
    if (stop_fd_ < 0 || epoll_fd_ < 0)
      return internal_error("cannot create the progress thread's fds");
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = worker_efd_;
    if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, worker_efd_, &ev) != 0) {
      return internal_error("epoll_ctl(worker fd) failed");
    }
    ev.data.fd = stop_fd_;
    if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, stop_fd_, &ev) != 0) {
      return internal_error("epoll_ctl(stop fd) failed");
    }
    progress_thread_ = std::thread([this] { progress_loop(); });
    return Status::ok();
  }

  void progress_loop() {
    while (!stopping_.load(std::memory_order_acquire)) {
      ucs_status_t st;
      {
        // One progress per turn of the lock, so a link's sender does not wait for a
        // whole burst of reads to be served.
        std::lock_guard lock(served_links_->mu);
        const unsigned events = ucp_worker_progress(server_worker_);
        served_links_->after_progress();
        if (events != 0) continue;
        st = ucp_worker_arm(server_worker_);
      }
      if (st == UCS_ERR_BUSY) continue;  // events arrived meanwhile: progress again
      epoll_event events[2];
      // The timeout only bounds how long a missed wakeup could stall serving.
      ::epoll_wait(epoll_fd_, events, 2, 100);
    }
  }

  void shutdown() {
    if (link_thread_.joinable()) {
      links_stopping_.store(true);
      wake_link_thread();
      link_thread_.join();
    }
    if (link_epoll_fd_ >= 0) ::close(link_epoll_fd_);
    if (driver_epoll_fd_ >= 0) ::close(driver_epoll_fd_);
    driver_epoll_fd_ = -1;
    if (link_wake_fd_ >= 0) ::close(link_wake_fd_);
    link_epoll_fd_ = link_wake_fd_ = -1;
    if (progress_thread_.joinable()) {
      stopping_.store(true, std::memory_order_release);
      uint64_t one = 1;
      [[maybe_unused]] auto n = ::write(stop_fd_, &one, sizeof(one));
      progress_thread_.join();
    }
    {
      std::lock_guard lock(sessions_mu_);
      sessions_.clear();
    }
    // The serving worker goes first: its unfinished replies may still read registered memory.
    if (served_links_) served_links_->close_all();  // its endpoints, on the serving worker
    if (server_worker_ != nullptr) ucp_worker_destroy(server_worker_);
    served_links_.reset();  // after the worker: a send it cancels still finds its bytes
    server_worker_ = nullptr;
    for (auto& [base, reg] : regs_) {
      ucp_mem_unmap(context_, reg.memh);
      reg.shared.release();
    }
    regs_.clear();
    if (context_ != nullptr) ucp_cleanup(context_);
    context_ = nullptr;
    if (epoll_fd_ >= 0) ::close(epoll_fd_);
    if (stop_fd_ >= 0) ::close(stop_fd_);
    epoll_fd_ = stop_fd_ = -1;
  }

  EngineConfig config_;
  HostIdentity identity_;
  std::string session_id_;

  ucp_context_h context_ = nullptr;
  ucp_worker_h server_worker_ = nullptr;
  std::vector<std::byte> server_address_;

  mutable std::shared_mutex regs_mu_;
  std::map<uintptr_t, LocalRegistration> regs_;

  std::mutex connect_mu_;  // one connect at a time, so two callers do not race to open one peer
  mutable std::mutex sessions_mu_;
  std::unordered_map<std::string, std::shared_ptr<Session>> sessions_;

  std::unique_ptr<ServedLinks> served_links_;  // links this engine serves
  // Links opened on this engine's sessions, by token, and the thread that progresses the
  // sessions' workers between reads so their messages arrive (started by the first link).
  std::mutex link_tokens_mu_;
  std::unordered_map<uint64_t, std::weak_ptr<Session>> link_sessions_;
  std::mutex link_thread_mu_;
  std::vector<std::weak_ptr<Session>> watched_;  // under link_thread_mu_
  std::thread link_thread_;
  std::atomic<bool> links_stopping_{false};
  std::atomic<int> link_drivers_{0};
  int link_epoll_fd_ = -1;
  int driver_epoll_fd_ = -1;  // what a driver of the links sleeps on (link_fd())
  int link_wake_fd_ = -1;

  std::thread progress_thread_;
  std::atomic<bool> stopping_{false};
  int worker_efd_ = -1;
  int stop_fd_ = -1;
  int epoll_fd_ = -1;
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
