// Formatting shared by error messages: addresses in hex, byte ranges as [start, +length).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace rd2h {

inline std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

// Appended piece by piece: GCC 12 at -O3 reports a false -Wrestrict on
// `"literal" + std::string` (a known GCC 12 bug, inside std::string::insert).
inline std::string range_text(uint64_t addr, uint64_t len) {
  std::string s = "[";
  s += hex(addr);
  s += ", +";
  s += std::to_string(len);
  s += ')';
  return s;
}

}  // namespace rd2h
