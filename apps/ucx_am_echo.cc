#include "ucx_am_echo.h"

#include <sys/epoll.h>
#include <ucp/api/ucp.h>

#include <chrono>

#include "rd2h/common/deadline.h"
#include "transfer/ucx_handles.h"
#include "transfer/ucx_link.h"
#include "util/unique_fd.h"

namespace rd2h::tools {

namespace {
constexpr unsigned kAmId = 7;
constexpr size_t kMessageBytes = 96;  // about a one-request readiness
using Clock = std::chrono::steady_clock;
}  // namespace

// One end: its own UCX context and worker, woken through the worker's event fd. Its
// members go in reverse: the endpoint (closed on the worker), the epoll fd, the worker,
// then the context.
struct UcxAmEcho::Side {
  transfer::UcxContext context;
  transfer::UcxWorker worker;
  int efd = -1;  // the worker's, owned by UCX
  UniqueFd epfd;
  transfer::UcxEndpoint ep;  // to the other end
  std::vector<std::byte> address;
  std::atomic<uint64_t> received{0};

  static ucs_status_t on_message(void* arg, const void*, size_t, void*, size_t,
                                 const ucp_am_recv_param_t*) {
    static_cast<Side*>(arg)->received.fetch_add(1);
    return UCS_OK;
  }

  Status init(const std::string& tls) {
    ucp_config_t* raw_cfg = nullptr;
    ucs_status_t st = ucp_config_read(nullptr, nullptr, &raw_cfg);
    if (st != UCS_OK) return transfer::ucs_error("ucp_config_read", st);
    const transfer::UcxConfig cfg(raw_cfg);
    st = ucp_config_modify(cfg.get(), "TLS", tls.c_str());
    if (st != UCS_OK) return transfer::ucs_error("UCX_TLS=" + tls, st);
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    ucp_context_h raw_context = nullptr;
    st = ucp_init(&params, cfg.get(), &raw_context);
    if (st != UCS_OK) return transfer::ucs_error("ucp_init", st);
    context.reset(raw_context);
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    ucp_worker_h raw_worker = nullptr;
    st = ucp_worker_create(context.get(), &wp, &raw_worker);
    if (st != UCS_OK) return transfer::ucs_error("ucp_worker_create", st);
    worker.reset(raw_worker);
    RD2H_RETURN_IF_ERROR(transfer::set_am_handler(worker.get(), kAmId, on_message, this));
    st = ucp_worker_get_efd(worker.get(), &efd);
    if (st != UCS_OK) return transfer::ucs_error("ucp_worker_get_efd", st);
    epfd.reset(::epoll_create1(EPOLL_CLOEXEC));
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = efd;
    if (!epfd.valid() || ::epoll_ctl(epfd.get(), EPOLL_CTL_ADD, efd, &ev) != 0) {
      return internal_error("cannot watch the UCX worker's event fd");
    }
    RD2H_TRY(own_address, transfer::worker_address(worker.get()));
    address = std::move(own_address);
    return Status::ok();
  }

  Status connect(const std::vector<std::byte>& peer) {
    ucp_ep_params_t ep_params{};
    ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    ep_params.address = reinterpret_cast<const ucp_address_t*>(peer.data());
    ucp_ep_h created = nullptr;
    ucs_status_t st = ucp_ep_create(worker.get(), &ep_params, &created);
    if (st != UCS_OK) return transfer::ucs_error("ucp_ep_create", st);
    // Forced, with a flush of up to a second on this side's worker.
    ep = transfer::UcxEndpoint(worker.get(), created, /*force=*/true, std::chrono::seconds(1));
    return Status::ok();
  }

  // Progresses until `done()`, sleeping on the event fd when there is nothing to do.
  template <typename Done>
  bool wait(Done done, const Deadline& deadline) {
    while (!done()) {
      if (ucp_worker_progress(worker.get()) != 0) continue;
      if (done()) break;
      const ucs_status_t st = ucp_worker_arm(worker.get());
      if (st == UCS_ERR_BUSY) continue;
      if (deadline.expired()) return false;
      epoll_event ev;
      ::epoll_wait(epfd.get(), &ev, 1, std::min(deadline.remaining_ms(), 100));
    }
    return true;
  }

  Status send(const std::vector<std::byte>& message, const Deadline& deadline) {
    ucp_request_param_t p{};
    void* req = ucp_am_send_nbx(ep.get(), kAmId, nullptr, 0, message.data(), message.size(), &p);
    if (UCS_PTR_IS_ERR(req)) return transfer::ucs_error("ucp_am_send_nbx", UCS_PTR_STATUS(req));
    if (req == nullptr) return Status::ok();
    const bool sent =
        wait([&] { return ucp_request_check_status(req) != UCS_INPROGRESS; }, deadline);
    const ucs_status_t st = sent ? ucp_request_check_status(req) : UCS_ERR_TIMED_OUT;
    ucp_request_free(req);
    return st == UCS_OK ? Status::ok() : transfer::ucs_error("an active message", st);
  }
};

UcxAmEcho::UcxAmEcho() : client_(std::make_unique<Side>()), echo_(std::make_unique<Side>()) {}

Expected<std::unique_ptr<UcxAmEcho>> UcxAmEcho::start(const std::string& tls) {
  auto e = std::unique_ptr<UcxAmEcho>(new UcxAmEcho());
  RD2H_RETURN_IF_ERROR(e->client_->init(tls));
  RD2H_RETURN_IF_ERROR(e->echo_->init(tls));
  RD2H_RETURN_IF_ERROR(e->client_->connect(e->echo_->address));
  RD2H_RETURN_IF_ERROR(e->echo_->connect(e->client_->address));
  e->thread_ = std::thread([raw = e.get()] { raw->echo_loop(); });
  std::vector<double> warm_up;
  RD2H_RETURN_IF_ERROR(e->measure(50, warm_up));
  return e;
}

UcxAmEcho::~UcxAmEcho() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();  // its wait sleeps 100 ms at most
}

void UcxAmEcho::echo_loop() {
  const std::vector<std::byte> reply(kMessageBytes, std::byte{0xa5});
  uint64_t answered = 0;
  while (!stop_.load()) {
    echo_->wait([&] { return stop_.load() || echo_->received.load() > answered; },
                Deadline(std::chrono::milliseconds(100)));
    while (!stop_.load() && echo_->received.load() > answered) {
      ++answered;
      if (!echo_->send(reply, Deadline(std::chrono::seconds(1)))) return;
    }
  }
}

Status UcxAmEcho::measure(uint32_t count, std::vector<double>& out) {
  const std::vector<std::byte> message(kMessageBytes, std::byte{0x5a});
  for (uint32_t i = 0; i < count; ++i) {
    const Deadline deadline(std::chrono::seconds(1));
    const uint64_t before = client_->received.load();
    const auto start = Clock::now();
    RD2H_RETURN_IF_ERROR(client_->send(message, deadline));
    if (!client_->wait([&] { return client_->received.load() > before; }, deadline)) {
      return timeout_error("no UCX active-message echo within a second");
    }
    out.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
  }
  return Status::ok();
}

}  // namespace rd2h::tools
