// A JSON number read as an integer type only when it is one that type holds: nlohmann's
// get<T> would convert a float, or an integer beyond T's range, by a cast (undefined for a
// float). `Json` is nlohmann::json or nlohmann::ordered_json; this header needs neither.
#pragma once

#include <cstdint>
#include <utility>

namespace rd2h {

template <typename T, typename Json>
bool whole_number(const Json& v, T& out) {
  if (v.is_number_unsigned()) {
    const auto u = v.template get<uint64_t>();
    if (!std::in_range<T>(u)) return false;
    out = static_cast<T>(u);
    return true;
  }
  if (v.is_number_integer()) {
    const auto i = v.template get<int64_t>();
    if (!std::in_range<T>(i)) return false;
    out = static_cast<T>(i);
    return true;
  }
  return false;
}

}  // namespace rd2h
