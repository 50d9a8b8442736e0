#include "transfer/ucx_handles.h"

#include <chrono>

#include "rd2h/common/deadline.h"

namespace rd2h::transfer {

void UcxEndpoint::close() {
  if (ep_ == nullptr) return;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = force_ ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  void* req = ucp_ep_close_nbx(ep_, &p);
  if (flush_ > std::chrono::milliseconds::zero()) {
    Deadline d(flush_);
    while (UCS_PTR_IS_PTR(req) && ucp_request_check_status(req) == UCS_INPROGRESS && !d.expired()) {
      ucp_worker_progress(worker_);
    }
  }
  if (UCS_PTR_IS_PTR(req)) ucp_request_free(req);
  ep_ = nullptr;
}

Expected<UcxWorker> create_worker(ucp_context_h context) {
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  ucp_worker_h w = nullptr;
  if (ucs_status_t st = ucp_worker_create(context, &wp, &w); st != UCS_OK) {
    return ucs_error("ucp_worker_create", st);
  }
  return UcxWorker(w);
}

Expected<std::vector<std::byte>> worker_address(ucp_worker_h worker) {
  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
  if (ucs_status_t st = ucp_worker_query(worker, &attr); st != UCS_OK) {
    return ucs_error("ucp_worker_query", st);
  }
  const auto* a = reinterpret_cast<const std::byte*>(attr.address);
  std::vector<std::byte> address(a, a + attr.address_length);
  ucp_worker_release_address(worker, attr.address);
  return address;
}

}  // namespace rd2h::transfer
