// A UCX session: one connection from this engine to a peer engine, with its own worker,
// endpoint, unpacked rkeys, peer liveness watch, and the state of the batch being read.
// Also the wire format of the active-message read path and the UCX callbacks that drive
// a batch. Everything here runs on the thread that holds Session::mu.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "rd2h/common/status.h"
#include "rd2h/transfer/transfer_engine.h"
#include "transfer/peer_liveness.h"
#include "transfer/shared_backing.h"
#include "transfer/ucx_metadata.h"

namespace rd2h::transfer {

// Progress state of one batch. Lives on the reading thread's stack; UCX callbacks of this
// batch only run inside ucp_worker_progress/ucp_worker_destroy called by that thread.
struct BatchState {
  uint64_t id = 0;
  size_t outstanding = 0;  // reads, requests and replies not finished yet
  ucs_status_t first_error = UCS_OK;
  std::string refusal;  // why the peer refused a read, if it did
  // For the am path: where each read lands, and which replies have arrived.
  std::span<const uintptr_t> local;
  std::span<const size_t> length;
  std::vector<uint8_t> answered;

  void finish(ucs_status_t status) {
    --outstanding;
    if (status != UCS_OK && first_error == UCS_OK) first_error = status;
  }
};

// Wire format of the am read path (both ends are rd2h engines; native byte order).
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

struct Session {
  std::mutex mu;  // serialises reads and teardown on this session
  std::string id;
  UcxMetadata peer;
  bool colocated = false;
  ucp_err_handling_mode_t err_mode = UCP_ERR_HANDLING_MODE_NONE;
  std::string transport = "unknown";

  ucp_worker_h worker = nullptr;
  ucp_ep_h ep = nullptr;
  std::vector<ucp_rkey_h> rkeys;  // parallel to peer.regions
  // Where UCX maps a region of a co-located peer into this process (ucp_rkey_ptr), or null.
  // Reads from a mapped region are plain copies: no per-read protocol, no peer involvement.
  std::vector<const std::byte*> mapped;
  // The peer's memfd regions this session mapped, by region index (empty where none).
  std::vector<PeerMapping> file_maps;
  ProcessWatch watch;

  bool rma_get = false;  // non-mapped reads use ucp_get (hardware RMA) rather than am

  std::atomic<bool> broken{false};
  std::string broken_reason;       // written under mu before `broken` is set
  ucs_status_t ep_error = UCS_OK;  // set by the error handler, on the reading thread
  BatchState* active = nullptr;    // the batch replies belong to; set by the reading thread
  // The am requests of the active batch: UCX reads them until their sends complete.
  std::vector<AmReadRequest> am_requests;
  uint64_t next_batch_id = 1;

  // Links opened on this session (ucx_link.h), by token; each gets kClosed on release.
  std::map<uint64_t, LinkHandler> links;
  std::vector<std::byte> worker_address;  // this session's worker, as a link's peer reaches it
  bool watched = false;                   // the engine's link thread sleeps on its worker

  ~Session() { release(); }

  // Destroys this session's UCX objects. Anything in flight is cancelled with the worker,
  // and every link hears kClosed.
  void release();

  void mark_broken(const Status& why) {
    if (!broken.load()) {
      broken_reason = why.to_string();
      broken.store(true);
    }
  }
};

// Completion of a read, an am request send, or an am receive: finishes one unit of the
// batch in user_data.
void on_request_done(void* request, ucs_status_t status, void* user_data);
void on_am_data_received(void* request, ucs_status_t status, size_t length, void* user_data);
// Peer error handling: records the endpoint's failure on the Session in arg.
void on_endpoint_error(void* arg, ucp_ep_h ep, ucs_status_t status);
// Reader side of the am path: one range's bytes arrive for the Session in arg.
ucs_status_t on_am_read_reply(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
// Connecting side of a link: a message from the serving side for the Session in arg.
ucs_status_t on_am_link_message(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param);

}  // namespace rd2h::transfer
