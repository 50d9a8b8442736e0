#include "transfer/ucx_lanes.h"

#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace rd2h::transfer {

LaneTransports parse_lane_transports(std::string_view ep_info) {
  LaneTransports lanes;
  std::istringstream lines{std::string(ep_info)};
  std::string line;
  while (std::getline(lines, line)) {
    auto lane = line.find("lane[");
    auto arrow = line.find("->");
    if (lane == std::string::npos || arrow == std::string::npos) continue;
    auto slash = line.find('/', lane);
    if (slash == std::string::npos || slash > arrow) continue;
    auto colon = line.rfind(':', slash);
    if (colon == std::string::npos || colon < lane) continue;
    std::string tl = line.substr(colon + 1, slash - colon - 1);
    tl.erase(0, tl.find_first_not_of(' '));
    if (tl.empty()) continue;
    std::istringstream roles(line.substr(arrow + 2));
    std::string role;
    roles >> role;  // the remote md/transport
    while (roles >> role) {
      if (role == "am" || role.rfind("am_bw", 0) == 0) lanes.am.insert(tl);
      if (role.rfind("rma", 0) == 0) lanes.rma.insert(tl);
    }
  }
  return lanes;
}

LaneTransports endpoint_lanes(ucp_ep_h ep) {
  char* text = nullptr;
  size_t size = 0;
  FILE* f = ::open_memstream(&text, &size);
  if (f == nullptr) return {};
  ucp_ep_print_info(ep, f);
  std::fclose(f);
  std::string info(text, size);
  std::free(text);
  return parse_lane_transports(info);
}

bool rma_is_one_sided(const std::set<std::string>& rma_transports) {
  if (rma_transports.empty()) return false;
  for (const auto& tl : rma_transports) {
    bool one_sided = false;
    for (const char* rdma : {"rc", "dc", "gga"}) one_sided = one_sided || tl.rfind(rdma, 0) == 0;
    if (!one_sided) return false;
  }
  return true;
}

std::string join_transports(const std::set<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ",") + n;
  return out.empty() ? "unknown" : out;
}

}  // namespace rd2h::transfer
