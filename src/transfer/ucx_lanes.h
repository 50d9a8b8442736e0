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

// True when RMA goes over RDMA hardware (InfiniBand/RoCE transports), where ucp_get is a
// true one-sided read; elsewhere UCX 1.13 emulates it in software.
bool uses_hardware_rma(const std::set<std::string>& rma_transports);

// "a,b,c", or "unknown" when empty.
std::string join_transports(const std::set<std::string>& names);

}  // namespace rd2h::transfer
