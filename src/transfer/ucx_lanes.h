// Which UCX transports an endpoint really uses, and for what. UCX may silently choose
// another transport than the one asked for (TCP instead of shared memory when peer error
// handling is requested), so the engine reads the choice back and reports it.
#pragma once

#include <ucp/api/ucp.h>

#include <set>
#include <string>
#include <string_view>

namespace rd2h::transfer {

struct LaneTransports {
  std::set<std::string> am;   // transports carrying active messages
  std::set<std::string> rma;  // transports carrying RMA (get/put)
};

// Parses UCX's description of an endpoint (ucp_ep_print_info; UCX 1.13 has no query for
// it). Lane lines look like
//   "#  lane[2]:  2:cma/memory.0 md[2]  -> md[2]/cma/sysdev[255] rma_bw#0"
LaneTransports parse_lane_transports(std::string_view ep_info);
LaneTransports endpoint_lanes(ucp_ep_h ep);

// True when every RMA lane is RDMA hardware (InfiniBand/RoCE), where ucp_get reads without
// the peer's help. Elsewhere UCX 1.13 emulates get in software (TCP, shared-memory FIFOs),
// or, for cross-memory attach (cma), a reader killed mid-read was seen to leave the
// source's shared-memory receive queue stuck; those sessions read over active messages.
bool rma_is_one_sided(const std::set<std::string>& rma_transports);

// "a,b,c", or "unknown" when empty.
std::string join_transports(const std::set<std::string>& names);

}  // namespace rd2h::transfer
