// The simulator's IPC messages (engine core <-> TP rank processes, and the Decode ranks'
// gather; sim/ipc.h carries them): JSON documents as msgpack. Timeline events travel as compact
// arrays.
#pragma once

#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "common/json_number.h"
#include "common/trace.h"

namespace rd2h::sim {

inline std::vector<std::byte> pack(const nlohmann::json& j) {
  const auto bytes = nlohmann::json::to_msgpack(j);
  std::vector<std::byte> out(bytes.size());
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

// How deep a simulator message may nest: nlohmann's msgpack reader recurses once per level.
inline constexpr size_t kMaxMessageDepth = 32;

// Reads msgpack for its nesting alone, and stops (the read fails) once it passes
// kMaxMessageDepth, so the reader never recurses deeper than that.
class DepthCheck final : public nlohmann::json_sax<nlohmann::json> {
 public:
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return ++depth_ <= kMaxMessageDepth; }
  bool key(string_t&) override { return true; }
  bool end_object() override { return --depth_, true; }
  bool start_array(std::size_t) override { return ++depth_ <= kMaxMessageDepth; }
  bool end_array() override { return --depth_, true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return false;
  }

 private:
  size_t depth_ = 0;
};

// A discarded value when `bytes` is not msgpack or nests deeper than kMaxMessageDepth
// (checked first, and the refusal is logged).
inline nlohmann::json unpack(const std::vector<std::byte>& bytes) {
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  DepthCheck depth;
  if (!nlohmann::json::sax_parse(p, p + bytes.size(), &depth,
                                 nlohmann::json::input_format_t::msgpack, /*strict=*/true)) {
    std::fprintf(stderr,
                 "rd2h sim: a message of %zu bytes is not msgpack nested at most %zu deep\n",
                 bytes.size(), kMaxMessageDepth);
    return nlohmann::json(nlohmann::json::value_t::discarded);
  }
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
