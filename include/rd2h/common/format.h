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

inline std::string range_text(uint64_t addr, uint64_t len) {
  return "[" + hex(addr) + ", +" + std::to_string(len) + ")";
}

}  // namespace rd2h
