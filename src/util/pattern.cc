#include "util/pattern.h"

#include <cstring>

namespace rd2h {

namespace {

// Word i of the pattern. A multiply-add per word keeps generation near memory speed while
// giving every word of every key a distinct value.
inline uint64_t pattern_word(uint64_t seed, size_t i) {
  return seed + static_cast<uint64_t>(i) * 0xd1342543de82ef95ULL;
}

}  // namespace

void fill_pattern(void* dst, size_t len, uint64_t key) {
  const uint64_t seed = splitmix64(key);
  auto* out = static_cast<unsigned char*>(dst);
  size_t words = len / 8;
  for (size_t i = 0; i < words; ++i) {
    uint64_t w = pattern_word(seed, i);
    std::memcpy(out + i * 8, &w, 8);
  }
  if (size_t tail = len % 8) {
    uint64_t w = pattern_word(seed, words);
    std::memcpy(out + words * 8, &w, tail);
  }
}

std::optional<size_t> find_pattern_mismatch(const void* src, size_t len, uint64_t key) {
  const uint64_t seed = splitmix64(key);
  const auto* in = static_cast<const unsigned char*>(src);
  size_t words = len / 8;
  for (size_t i = 0; i < words; ++i) {
    uint64_t want = pattern_word(seed, i), have;
    std::memcpy(&have, in + i * 8, 8);
    if (have != want) {
      for (size_t b = 0; b < 8; ++b) {
        if (((have >> (8 * b)) & 0xff) != ((want >> (8 * b)) & 0xff)) return i * 8 + b;
      }
    }
  }
  if (size_t tail = len % 8) {
    uint64_t want = pattern_word(seed, words);
    for (size_t b = 0; b < tail; ++b) {
      if (in[words * 8 + b] != ((want >> (8 * b)) & 0xff)) return words * 8 + b;
    }
  }
  return std::nullopt;
}

}  // namespace rd2h
