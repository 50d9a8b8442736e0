// Deterministic byte patterns for verifying transfers: the bytes of a range depend only on
// a 64-bit key, so a reader can check what it received without a copy of the source.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

namespace rd2h {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Fills `len` bytes with the pattern of `key`.
void fill_pattern(void* dst, size_t len, uint64_t key);
// The offset of the first byte that differs from the pattern of `key`, if any.
std::optional<size_t> find_pattern_mismatch(const void* src, size_t len, uint64_t key);

}  // namespace rd2h
