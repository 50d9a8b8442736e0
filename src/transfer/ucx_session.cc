#include "transfer/ucx_session.h"

#include <cstring>

#include "rd2h/common/deadline.h"
#include "transfer/ucx_link.h"

namespace rd2h::transfer {

void Session::release() {
  std::map<uint64_t, LinkHandler> gone;
  gone.swap(links);
  for (auto& [token, handler] : gone) handler(LinkEvent::kClosed, {});
  mapped.clear();
  file_maps.clear();
  if (worker != nullptr) {
    if (ep != nullptr) {
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = err_mode == UCP_ERR_HANDLING_MODE_PEER ? UCP_EP_CLOSE_FLAG_FORCE : 0;
      void* req = ucp_ep_close_nbx(ep, &p);
      // A graceful close to a dead peer may never finish; give it a short bounded chance
      // and let the worker's destruction discard the rest.
      Deadline d(std::chrono::milliseconds(100));
      while (UCS_PTR_IS_PTR(req) && ucp_request_check_status(req) == UCS_INPROGRESS &&
             !d.expired()) {
        ucp_worker_progress(worker);
      }
      if (UCS_PTR_IS_PTR(req)) ucp_request_free(req);
      ep = nullptr;
    }
    // After the endpoint's close has had its chance to flush the reads that use them.
    for (auto rkey : rkeys) ucp_rkey_destroy(rkey);
    rkeys.clear();
    ucp_worker_destroy(worker);
    worker = nullptr;
  }
}

void on_request_done(void* request, ucs_status_t status, void* user_data) {
  static_cast<BatchState*>(user_data)->finish(status);
  ucp_request_free(request);
}

void on_am_data_received(void* request, ucs_status_t status, size_t /*length*/, void* user_data) {
  static_cast<BatchState*>(user_data)->finish(status);
  ucp_request_free(request);
}

void on_endpoint_error(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* s = static_cast<Session*>(arg);
  if (s->ep_error == UCS_OK) s->ep_error = status;
}

ucs_status_t on_am_read_reply(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param) {
  auto* s = static_cast<Session*>(arg);
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  // Returning UCS_OK without receiving rendezvous data lets UCX drop it.
  auto drop = [] { return UCS_OK; };
  AmReadReplyHeader h;
  if (header_length != sizeof(h)) return drop();
  std::memcpy(&h, header, sizeof(h));
  BatchState* b = s->active;
  if (b == nullptr || h.batch_id != b->id || h.index >= b->answered.size() ||
      b->answered[h.index] != 0) {
    return drop();  // late, foreign or duplicate: nothing waits for it
  }
  b->answered[h.index] = 1;
  if (h.refused != 0 || length != b->length[h.index]) {
    if (b->refusal.empty()) {
      b->refusal = "the peer refused read " + std::to_string(h.index) +
                   (h.refused != 0 ? ": range not registered there (any more)"
                                   : ": reply of " + std::to_string(length) + " bytes");
    }
    b->finish(UCS_ERR_INVALID_ADDR);
    return drop();
  }
  void* dst = reinterpret_cast<void*>(b->local[h.index]);
  if (!rndv) {
    std::memcpy(dst, data, length);
    b->finish(UCS_OK);
    return UCS_OK;
  }
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.recv_am = on_am_data_received;
  p.user_data = b;
  void* req = ucp_am_recv_data_nbx(s->worker, data, dst, length, &p);
  if (req == nullptr) {
    b->finish(UCS_OK);
  } else if (UCS_PTR_IS_ERR(req)) {
    b->finish(UCS_PTR_STATUS(req));
  }
  // Otherwise on_am_data_received finishes it; `outstanding` still counts this read.
  return UCS_OK;
}

ucs_status_t on_am_link_message(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param) {
  auto* s = static_cast<Session*>(arg);
  LinkMessageHeader h;
  if (header_length != sizeof(h) || !acceptable_link_message(length, param)) return UCS_OK;
  std::memcpy(&h, header, sizeof(h));
  auto it = s->links.find(h.token);
  if (it != s->links.end()) {
    it->second(LinkEvent::kMessage, {static_cast<const std::byte*>(data), length});
  }
  return UCS_OK;
}

}  // namespace rd2h::transfer
