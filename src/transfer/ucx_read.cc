#include "transfer/ucx_read.h"

#include <cstring>

#include "common/format.h"
#include "rd2h/common/deadline.h"
#include "transfer/stream_copy.h"
#include "transfer/ucx_memory.h"
#include "transfer/ucx_session.h"

namespace rd2h::transfer {

namespace {

void on_request_done(void* request, ucs_status_t status, void* user_data) {
  static_cast<BatchState*>(user_data)->finish(status);
  ucp_request_free(request);
}

void on_am_data_received(void* request, ucs_status_t status, size_t /*length*/, void* user_data) {
  static_cast<BatchState*>(user_data)->finish(status);
  ucp_request_free(request);
}

// Where each read comes from. A mapped read has its source here; the others are posted
// with the local memory handle and the peer region's rkey.
struct ReadPlan {
  std::vector<ucp_mem_h> local_memh;
  std::vector<ucp_rkey_h> rkey;
  std::vector<const std::byte*> mapped_src;
};

ucs_status_t post_rma_reads(Session& s, BatchState& batch, std::span<const uintptr_t> local,
                            std::span<const uintptr_t> remote, std::span<const size_t> length,
                            const ReadPlan& plan) {
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
  param.cb.send = on_request_done;
  param.user_data = &batch;
  for (size_t i = 0; i < local.size(); ++i) {
    if (length[i] == 0 || plan.mapped_src[i] != nullptr) continue;
    param.memh = plan.local_memh[i];
    void* req = ucp_get_nbx(s.ep.get(), reinterpret_cast<void*>(local[i]), length[i], remote[i],
                            plan.rkey[i], &param);
    if (req == nullptr) continue;
    if (UCS_PTR_IS_ERR(req)) return UCS_PTR_STATUS(req);
    ++batch.outstanding;
  }
  return UCS_OK;
}

// Asks the peer for every non-mapped range, up to kAmRangesPerRequest per message. Each
// range then counts as outstanding until its reply has landed.
ucs_status_t post_am_requests(Session& s, BatchState& batch, std::span<const uintptr_t> remote,
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
    void* req = ucp_am_send_nbx(s.ep.get(), kAmReadRequest, &r.header, sizeof(r.header),
                                r.ranges.data(), r.ranges.size() * sizeof(AmRange), &param);
    if (req == nullptr) continue;
    if (UCS_PTR_IS_ERR(req)) return UCS_PTR_STATUS(req);
    ++batch.outstanding;
  }
  return UCS_OK;
}

// Checks every range against the registrations and the peer's regions, before anything
// is read. Caller holds the registrations' lock.
Status plan_reads(Session& s, const Registrations& registrations, std::span<const uintptr_t> local,
                  std::span<const uintptr_t> remote, std::span<const size_t> length,
                  ReadPlan& plan) {
  plan.local_memh.assign(local.size(), nullptr);
  plan.rkey.assign(local.size(), nullptr);
  plan.mapped_src.assign(local.size(), nullptr);
  for (size_t i = 0; i < local.size(); ++i) {
    if (length[i] == 0) continue;
    auto op = [i] { return "read " + std::to_string(i) + ": "; };
    if (local[i] + length[i] < local[i] || remote[i] + length[i] < remote[i]) {
      return out_of_range(op() + "length " + std::to_string(length[i]) +
                          " wraps the address space");
    }
    const LocalRegistration* reg = registrations.find(local[i], length[i]);
    if (reg == nullptr) {
      return out_of_range(op() + "local range " + range_text(local[i], length[i]) +
                          " is not inside one local registration");
    }
    plan.local_memh[i] = reg->memh.get();
    auto region = s.find_region(remote[i], length[i]);
    if (region < 0) {
      return out_of_range(op() + "remote range " + range_text(remote[i], length[i]) +
                          " is not inside one region exported by " + s.id);
    }
    const auto r = static_cast<size_t>(region);
    plan.rkey[i] = s.rkeys[r].get();
    if (r < s.file_maps.size() && s.file_maps[r].data() != nullptr && !s.file_maps[r].live()) {
      // What a serving peer would answer: checked before anything is read.
      return s.fail(out_of_range(op() + "remote range " + range_text(remote[i], length[i]) +
                                 " of " + s.id + ": range not registered there (any more)"));
    }
    if (s.mapped[r] != nullptr) {
      plan.mapped_src[i] = s.mapped[r] + (remote[i] - s.peer.regions[r].base);
    }
  }
  return Status::ok();
}

// Busy-polls the session's worker until the batch's posted reads are done: this thread
// exists to drive its reads. Liveness is checked once a millisecond, not on every spin.
Status await_batch(Session& s, BatchState& batch, size_t reads, std::chrono::milliseconds timeout,
                   const Deadline& deadline) {
  auto next_check = Deadline::Clock::now();
  while (batch.outstanding > 0) {
    ucp_worker_progress(s.worker.get());
    auto now = Deadline::Clock::now();
    if (now < next_check) continue;
    next_check = now + std::chrono::milliseconds(1);
    if (s.ep_error != UCS_OK) break;
    if (s.watch.exited()) {
      return s.fail(peer_dead("peer " + s.id + " exited during a batch of " +
                              std::to_string(reads) + " reads"));
    }
    if (deadline.expired()) {
      return s.fail(timeout_error("batch of " + std::to_string(reads) + " reads from " + s.id +
                                  " took longer than " + std::to_string(timeout.count()) + " ms; " +
                                  std::to_string(batch.outstanding) + " still in flight"));
    }
  }
  return Status::ok();
}

// What a finished batch (or a failed post) means for the session.
Status batch_outcome(Session& s, const BatchState& batch, ucs_status_t post_error) {
  if (s.ep_error != UCS_OK) {
    return s.fail(peer_dead("connection to " + s.id + " failed: " + ucs_status_string(s.ep_error)));
  }
  if (post_error != UCS_OK) return s.fail(ucs_error("posting a read to " + s.id, post_error));
  if (!batch.refusal.empty()) return s.fail(out_of_range(batch.refusal + " (" + s.id + ")"));
  if (batch.first_error != UCS_OK) {
    return s.fail(ucs_error("read from " + s.id, batch.first_error));
  }
  if (s.watch.exited()) {
    return s.fail(peer_dead("peer " + s.id + " exited before the batch completed"));
  }
  return Status::ok();
}

}  // namespace

