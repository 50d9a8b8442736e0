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

ucs_status_t post_rma_reads(Session& s, BatchState& batch, const ReadPlan& plan) {
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
  param.cb.send = on_request_done;
  param.user_data = &batch;
  for (size_t i = 0; i < batch.ops.size(); ++i) {
    const ReadOp& op = batch.ops[i];
    if (op.length == 0 || plan.mapped_src[i] != nullptr) continue;
    param.memh = plan.local_memh[i];
    void* req = ucp_get_nbx(s.ep.get(), reinterpret_cast<void*>(op.local), op.length, op.remote,
                            plan.rkey[i], &param);
    if (req == nullptr) continue;
    if (UCS_PTR_IS_ERR(req)) return UCS_PTR_STATUS(req);
    ++batch.outstanding;
  }
  return UCS_OK;
}

// Asks the peer for every non-mapped range, up to kAmRangesPerRequest per message. Each
// range then counts as outstanding until its reply has landed.
ucs_status_t post_am_requests(Session& s, BatchState& batch,
                              const std::vector<const std::byte*>& mapped_src) {
  batch.answered.assign(batch.ops.size(), 1);
  auto& requests = s.am_requests;
  requests.clear();
  for (size_t i = 0; i < batch.ops.size(); ++i) {
    const ReadOp& op = batch.ops[i];
    if (op.length == 0 || mapped_src[i] != nullptr) continue;
    // Ranges of one request are indexed from its first_index, so the cap counts gaps too.
    if (requests.empty() || i - requests.back().header.first_index >= kAmRangesPerRequest) {
      requests.push_back({{batch.id, static_cast<uint32_t>(i), 0}, {}});
      requests.back().ranges.reserve(kAmRangesPerRequest);
    }
    auto& r = requests.back();
    // Indices in one request are consecutive from first_index, so gaps are sent as
    // zero-length ranges the server answers without data.
    while (r.header.first_index + r.ranges.size() < i) r.ranges.push_back({0, 0});
    r.ranges.push_back({op.remote, op.length});
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
Status plan_reads(Session& s, const Registrations& registrations, std::span<const ReadOp> ops,
                  ReadPlan& plan) {
  plan.local_memh.assign(ops.size(), nullptr);
  plan.rkey.assign(ops.size(), nullptr);
  plan.mapped_src.assign(ops.size(), nullptr);
  for (size_t i = 0; i < ops.size(); ++i) {
    const auto [local, remote, length] = ops[i];
    if (length == 0) continue;
    auto op = [i] { return "read " + std::to_string(i) + ": "; };
    if (local + length < local || remote + length < remote) {
      return out_of_range(op() + "length " + std::to_string(length) + " wraps the address space");
    }
    const LocalRegistration* reg = registrations.find(local, length);
    if (reg == nullptr) {
      return out_of_range(op() + "local range " + range_text(local, length) +
                          " is not inside one local registration");
    }
    plan.local_memh[i] = reg->memh.get();
    auto region = s.find_region(remote, length);
    if (region < 0) {
      return out_of_range(op() + "remote range " + range_text(remote, length) +
                          " is not inside one region exported by " + s.id);
    }
    const auto r = static_cast<size_t>(region);
    plan.rkey[i] = s.rkeys[r].get();
    if (r < s.file_maps.size() && s.file_maps[r].data() != nullptr && !s.file_maps[r].live()) {
      // What a serving peer would answer: checked before anything is read.
      return s.fail(out_of_range(op() + "remote range " + range_text(remote, length) + " of " +
                                 s.id + ": range not registered there (any more)"));
    }
    if (s.mapped[r] != nullptr)
      plan.mapped_src[i] = s.mapped[r] + (remote - s.peer.regions[r].base);
  }
  return Status::ok();
}

// Whether the batch may go on: its peer alive, its deadline ahead, its endpoint whole (an
// endpoint error ends it; batch_outcome names it).
Status still_live(Session& s, const BatchState& batch, std::chrono::milliseconds timeout) {
  if (s.watch.exited()) {
    return s.fail(peer_dead("peer " + s.id + " exited during a batch of " +
                            std::to_string(batch.ops.size()) + " reads"));
  }
  if (batch.deadline.expired()) {
    return s.fail(timeout_error("batch of " + std::to_string(batch.ops.size()) + " reads from " +
                                s.id + " took longer than " + std::to_string(timeout.count()) +
                                " ms; " + std::to_string(batch.outstanding) + " still in flight"));
  }
  return Status::ok();
}

// Busy-polls the session's worker until the batch's posted reads are done: the waiting
// thread exists to drive its reads. Liveness is checked once a millisecond, not on every
// spin. Caller holds s.mu.
Status await_batch(Session& s, BatchState& batch, std::chrono::milliseconds timeout) {
  auto next_check = Deadline::Clock::now();
  while (batch.outstanding > 0 && !s.broken.load()) {
    ucp_worker_progress(s.worker.get());
    auto now = Deadline::Clock::now();
    if (now < next_check) continue;
    next_check = now + std::chrono::milliseconds(1);
    if (s.ep_error != UCS_OK) break;
    RD2H_RETURN_IF_ERROR(still_live(s, batch, timeout));
  }
  return Status::ok();
}

// What a finished batch (or a failed post) means for the session.
Status batch_outcome(Session& s, const BatchState& batch, ucs_status_t post_error) {
  if (s.broken.load()) {
    // Broken under the batch (disconnected, or a failure seen by another user of it).
    return failed_precondition("session " + s.id + " broke during a batch of reads (" +
                               s.broken_reason + ")");
  }
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

// One batch in flight on a session. Its state lives here, so the session's callbacks
// (run by whoever progresses its worker, with s.mu held) find it until it is done.
class UcxReadRequest final : public ReadRequest {
 public:
  UcxReadRequest(std::shared_ptr<Session> s, std::chrono::milliseconds timeout)
      : s_(std::move(s)), timeout_(timeout) {}
  ~UcxReadRequest() override {
    if (!posted_) return;
    std::lock_guard lock(s_->mu);
    // Abandoned in flight: what was posted is cancelled with the session.
    if (!outcome_ && batch_.outstanding > 0 && !s_->broken.load()) {
      (void)s_->fail(failed_precondition("a read request was abandoned in flight"));
    }
    if (s_->active == &batch_) s_->active = nullptr;
    if (pinned_ != nullptr) pinned_->unpin_reads();
  }

  // Posts the batch (caller holds s.mu and the registrations' shared lock); the local
  // registrations stay pinned until it is done.
  Status post(const Registrations& registrations, std::span<const ReadOp> ops) {
    Session& s = *s_;
    ReadPlan plan;
    RD2H_RETURN_IF_ERROR(plan_reads(s, registrations, ops, plan));
    if (s.watch.exited()) return s.fail(peer_dead("peer " + s.id + " has exited"));
    registrations.pin_reads();
    pinned_ = &registrations;
    batch_.deadline = Deadline(timeout_);
    batch_.id = s.next_batch_id++;
    batch_.ops.assign(ops.begin(), ops.end());
    s.active = &batch_;
    posted_ = true;
    const ucs_status_t post_error =
        s.rma_get ? post_rma_reads(s, batch_, plan) : post_am_requests(s, batch_, plan.mapped_src);
    if (post_error != UCS_OK) {
      // Nothing is awaited: the session's teardown cancels what was posted.
      finish(batch_outcome(s, batch_, post_error));
      return Status::ok();
    }
    // Mapped reads are copied while the posted ones are in flight.
    for (size_t i = 0; i < batch_.ops.size(); ++i) {
      const ReadOp& op = batch_.ops[i];
      if (plan.mapped_src[i] != nullptr && op.length != 0) {
        stream_copy(reinterpret_cast<void*>(op.local), plan.mapped_src[i], op.length);
      }
    }
    stream_copy_fence();
    if (batch_.outstanding == 0) finish(batch_outcome(s, batch_, UCS_OK));
    return Status::ok();
  }

  std::optional<Status> test() override {
    if (outcome_) return outcome_;
    std::lock_guard lock(s_->mu);
    Session& s = *s_;
    if (batch_.outcome) {
      finish(*batch_.outcome);
      return outcome_;
    }
    if (batch_.outstanding > 0 && !s.broken.load()) {
      ucp_worker_progress(s.worker.get());
      if (batch_.outstanding > 0 && s.ep_error == UCS_OK) {
        Status live = still_live(s, batch_, timeout_);
        if (live.is_ok()) return std::nullopt;
        finish(std::move(live));
        return outcome_;
      }
    }
    finish(batch_outcome(s, batch_, UCS_OK));
    return outcome_;
  }

  Status wait() override {
    if (outcome_) return *outcome_;
    std::lock_guard lock(s_->mu);
    if (batch_.outcome) {
      finish(*batch_.outcome);
      return *outcome_;
    }
    Status st = await_batch(*s_, batch_, timeout_);
    finish(st.is_ok() ? batch_outcome(*s_, batch_, UCS_OK) : std::move(st));
    return *outcome_;
  }

  // Caller holds s.mu: the batch is over (its outcome decided); the session may carry the
  // next, and local memory may be unregistered again.
  void finish(Status outcome) {
    outcome_ = std::move(outcome);
    if (s_->active == &batch_) s_->active = nullptr;
    if (pinned_ != nullptr) pinned_->unpin_reads();
    pinned_ = nullptr;
  }

 private:
  std::shared_ptr<Session> s_;
  const std::chrono::milliseconds timeout_;
  // Pinned until done, so no local registration disappears under a read.
  const Registrations* pinned_ = nullptr;
  BatchState batch_;
  bool posted_ = false;
  std::optional<Status> outcome_;
};

}  // namespace

Expected<std::unique_ptr<ReadRequest>> post_reads(const std::shared_ptr<Session>& s,
                                                  const Registrations& registrations,
                                                  std::span<const ReadOp> ops,
                                                  std::chrono::milliseconds timeout) {
  // Taken before the session's lock, as an unregistration would take it, and only while
  // the batch is planned and posted.
  const auto regs_lock = registrations.lock_shared();
  auto request = std::make_unique<UcxReadRequest>(s, timeout);
  std::lock_guard lock(s->mu);
  // One batch at a time per session (its replies are told apart by batch): an earlier one
  // in flight is driven to its end first; its owner then finds it done.
  if (s->active != nullptr && !s->broken.load()) {
    // Its outcome is decided now (a failure breaks the session before anything is posted
    // on it), and kept for its owner.
    BatchState& earlier = *s->active;
    Status st = await_batch(*s, earlier, timeout);
    earlier.outcome = st.is_ok() ? batch_outcome(*s, earlier, UCS_OK) : std::move(st);
    s->active = nullptr;
  }
  if (s->broken.load()) {
    return failed_precondition("session " + s->id + " is broken (" + s->broken_reason +
                               "); connect again to read");
  }
  RD2H_RETURN_IF_ERROR(request->post(registrations, ops));
  return std::unique_ptr<ReadRequest>(std::move(request));
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
  if (h.refused != 0 || length != b->ops[h.index].length) {
    if (b->refusal.empty()) {
      b->refusal = "the peer refused read " + std::to_string(h.index) +
                   (h.refused != 0 ? ": range not registered there (any more)"
                                   : ": reply of " + std::to_string(length) + " bytes");
    }
    b->finish(UCS_ERR_INVALID_ADDR);
    return drop();
  }
  void* dst = reinterpret_cast<void*>(b->ops[h.index].local);
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
