#include "protocol/msgpack_cursor.h"

#include <vector>

#include "protocol/messages.h"

namespace rd2h::protocol {

bool Cursor::header(Header& h) {
  if (p_ == end_) return false;
  const uint8_t b = *p_++;
  h = Header{};
  h.format = b;
  auto big = [&](size_t bytes, uint64_t& out) {
    if (left() < bytes) return false;
    out = 0;
    for (size_t k = 0; k < bytes; ++k) out = (out << 8) | *p_++;
    return true;
  };
  auto set_signed = [&](int64_t v) {
    h.kind = Header::kInt;
    h.negative = v < 0;
    h.i = v;
    h.u = static_cast<uint64_t>(v);
  };
  uint64_t v = 0;
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
    set_signed(static_cast<int8_t>(b));
  } else {
    switch (b) {
      case 0xc0:
        h.kind = Header::kNil;
        break;
      case 0xc2:
      case 0xc3:
        h.kind = Header::kBool;
        h.u = b & 1;
        break;
      case 0xc4:
      case 0xc5:
      case 0xc6:
        h.kind = Header::kBin;
        if (!big(size_t{1} << (b - 0xc4), h.n)) return false;
        break;
      case 0xc7:
      case 0xc8:
      case 0xc9:
        h.kind = Header::kExt;
        if (!big(size_t{1} << (b - 0xc7), h.n)) return false;
        h.n += 1;
        break;
      case 0xca:
      case 0xcb:
        h.kind = Header::kFloat;
        h.n = b == 0xca ? 4 : 8;
        break;
      case 0xcc:
      case 0xcd:
      case 0xce:
      case 0xcf:
        h.kind = Header::kInt;
        if (!big(size_t{1} << (b - 0xcc), h.u)) return false;
        break;
      case 0xd0:
      case 0xd1:
      case 0xd2:
      case 0xd3: {
        const size_t bytes = size_t{1} << (b - 0xd0);
        if (!big(bytes, v)) return false;
        const int shift = static_cast<int>(64 - 8 * bytes);
        set_signed(static_cast<int64_t>(v << shift) >> shift);
        break;
      }
      case 0xd4:
      case 0xd5:
      case 0xd6:
      case 0xd7:
      case 0xd8:
        h.kind = Header::kExt;
        h.n = (size_t{1} << (b - 0xd4)) + 1;
        break;
      case 0xd9:
      case 0xda:
      case 0xdb:
        h.kind = Header::kStr;
        if (!big(size_t{1} << (b - 0xd9), h.n)) return false;
        break;
      case 0xdc:
      case 0xdd:
        h.kind = Header::kArray;
        if (!big(b == 0xdc ? 2 : 4, h.n)) return false;
        break;
      case 0xde:
      case 0xdf:
        h.kind = Header::kMap;
        if (!big(b == 0xde ? 2 : 4, h.n)) return false;
        break;
      default:
        h.kind = Header::kInvalid;  // 0xc1, never used
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
