#include "protocol/msgpack_cursor.h"

#include <array>
#include <vector>

#include "protocol/messages.h"

namespace rd2h::protocol {

namespace {

// What follows a format byte that is not a fix format (msgpack's spec, "Formats").
struct Follows {
  enum What : uint8_t {
    kNothing,    // nil, bool: the byte is all
    kBody,       // a body of `bytes` (float, fixext)
    kLength,     // a big-endian length of `bytes`, then that body (str, bin)
    kExtLength,  // the same, and the body starts with its type byte (ext)
    kCount,      // a big-endian item or pair count of `bytes` (array, map)
    kUnsigned,   // a big-endian unsigned integer of `bytes`
    kSigned,     // a big-endian two's complement integer of `bytes`
  };
  Header::Kind kind;
  What what;
  uint8_t bytes;
};

// 0xc0 to 0xdf; 0xc1 is never used.
constexpr Follows follows(uint8_t b) {
  const auto pow2 = [](int k) { return static_cast<uint8_t>(1u << k); };
  if (b >= 0xc4 && b <= 0xc6) return {Header::kBin, Follows::kLength, pow2(b - 0xc4)};
  if (b >= 0xc7 && b <= 0xc9) return {Header::kExt, Follows::kExtLength, pow2(b - 0xc7)};
  if (b == 0xca || b == 0xcb)
    return {Header::kFloat, Follows::kBody, b == 0xca ? uint8_t{4} : uint8_t{8}};
  if (b >= 0xcc && b <= 0xcf) return {Header::kInt, Follows::kUnsigned, pow2(b - 0xcc)};
  if (b >= 0xd0 && b <= 0xd3) return {Header::kInt, Follows::kSigned, pow2(b - 0xd0)};
  if (b >= 0xd4 && b <= 0xd8)
    return {Header::kExt, Follows::kBody, static_cast<uint8_t>(pow2(b - 0xd4) + 1)};
  if (b >= 0xd9 && b <= 0xdb) return {Header::kStr, Follows::kLength, pow2(b - 0xd9)};
  if (b == 0xdc || b == 0xdd)
    return {Header::kArray, Follows::kCount, b == 0xdc ? uint8_t{2} : uint8_t{4}};
  if (b == 0xde || b == 0xdf)
    return {Header::kMap, Follows::kCount, b == 0xde ? uint8_t{2} : uint8_t{4}};
  if (b == 0xc0) return {Header::kNil, Follows::kNothing, 0};
  if (b == 0xc2 || b == 0xc3) return {Header::kBool, Follows::kNothing, 0};
  return {Header::kInvalid, Follows::kNothing, 0};
}

// follows() for every byte from 0xc0 to 0xdf, worked out at compile time: one load a header.
constexpr std::array<Follows, 32> kFollows = [] {
  std::array<Follows, 32> table{};
  for (int b = 0xc0; b <= 0xdf; ++b) table[b - 0xc0] = follows(static_cast<uint8_t>(b));
  return table;
}();

void set_signed(Header& h, int64_t v) {
  h.kind = Header::kInt;
  h.negative = v < 0;
  h.i = v;
  h.u = static_cast<uint64_t>(v);
}

// The fix formats, whose byte carries the value or the size: false for any other byte.
bool fix_format(uint8_t b, Header& h) {
  if (b <= 0x7f) {
    h.kind = Header::kInt;
    h.u = b;
  } else if (b <= 0x8f) {
    h.kind = Header::kMap;
    h.n = b & 0x0f;
  } else if (b <= 0x9f) {
    h.kind = Header::kArray;
    h.n = b & 0x0f;
  } else if (b <= 0xbf) {
    h.kind = Header::kStr;
    h.n = b & 0x1f;
  } else if (b >= 0xe0) {
    set_signed(h, static_cast<int8_t>(b));
  } else {
    return false;
  }
  return true;
}

}  // namespace

bool Cursor::big_endian(size_t bytes, uint64_t& out) {
  if (left() < bytes) return false;
  out = 0;
  for (size_t k = 0; k < bytes; ++k) out = (out << 8) | *p_++;
  return true;
}

bool Cursor::header(Header& h) {
  if (p_ == end_) return false;
  const uint8_t b = *p_++;
  h = Header{};
  h.format = b;
  if (fix_format(b, h)) return true;
  const Follows f = kFollows[b - 0xc0];  // fix_format took every byte outside 0xc0..0xdf
  h.kind = f.kind;
  uint64_t v = 0;
  switch (f.what) {
    case Follows::kNothing:
      if (h.kind == Header::kBool) h.u = b & 1;
      return true;
    case Follows::kBody:
      h.n = f.bytes;
      return true;
    case Follows::kLength:
    case Follows::kCount:
      return big_endian(f.bytes, h.n);
    case Follows::kExtLength:
      if (!big_endian(f.bytes, h.n)) return false;
      h.n += 1;
      return true;
    case Follows::kUnsigned:
      return big_endian(f.bytes, h.u);
    case Follows::kSigned: {
      if (!big_endian(f.bytes, v)) return false;
      const int shift = static_cast<int>(64 - 8 * f.bytes);
      set_signed(h, static_cast<int64_t>(v << shift) >> shift);
      return true;
    }
  }
  return true;
}

bool Cursor::skip_values(uint64_t count) {
  uint64_t pending = count;
  while (pending > 0) {
    if (pending > left()) return false;
    Header h;
    if (!header(h)) return false;
    --pending;
    switch (h.kind) {
      case Header::kArray:
        pending += h.n;
        break;
      case Header::kMap:
        pending += 2 * static_cast<uint64_t>(h.n);
        break;
      case Header::kStr:
      case Header::kBin:
      case Header::kExt:
      case Header::kFloat:
        if (!skip(h.n)) return false;
        break;
      case Header::kInvalid:
        return false;
      default:
        break;
    }
  }
  return true;
}

Status check_msgpack_bounds(std::span<const std::byte> bytes, size_t max_depth,
                            std::string_view what) {
  const std::string name(what);
  if (bytes.empty()) return invalid_argument(name + ": empty");
  Cursor c(bytes);
  std::vector<uint64_t> open;  // items left in each open container, innermost last
  bool top_read = false;
  for (;;) {
    while (!open.empty() && open.back() == 0) open.pop_back();
    if (open.empty() && top_read) break;
    const size_t at_offset = c.offset();
    Header h;
    if (!c.header(h))
      return invalid_argument(name + ": truncated at byte " + std::to_string(at_offset));
    if (open.empty()) {
      top_read = true;
    } else {
      --open.back();
    }
    switch (h.kind) {
      case Header::kInvalid:
        return invalid_argument(name + ": not valid msgpack (byte 0xc1 at " +
                                std::to_string(at_offset) + ")");
      case Header::kStr:
      case Header::kBin:
      case Header::kExt:
      case Header::kFloat:
        if (!c.skip(h.n)) {
          return invalid_argument(name + ": truncated at byte " + std::to_string(at_offset));
        }
        break;
      case Header::kArray:
      case Header::kMap: {
        if (open.size() + 1 > max_depth) {
          return invalid_argument(name + ": nested deeper than " + std::to_string(max_depth) +
                                  " levels (at byte " + std::to_string(at_offset) + ")");
        }
        const uint64_t items = h.kind == Header::kMap ? 2 * h.n : h.n;
        if (items > c.left()) {
          return invalid_argument(name + ": not valid msgpack (a container of " +
                                  std::to_string(items) + " items in the " +
                                  std::to_string(c.left()) + " bytes left, at byte " +
                                  std::to_string(at_offset) + ")");
        }
        open.push_back(items);
        break;
      }
      default:
        break;
    }
  }
  if (c.left() != 0) {
    return invalid_argument(name + ": " + std::to_string(c.left()) +
                            " trailing bytes after the value");
  }
  return Status::ok();
}

}  // namespace rd2h::protocol
