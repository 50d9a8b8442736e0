// The Decode TP group's CPU all-gather, as the host engine provides it to get_finished
// (spec "Request completion": a request is done once every Decode TP rank reached a
// terminal state for it).
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "rd2h/common/status.h"

namespace rd2h::decode {

// What one rank reports to the others when gathering: ext id -> failed.
using RankTerminal = std::map<std::string, bool>;
// Exchanges every rank's RankTerminal over the TP CPU group; returns one per rank, in rank
// order, the same on every rank.
using AllGather = std::function<Expected<std::vector<RankTerminal>>(const RankTerminal&)>;

}  // namespace rd2h::decode
