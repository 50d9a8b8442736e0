#include "topology/topology.h"

#include <string>

namespace rd2h::topology {

namespace {

constexpr int kMaxPort = 65535;
constexpr int kMaxTp = 1 << 12;

std::string s(int v) {
  return std::to_string(v);
}

Status check_port(long long port, const std::string& what) {
  if (port < 1 || port > kMaxPort) {
    return invalid_argument(what + " " + std::to_string(port) + " is outside 1.." + s(kMaxPort));
  }
  return Status::ok();
}

}  // namespace

Expected<TpMapping> make_tp_mapping(int p_tp_size, int d_tp_size) {
  if (p_tp_size < 1 || p_tp_size > kMaxTp || d_tp_size < 1 || d_tp_size > kMaxTp) {
    return invalid_argument("tensor-parallel sizes must be in 1.." + s(kMaxTp) + ", got Prefill " +
                            s(p_tp_size) + " and Decode " + s(d_tp_size));
  }
  if (p_tp_size < d_tp_size) {
    return invalid_argument("Prefill TP " + s(p_tp_size) + " is smaller than Decode TP " +
                            s(d_tp_size) + "; Prefill TP must be at least Decode TP");
  }
  if (p_tp_size % d_tp_size != 0) {
    return invalid_argument("Prefill TP " + s(p_tp_size) + " is not a multiple of Decode TP " +
                            s(d_tp_size));
  }
  return TpMapping{p_tp_size, d_tp_size, p_tp_size / d_tp_size};
}

Expected<ContributorPosition> contributor_of(const TpMapping& tp, int p_rank) {
  if (p_rank < 0 || p_rank >= tp.p_tp) {
    return invalid_argument("Prefill rank " + s(p_rank) + " is outside 0.." + s(tp.p_tp - 1));
  }
  return ContributorPosition{p_rank / tp.ratio, p_rank % tp.ratio};
}

Expected<std::vector<int>> contributor_group(const TpMapping& tp, int d_rank) {
  if (d_rank < 0 || d_rank >= tp.d_tp) {
    return invalid_argument("Decode rank " + s(d_rank) + " is outside 0.." + s(tp.d_tp - 1));
  }
  std::vector<int> group;
  for (int m = 0; m < tp.ratio; ++m) group.push_back(d_rank * tp.ratio + m);
  return group;
}

Expected<int> base_port(int kv_port, int global_dp_rank, int tp_size) {
  RD2H_RETURN_IF_ERROR(check_port(kv_port, "kv_port"));
  if (global_dp_rank < 0)
    return invalid_argument("global DP rank " + s(global_dp_rank) + " is negative");
  if (tp_size < 1 || tp_size > kMaxTp) {
    return invalid_argument("TP size " + s(tp_size) + " is outside 1.." + s(kMaxTp));
  }
  const long long base = kv_port + static_cast<long long>(global_dp_rank) * tp_size;
  const long long highest = base + tp_size - 1;
  if (highest > kMaxPort) {
    return invalid_argument("kv_port " + s(kv_port) + " + global DP rank " + s(global_dp_rank) +
                            " x TP " + s(tp_size) + " puts the highest rank port at " +
                            std::to_string(highest) + ", beyond " + s(kMaxPort));
  }
  return static_cast<int>(base);
}

Expected<int> rank_port(int base, int tp_rank, int tp_size) {
  if (tp_rank < 0 || tp_rank >= tp_size) {
    return invalid_argument("TP rank " + s(tp_rank) + " is outside 0.." + s(tp_size - 1));
  }
  const long long port = static_cast<long long>(base) + tp_rank;
  RD2H_RETURN_IF_ERROR(
      check_port(port, "rank port (base " + s(base) + " + rank " + s(tp_rank) + ")"));
  return static_cast<int>(port);
}

Expected<int> remote_rank_port(int d_base_port, const TpMapping& tp, int p_rank) {
  RD2H_RETURN_IF_ERROR(check_port(d_base_port, "Decode base port"));
  RD2H_TRY(pos, contributor_of(tp, p_rank));
  return rank_port(d_base_port, pos.d_rank, tp.d_tp);
}

}  // namespace rd2h::topology
