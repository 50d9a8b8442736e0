// Prefill/Decode tensor-parallel mapping and connector ports (spec "Unequal Prefill and
// Decode TP" and "Ports and Endpoint Identity"). Pure functions; every invalid input is an
// error naming the values.
#pragma once

#include <vector>

#include "rd2h/common/status.h"

namespace rd2h::topology {

// p_tp >= d_tp, p_tp % d_tp == 0, ratio = p_tp / d_tp.
struct TpMapping {
  int p_tp = 1;
  int d_tp = 1;
  int ratio = 1;
};
Expected<TpMapping> make_tp_mapping(int p_tp_size, int d_tp_size);

// Where a Prefill rank sends: d_rank = p_rank / ratio, group_member_idx = p_rank % ratio.
struct ContributorPosition {
  int d_rank = 0;
  int group_member_idx = 0;
};
Expected<ContributorPosition> contributor_of(const TpMapping& tp, int p_rank);

// The Prefill ranks mapped to one Decode rank (its contributor group), member 0 first.
Expected<std::vector<int>> contributor_group(const TpMapping& tp, int d_rank);

// Decode binds base_port + tp_rank, base_port = kv_port + global_dp_rank * tp_size. The
// base port is valid only if the highest rank port of the engine fits in 1..65535.
Expected<int> base_port(int kv_port, int global_dp_rank, int tp_size);
Expected<int> rank_port(int base, int tp_rank, int tp_size);

// The Decode rank port a Prefill rank connects to, from the base port Decode advertised.
Expected<int> remote_rank_port(int d_base_port, const TpMapping& tp, int p_rank);

}  // namespace rd2h::topology
