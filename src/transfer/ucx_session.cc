#include "transfer/ucx_session.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "rd2h/common/deadline.h"
#include "transfer/ucx_lanes.h"
#include "transfer/ucx_link.h"

namespace rd2h::transfer {

namespace {

// The local address of a co-located peer's region, when UCX can map it (memory the peer's
// engine allocated, over shared memory). Its pages are not populated at connect: they fault
// in as reads touch them. A peer's region is its whole KV cache (GiBs), most of which a
// reader never reads: populating a vLLM Prefill's 1 GiB cache at connect took seconds of
// kernel time on a 2-vCPU host, stalled every process on it meanwhile, and ran past the
// connect deadline.
const std::byte* map_region(ucp_rkey_h rkey, const ExportedRegion& region) {
  void* ptr = nullptr;
  if (ucp_rkey_ptr(rkey, region.base, &ptr) != UCS_OK || ptr == nullptr) return nullptr;
  return static_cast<const std::byte*>(ptr);
}

}  // namespace

Status Session::open(ucp_context_h context, const EngineConfig& config, const HostIdentity& self,
                     UcxMetadata from) {
  id = from.session_id;
  colocated = self.same_host_as(from.identity);
  if (config.transport == Transport::kShm && !colocated) {
    return unreachable("peer " + id + " runs on host " + from.hostname +
                       ", but shared memory reaches only peers on this host (" + config.hostname +
                       "); use transport tcp or auto");
  }
  if (colocated) {
    auto w = ProcessWatch::open(from.identity.pid, from.identity.start_time);
    if (!w) return w.status().with_context("connecting to " + id);
    watch = std::move(*w);
  }
  // Peer error handling would force UCX off shared memory, so it is used only where the
  // peer is reached over a network transport; co-located peers are watched by pidfd.
  const bool network = config.transport == Transport::kTcp || !colocated;
  err_mode = network ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  RD2H_RETURN_IF_ERROR(connect_endpoint(context, config, from));
  RD2H_RETURN_IF_ERROR(import_regions(config, from));
  RD2H_RETURN_IF_ERROR(await_wireup(config.connect_timeout));
  choose_read_path(config.read_path);
  peer = std::move(from);
  return Status::ok();
}

Status Session::connect_endpoint(ucp_context_h context, const EngineConfig& config,
                                 const UcxMetadata& from) {
  auto w = create_worker(context);
  if (!w) return w.status().with_context("connecting to " + id);
  worker = std::move(*w);
  RD2H_RETURN_IF_ERROR(set_am_handler(worker.get(), kAmReadReply, on_am_read_reply, this));
  RD2H_RETURN_IF_ERROR(set_am_handler(worker.get(), kAmLinkMessage, on_am_link_message, this));
  RD2H_TRY(address, transfer::worker_address(worker.get()));
  worker_address = std::move(address);

  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.address = reinterpret_cast<const ucp_address_t*>(from.worker_address.data());
  params.err_mode = err_mode;
  if (err_mode == UCP_ERR_HANDLING_MODE_PEER) {
    params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.err_handler.cb = on_endpoint_error;
    params.err_handler.arg = this;
  }
  ucp_ep_h created = nullptr;
  if (ucs_status_t st = ucp_ep_create(worker.get(), &params, &created); st != UCS_OK) {
    return unreachable("cannot reach peer " + id + " (it serves over " + from.transport +
                       ", this engine uses " + std::string(to_string(config.transport)) +
                       "): " + ucs_status_string(st));
  }
  ep = UcxEndpoint(worker.get(), created, err_mode == UCP_ERR_HANDLING_MODE_PEER);
  return Status::ok();
}

Status Session::import_regions(const EngineConfig& config, const UcxMetadata& from) {
  const bool mappable = colocated && config.transport != Transport::kTcp;
  for (size_t i = 0; i < from.regions.size(); ++i) {
    const ExportedRegion& r = from.regions[i];
    ucp_rkey_h rkey = nullptr;
    if (ucs_status_t st = ucp_ep_rkey_unpack(ep.get(), r.packed_rkey.data(), &rkey); st != UCS_OK) {
      return invalid_metadata("region " + std::to_string(i) + " of peer " + id +
                              ": its rkey does not unpack: " + ucs_status_string(st));
    }
    rkeys.emplace_back(rkey);
    const std::byte* at = mappable ? map_region(rkey, r) : nullptr;
    if (at == nullptr && mappable && r.fd >= 0) {
      auto file = PeerMapping::map(from.identity.pid, r.fd, r.inode, r.file_offset, r.length,
                                   r.live_offset);
      if (file) {
        at = file->data();
        file_maps.resize(i);
        file_maps.push_back(std::move(*file));
      }
      // Otherwise (not permitted here, say) the region is read over the am path.
    }
    mapped.push_back(at);
  }
  return Status::ok();
}

// A flush completes once the endpoint is wired up with the peer: an unreachable peer fails
// here, within the connect timeout, rather than on the first read.
Status Session::await_wireup(std::chrono::milliseconds timeout) {
  ucp_request_param_t fp{};
  void* req = ucp_ep_flush_nbx(ep.get(), &fp);
  if (UCS_PTR_IS_ERR(req)) {
    return unreachable("cannot reach peer " + id + ": " + ucs_status_string(UCS_PTR_STATUS(req)));
  }
  Status result = Status::ok();
  if (req != nullptr) {
    const Deadline deadline(timeout);
    while (ucp_request_check_status(req) == UCS_INPROGRESS) {
      ucp_worker_progress(worker.get());
      if (watch.exited()) {
        result = peer_dead("peer " + id + " exited while connecting");
        break;
      }
      if (deadline.expired()) {
        result = unreachable("peer " + id + " did not answer within " +
                             std::to_string(timeout.count()) + " ms");
        break;
      }
    }
    if (ucs_status_t st = ucp_request_check_status(req); result.is_ok() && st != UCS_OK) {
      result = unreachable("cannot reach peer " + id + ": " + ucs_status_string(st));
    }
    ucp_request_free(req);
  }
  if (result.is_ok() && ep_error != UCS_OK) {
    result = unreachable("cannot reach peer " + id + ": " + ucs_status_string(ep_error));
  }
  return result;
}

void Session::choose_read_path(ReadPath path) {
  const LaneTransports lanes = endpoint_lanes(ep.get());
  switch (path) {
    case ReadPath::kAuto:
      rma_get = rma_is_one_sided(lanes.rma);
      break;
    case ReadPath::kRma:
      rma_get = true;
      break;
    case ReadPath::kActiveMessage:
      rma_get = false;
      break;
  }
  // Without RMA lanes UCX emulates get over the active-message lanes.
  transport = join_transports(rma_get && !lanes.rma.empty() ? lanes.rma : lanes.am);
  if (std::any_of(mapped.begin(), mapped.end(), [](auto p) { return p != nullptr; })) {
    transport += "+mapped";
  }
}

void Session::release() {
  std::map<uint64_t, LinkHandler> gone;
  gone.swap(links);
  for (auto& [token, handler] : gone) handler(Notification::Kind::kClosed, {});
  mapped.clear();
  file_maps.clear();
  ep.close();
  rkeys.clear();  // after the endpoint's close has had its chance to flush reads using them
  worker.reset();
}

int64_t Session::find_region(uint64_t addr, uint64_t len) const {
  const auto& regions = peer.regions;
  auto it = std::upper_bound(regions.begin(), regions.end(), addr,
                             [](uint64_t a, const ExportedRegion& r) { return a < r.base; });
  if (it == regions.begin()) return -1;
  --it;
  if (addr + len > it->base + it->length) return -1;
  return it - regions.begin();
}

void on_endpoint_error(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* s = static_cast<Session*>(arg);
  if (s->ep_error == UCS_OK) s->ep_error = status;
}

ucs_status_t on_am_link_message(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param) {
  auto* s = static_cast<Session*>(arg);
  LinkMessageHeader h;
  if (header_length != sizeof(h) || !acceptable_link_message(length, param)) return UCS_OK;
  std::memcpy(&h, header, sizeof(h));
  auto it = s->links.find(h.token);
  if (it != s->links.end()) {
    it->second(Notification::Kind::kMessage, {static_cast<const std::byte*>(data), length});
  }
  return UCS_OK;
}

}  // namespace rd2h::transfer
