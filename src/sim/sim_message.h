// The simulator's IPC messages (engine core <-> TP rank processes, and the Decode ranks'
// gather): JSON documents carried as msgpack. Timeline events travel as compact arrays.
#pragma once

#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "common/json_number.h"
#include "common/trace.h"
#include "protocol/messages.h"

namespace rd2h::sim {

inline std::vector<std::byte> pack(const nlohmann::json& j) {
  const auto bytes = nlohmann::json::to_msgpack(j);
  std::vector<std::byte> out(bytes.size());
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

// A discarded value when `bytes` is not msgpack, or nests deeper than
// protocol::kMaxNestingDepth (nlohmann's reader recurses once per level: checked first, and
// the refusal is logged).
inline nlohmann::json unpack(const std::vector<std::byte>& bytes) {
  if (Status st =
          protocol::check_msgpack_bounds(bytes, protocol::kMaxNestingDepth, "simulator message");
      !st) {
    std::fprintf(stderr, "rd2h sim: %s\n", st.message().c_str());
    return nlohmann::json(nlohmann::json::value_t::discarded);
  }
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  return nlohmann::json::from_msgpack(p, p + bytes.size(), /*strict=*/true,
                                      /*allow_exceptions=*/false);
}

inline nlohmann::json to_json(const std::vector<trace::Event>& events) {
  auto out = nlohmann::json::array();
  for (const auto& e : events) {
    out.push_back({e.name, e.lane, e.ts_us, e.dur_us, e.rank, e.layer, e.bytes, e.request});
  }
  return out;
}

// The well-formed events of `j`; the others are dropped.
inline std::vector<trace::Event> events_from_json(const nlohmann::json& j) {
  std::vector<trace::Event> out;
  if (!j.is_array()) return out;
  for (const auto& e : j) {
    if (!e.is_array() || e.size() != 8 || !e[0].is_string() || !e[1].is_string() ||
        !e[7].is_string()) {
      continue;
    }
    trace::Event ev{e[0].get<std::string>(), e[1].get<std::string>(), 0, 0, 0, 0, 0,
                    e[7].get<std::string>()};
    if (whole_number(e[2], ev.ts_us) && whole_number(e[3], ev.dur_us) &&
        whole_number(e[4], ev.rank) && whole_number(e[5], ev.layer) &&
        whole_number(e[6], ev.bytes)) {
      out.push_back(std::move(ev));
    }
  }
  return out;
}

}  // namespace rd2h::sim
