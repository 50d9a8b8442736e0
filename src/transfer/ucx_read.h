// Reads in flight on a UCX session (post_reads), each region by its path: mapped (a plain
// copy), rma (ucp_get on RDMA lanes) or am (active messages the peer's serving worker
// answers); and the am path's wire format (both ends are rd2h engines; native byte order).
#pragma once

#include <ucp/api/ucp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <span>
#include <string>
#include <vector>

#include "rd2h/common/deadline.h"
#include "rd2h/common/status.h"
#include "rd2h/transfer/transfer_engine.h"

namespace rd2h::transfer {

struct Session;
class Registrations;

// Progress state of one batch, owned by its request. UCX callbacks of this batch only run
// inside ucp_worker_progress/ucp_worker_destroy, called with the session's mu held.
struct BatchState {
  uint64_t id = 0;
  size_t outstanding = 0;  // reads, requests and replies not finished yet
  ucs_status_t first_error = UCS_OK;
  std::string refusal;  // why the peer refused a read, if it did
  Deadline deadline{std::chrono::milliseconds(0)};
  // The reads (where each lands), and for the am path which replies have arrived.
  std::vector<ReadOp> ops;
  std::vector<uint8_t> answered;
  // Its outcome, when a later post on the session drove it to its end before its owner did.
  std::optional<Status> outcome;

  void finish(ucs_status_t status) {
    --outstanding;
    if (status != UCS_OK && first_error == UCS_OK) first_error = status;
  }
};

inline constexpr uint16_t kAmReadRequest = 0x7264;  // reader -> server: ranges to send back
inline constexpr uint16_t kAmReadReply = 0x7265;    // server -> reader: one range's bytes
inline constexpr size_t kAmRangesPerRequest = 256;  // keeps a request small enough to go eager

struct AmReadRequestHeader {
  uint64_t batch_id;
  uint32_t first_index;
  uint32_t count;
};
struct AmRange {
  uint64_t addr;
  uint64_t length;
};
// A request as the reader keeps it while UCX sends it.
struct AmReadRequest {
  AmReadRequestHeader header;
  std::vector<AmRange> ranges;
};
struct AmReadReplyHeader {
  uint64_t batch_id;
  uint32_t index;
  uint32_t refused;  // non-zero: the range is not registered on the server
};

// Posts `ops` on the session `s` (found whole by the caller, who holds no lock) within
// `timeout`. Every range is checked against `registrations` and the peer's regions before
// anything is read; a failure after that breaks the session.
Expected<std::unique_ptr<ReadRequest>> post_reads(const std::shared_ptr<Session>& s,
                                                  const Registrations& registrations,
                                                  std::span<const ReadOp> ops,
                                                  std::chrono::milliseconds timeout);

// Reader side of the am path: one range's bytes arrive for the Session in arg.
ucs_status_t on_am_read_reply(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);

}  // namespace rd2h::transfer