Status read_batch(Session& s, const Registrations& registrations, std::span<const uintptr_t> local,
                  std::span<const uintptr_t> remote, std::span<const size_t> length,
                  std::chrono::milliseconds timeout) {
  // Held for the whole batch so no local registration disappears under a read.
  const auto regs_lock = registrations.lock_shared();
  ReadPlan plan;
  RD2H_RETURN_IF_ERROR(plan_reads(s, registrations, local, remote, length, plan));
  if (s.watch.exited()) return s.fail(peer_dead("peer " + s.id + " has exited"));

  const Deadline deadline(timeout);
  BatchState batch;
  s.active = &batch;
  struct ClearActive {
    Session* s;
    ~ClearActive() { s->active = nullptr; }
  } clear_active{&s};
  batch.id = s.next_batch_id++;
  batch.local = local;
  batch.length = length;
  const ucs_status_t post_error = s.rma_get
                                      ? post_rma_reads(s, batch, local, remote, length, plan)
                                      : post_am_requests(s, batch, remote, length, plan.mapped_src);
  if (post_error == UCS_OK) {
    // Mapped reads are copied while the posted ones are in flight.
    for (size_t i = 0; i < local.size(); ++i) {
      if (plan.mapped_src[i] != nullptr && length[i] != 0) {
        stream_copy(reinterpret_cast<void*>(local[i]), plan.mapped_src[i], length[i]);
      }
    }
    stream_copy_fence();
    // After a failed post nothing is awaited: the session's teardown cancels what was posted.
    RD2H_RETURN_IF_ERROR(await_batch(s, batch, local.size(), timeout, deadline));
  }
  return batch_outcome(s, batch, post_error);
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
  void* req = ucp_am_recv_data_nbx(s->worker.get(), data, dst, length, &p);
  if (req == nullptr) {
    b->finish(UCS_OK);
  } else if (UCS_PTR_IS_ERR(req)) {
    b->finish(UCS_PTR_STATUS(req));
  }
  // Otherwise on_am_data_received finishes it; `outstanding` still counts this read.
  return UCS_OK;
}

}  // namespace rd2h::transfer
