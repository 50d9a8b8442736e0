// Reading msgpack in place: a forward-only cursor over borrowed bytes that decodes without
// building an object tree. Every protocol message is read with it, and every untrusted
// msgpack value passes its bounds check before a recursive parser sees it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "rd2h/common/status.h"

namespace rd2h::protocol {

// One msgpack header as read in place. For str, bin, ext and float, `n` is the size of the
// body that follows (ext: with its type byte); for arrays the item count and for maps the
// pair count. Integers carry their value.
struct Header {
  enum Kind { kNil, kBool, kInt, kFloat, kStr, kBin, kArray, kMap, kExt, kInvalid };
  Kind kind = kInvalid;
  uint64_t n = 0;
  bool negative = false;  // an int below zero: value in i, else in u
  uint64_t u = 0;
  int64_t i = 0;
  uint8_t format = 0;
};

inline const char* kind_name(const Header& h) {
  switch (h.kind) {
    case Header::kNil:
      return "nil";
    case Header::kBool:
      return "bool";
    case Header::kInt:
      return "int";
    case Header::kFloat:
      return "float";
    case Header::kStr:
      return "str";
    case Header::kBin:
      return "bin";
    case Header::kArray:
      return "array";
    case Header::kMap:
      return "map";
    case Header::kExt:
      return "ext";
    case Header::kInvalid:
      break;
  }
  return "invalid byte";
}

// A forward-only reader of msgpack over borrowed bytes: decodes without building an object
// tree, so a message costs its decoded form and nothing else. Errors name a path, built only
// when there is an error.
class Cursor {
 public:
  explicit Cursor(std::span<const std::byte> bytes)
      : begin_(reinterpret_cast<const uint8_t*>(bytes.data())),
        p_(begin_),
        end_(begin_ + bytes.size()) {}

  size_t left() const { return static_cast<size_t>(end_ - p_); }
  size_t offset() const { return static_cast<size_t>(p_ - begin_); }

  // Reads the next header; false when the input ends inside it.
  bool header(Header& h);

  // Skips a body of `n` bytes after a header; false when the input is shorter.
  bool skip(uint64_t n) {
    if (n > left()) return false;
    p_ += n;
    return true;
  }
  const char* here() const { return reinterpret_cast<const char*>(p_); }

  Status truncated() const { return invalid_argument(what_ + ": truncated"); }

  // The next value as an array header with `min` to `max` items.
  template <typename Where>
  Expected<size_t> array(Where&& where, size_t min_items, size_t max_items) {
    Header h;
    if (!header(h)) return truncated();
    if (h.kind != Header::kArray) return error(where, "expected an array, got ", h);
    if (h.n > left()) {
      return invalid_argument(what_ + ": not valid msgpack (an array of " + std::to_string(h.n) +
                              " items in the " + std::to_string(left()) + " bytes left)");
    }
    if (h.n < min_items || h.n > max_items) {
      return invalid_argument(where() + ": " + std::to_string(h.n) + " elements, expected " +
                              (min_items == max_items ? std::to_string(min_items)
                                                      : std::to_string(min_items) + " to " +
                                                            std::to_string(max_items)));
    }
    return static_cast<size_t>(h.n);
  }

  template <typename Where>
  Expected<std::string_view> str(Where&& where, size_t max_bytes) {
    Header h;
    if (!header(h)) return truncated();
    if (h.kind != Header::kStr) return error(where, "expected a str, got ", h);
    if (h.n > max_bytes) {
      return invalid_argument(where() + ": string of " + std::to_string(h.n) + " bytes exceeds " +
                              std::to_string(max_bytes));
    }
    const char* body = here();
    if (!skip(h.n)) return truncated();
    return std::string_view(body, h.n);
  }

  template <typename Where>
  Expected<std::string_view> bin(Where&& where) {
    Header h;
    if (!header(h)) return truncated();
    if (h.kind != Header::kBin) return error(where, "expected bin, got ", h);
    const char* body = here();
    if (!skip(h.n)) return truncated();
    return std::string_view(body, h.n);
  }

  // The next value as a map header with at most `max_pairs` pairs.
  template <typename Where>
  Expected<size_t> map(Where&& where, size_t max_pairs) {
    Header h;
    if (!header(h)) return truncated();
    if (h.kind != Header::kMap) return error(where, "expected a map, got ", h);
    if (h.n > max_pairs) {
      return invalid_argument(where() + ": " + std::to_string(h.n) +
                              " entries exceed the limit of " + std::to_string(max_pairs));
    }
    if (2 * h.n > left()) {
      return invalid_argument(what_ + ": not valid msgpack (a map of " + std::to_string(h.n) +
                              " entries in the " + std::to_string(left()) + " bytes left)");
    }
    return static_cast<size_t>(h.n);
  }
  template <typename Where>
  Expected<bool> boolean(Where&& where) {
    Header h;
    if (!header(h)) return truncated();
    if (h.kind != Header::kBool) {
      if (!skip_body(h)) return truncated();
      return error(where, "expected a bool, got ", h);
    }
    return h.u != 0;
  }
  // A non-negative integer of any size.
  template <typename Where>
  Expected<uint64_t> unsigned_int(Where&& where) {
    Header h;
    if (!header(h)) return truncated();
    if (h.kind != Header::kInt) {
      if (!skip_body(h)) return truncated();
      return error(where, "expected an unsigned integer, got ", h);
    }
    if (h.negative) return invalid_argument(where() + ": " + std::to_string(h.i) + " is negative");
    return h.u;
  }

  // An integer in [min, max].
  template <typename Where>
  Expected<int64_t> integer(Where&& where, int64_t min, int64_t max) {
    Header h;
    if (!header(h)) return truncated();
    if (h.kind != Header::kInt) {
      if (h.kind == Header::kFloat && !skip(h.n)) return truncated();
      return error(where, "expected an integer, got ", h);
    }
    if (!h.negative && h.u > static_cast<uint64_t>(max)) {
      return invalid_argument(where() + ": " + std::to_string(h.u) + " exceeds the limit of " +
                              std::to_string(max));
    }
    const int64_t v = h.negative ? h.i : static_cast<int64_t>(h.u);
    if (v < min) {
      return invalid_argument(where() + ": " + std::to_string(v) +
                              (min == 0 ? " is negative" : " is below " + std::to_string(min)));
    }
    return v;
  }

  // Skips `count` whole values (arrays and maps with everything in them) without
  // recursion; false when the input ends first. Each value takes a byte at least, so what
  // is still to skip is bounded by the bytes left.
  bool skip_values(uint64_t count);

  void set_what(std::string what) { what_ = std::move(what); }
  const std::string& what() const { return what_; }

 private:
  // Skips what follows a header of a scalar with a body (str, bin, ext, float).
  bool skip_body(const Header& h) {
    const bool has_body = h.kind == Header::kStr || h.kind == Header::kBin ||
                          h.kind == Header::kExt || h.kind == Header::kFloat;
    return !has_body || skip(h.n);
  }
  // Reads a big-endian unsigned number of `bytes`; false when the input is shorter.
  bool big_endian(size_t bytes, uint64_t& out);
  template <typename Where>
  Status error(Where&& where, const char* expected, const Header& h) const {
    return invalid_argument(where() + ": " + expected + kind_name(h));
  }

  const uint8_t* begin_;
  const uint8_t* p_;
  const uint8_t* end_;
  std::string what_ = "message";
};

}  // namespace rd2h::protocol
