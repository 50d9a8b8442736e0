// The simulator's IPC messages (engine core <-> TP rank processes, and the Decode ranks'
// gather; sim/ipc.h carries them): JSON documents as msgpack. Timeline events travel as compact
// arrays.
#pragma once

#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "rd2h/common/trace.h"
#include "util/json_number.h"

namespace rd2h::sim {

inline std::vector<std::byte> pack(const nlohmann::json& j) {
  const auto bytes = nlohmann::json::to_msgpack(j);
  std::vector<std::byte> out(bytes.size());
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

// How deep a simulator message may nest: nlohmann's msgpack reader recurses once per level.
inline constexpr size_t kMaxMessageDepth = 32;

// Builds the document as nlohmann's own from_msgpack does (its DOM builder), but refuses
// (the read stops) a container past kMaxMessageDepth, so the reader, which recurses once per
// level, never goes deeper than that. One pass: the bytes are read once.
class BoundedDom {
 public:
  using json = nlohmann::json;
  explicit BoundedDom(json& out) : dom_(out, /*allow_exceptions=*/false) {}
  bool null() { return dom_.null(); }
  bool boolean(bool v) { return dom_.boolean(v); }
  bool number_integer(json::number_integer_t v) { return dom_.number_integer(v); }
  bool number_unsigned(json::number_unsigned_t v) { return dom_.number_unsigned(v); }
  bool number_float(json::number_float_t v, const json::string_t& s) {
    return dom_.number_float(v, s);
  }
  bool string(json::string_t& v) { return dom_.string(v); }
  bool binary(json::binary_t& v) { return dom_.binary(v); }
  bool start_object(std::size_t n) { return ++depth_ <= kMaxMessageDepth && dom_.start_object(n); }
  bool key(json::string_t& v) { return dom_.key(v); }
  bool end_object() { return --depth_, dom_.end_object(); }
  bool start_array(std::size_t n) { return ++depth_ <= kMaxMessageDepth && dom_.start_array(n); }
  bool end_array() { return --depth_, dom_.end_array(); }
  template <typename Exception>
  bool parse_error(std::size_t at, const std::string& token, const Exception& e) {
    return dom_.parse_error(at, token, e);
  }

 private:
  nlohmann::detail::json_sax_dom_parser<json> dom_;
  size_t depth_ = 0;
};

// A discarded value when `bytes` is not msgpack or nests deeper than kMaxMessageDepth (the
// refusal is logged).
inline nlohmann::json unpack(const std::vector<std::byte>& bytes) {
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  nlohmann::json out;
  BoundedDom dom(out);
  if (!nlohmann::json::sax_parse(p, p + bytes.size(), &dom, nlohmann::json::input_format_t::msgpack,
                                 /*strict=*/true)) {
    std::fprintf(stderr,
                 "rd2h sim: a message of %zu bytes is not msgpack nested at most %zu deep\n",
                 bytes.size(), kMaxMessageDepth);
    return nlohmann::json(nlohmann::json::value_t::discarded);
  }
  return out;
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
