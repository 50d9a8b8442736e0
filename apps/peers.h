// The peer engines' harness (apps/peers/bench_peers.py): where its interpreter and script
// are, and running it. Each peer is driven there through its own Python API.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "rd2h/common/status.h"

namespace rd2h::tools {

// The interpreter with the peers installed: `chosen` if set, else $RD2H_PEERS_PYTHON, else
// scripts/bench-venv's (a not-found error naming the install command if it is not there).
Expected<std::string> peers_python(const std::string& chosen);

// What the harness printed: its JSON objects, in order, and the last other line it wrote
// (its logging and errors come in on the same pipe), for a harness that failed.
struct HarnessOutput {
  std::vector<nlohmann::json> results;
  std::string last_words;
  int exit_status = 0;
};
Expected<HarnessOutput> run_peers_harness(const std::string& python,
                                          const std::vector<std::string>& args,
                                          std::chrono::seconds timeout);

}  // namespace rd2h::tools
