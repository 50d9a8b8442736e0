#include "transfer/ucx_serving.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cstring>

#include "transfer/ucx_session.h"

namespace rd2h::transfer {

namespace {

// One reply of the am read path while UCX sends it.
struct AmReply {
  AmReadReplyHeader header;
  std::shared_ptr<ReplyTracker> tracker;  // null for a refusal, which carries no data

  void finish() {
    if (tracker) tracker->done();
    delete this;
  }
};

}  // namespace

Expected<std::unique_ptr<ServingWorker>> ServingWorker::start(ucp_context_h context,
                                                              const Registrations& registrations) {
  std::unique_ptr<ServingWorker> w(new ServingWorker(registrations));
  RD2H_RETURN_IF_ERROR(w->init(context));
  return w;
}

Status ServingWorker::init(ucp_context_h context) {
  RD2H_TRY(worker, create_worker(context));
  worker_ = std::move(worker);
  RD2H_RETURN_IF_ERROR(set_am_handler(worker_.get(), kAmReadRequest, on_read_request, this));
  links_ = std::make_unique<ServedLinks>(worker_.get());
  RD2H_RETURN_IF_ERROR(links_->install());
  RD2H_TRY(address, worker_address(worker_.get()));
  address_ = std::move(address);

  if (ucs_status_t st = ucp_worker_get_efd(worker_.get(), &event_fd_); st != UCS_OK) {
    return ucs_error("ucp_worker_get_efd", st);
  }
  stop_fd_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  epoll_fd_.reset(::epoll_create1(EPOLL_CLOEXEC));
  if (!stop_fd_.valid() || !epoll_fd_.valid()) {
    return internal_error("cannot create the progress thread's fds");
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  for (int fd : {event_fd_, stop_fd_.get()}) {
    ev.data.fd = fd;
    if (::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
      return internal_error("epoll_ctl(progress thread) failed");
    }
  }
  thread_ = std::thread([this] { loop(); });
  return Status::ok();
}

ServingWorker::~ServingWorker() {
  stop();
  if (links_) links_->close_all();  // its endpoints, on this worker
  worker_.reset();
  links_.reset();  // after the worker: a send it cancels still finds its bytes
}

void ServingWorker::stop() {
  if (!thread_.joinable()) return;
  stopping_.store(true, std::memory_order_release);
  uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(stop_fd_.get(), &one, sizeof(one));
  thread_.join();
}

bool ServingWorker::progress_once(bool arm) {
  std::lock_guard lock(links_->mu);
  const unsigned events = ucp_worker_progress(worker_.get());
  links_->after_progress();
  return arm && events == 0 && ucp_worker_arm(worker_.get()) != UCS_ERR_BUSY;
}

void ServingWorker::loop() {
  while (!stopping_.load(std::memory_order_acquire)) {
    ucs_status_t st;
    {
      // One progress per turn of the lock, so a link's sender does not wait for a
      // whole burst of reads to be served.
      std::lock_guard lock(links_->mu);
      const unsigned events = ucp_worker_progress(worker_.get());
      links_->after_progress();
      if (events != 0) continue;
      st = ucp_worker_arm(worker_.get());
    }
    if (st == UCS_ERR_BUSY) continue;  // events arrived meanwhile: progress again
    epoll_event events[2];
    // The timeout only bounds how long a missed wakeup could stall serving.
    ::epoll_wait(epoll_fd_.get(), events, 2, 100);
  }
}

ucs_status_t ServingWorker::on_read_request(void* arg, const void* header, size_t header_length,
                                            void* data, size_t length,
                                            const ucp_am_recv_param_t* param) {
  const auto& registrations = static_cast<ServingWorker*>(arg)->registrations_;
  // Requests are sent eager; anything else is not ours, and returning UCS_OK without
  // receiving it lets UCX drop it.
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) return UCS_OK;
  AmReadRequestHeader h;
  if (header_length != sizeof(h) || (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0) {
    return UCS_OK;
  }
  std::memcpy(&h, header, sizeof(h));
  if (length != static_cast<size_t>(h.count) * sizeof(AmRange)) return UCS_OK;
  const auto lock = registrations.lock_shared();
  for (uint32_t k = 0; k < h.count; ++k) {
    AmRange range;
    std::memcpy(&range, static_cast<const std::byte*>(data) + k * sizeof(AmRange), sizeof(range));
    if (range.length == 0) continue;
    const LocalRegistration* reg = range.addr + range.length >= range.addr
                                       ? registrations.find(range.addr, range.length)
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

}  // namespace rd2h::transfer
