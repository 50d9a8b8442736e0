// A UCX session: one connection from this engine to a peer engine, with its own worker,
// endpoint, rkeys, peer liveness watch and the batch being read. Everything here runs on the
// thread that holds Session::mu; a failed session is torn down by destroying its worker.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
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
#include "transfer/ucx_handles.h"
#include "transfer/ucx_link.h"
#include "transfer/ucx_metadata.h"
#include "transfer/ucx_read.h"

namespace rd2h::transfer {

struct Session final : PeerSession {
  std::mutex mu;  // serialises progress, posts and teardown on this session
  std::string id;
  UcxMetadata peer;
  bool colocated = false;
  ucp_err_handling_mode_t err_mode = UCP_ERR_HANDLING_MODE_NONE;
  std::string transport = "unknown";

  // Declared in the order they are made: the endpoint goes before the rkeys its reads
  // use, and both before the worker.
  UcxWorker worker;
  std::vector<UcxRkey> rkeys;  // parallel to peer.regions
  UcxEndpoint ep;
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
  BatchState* active = nullptr;    // the batch in flight, replies belong to; its request's
  // The am requests of the active batch: UCX reads them until their sends complete.
  std::vector<AmReadRequest> am_requests;
  uint64_t next_batch_id = 1;

  // Links opened on this session (ucx_link.h), by token; each gets kClosed on release.
  std::map<uint64_t, LinkHandler> links;
  std::vector<std::byte> worker_address;  // this session's worker, as a link's peer reaches it
  bool watched = false;                   // a notification consumer sleeps on its worker

  ~Session() override { release(); }

  // Connects to `peer` (caller holds mu): a worker of `context`, an endpoint whose wire-up
  // is confirmed within the connect timeout, the peer's regions' rkeys and, for a
  // co-located peer, its regions mapped where they can be; then the read path.
  Status open(ucp_context_h context, const EngineConfig& config, const HostIdentity& self,
              UcxMetadata peer);

  // Destroys this session's UCX objects. Anything in flight is cancelled with the worker,
  // and every link hears kClosed.
  void release();

  // Marks the session broken, cancels its in-flight reads, and returns `why`.
  Status fail(Status why) {
    mark_broken(why);
    release();
    return why;
  }

  // The index of the peer region holding all of [addr, addr+len), or -1.
  int64_t find_region(uint64_t addr, uint64_t len) const;

  void mark_broken(const Status& why) {
    if (!broken.load()) {
      broken_reason = why.to_string();
      broken.store(true);
    }
  }

 private:
  // The steps of open().
  Status connect_endpoint(ucp_context_h context, const EngineConfig& config,
                          const UcxMetadata& from);
  Status import_regions(const EngineConfig& config, const UcxMetadata& from);
  Status await_wireup(std::chrono::milliseconds timeout);
  void choose_read_path(ReadPath path);
};

// Peer error handling: records the endpoint's failure on the Session in arg.
void on_endpoint_error(void* arg, ucp_ep_h ep, ucs_status_t status);
// Connecting side of a link: a message from the serving side for the Session in arg.
ucs_status_t on_am_link_message(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param);

}  // namespace rd2h::transfer
