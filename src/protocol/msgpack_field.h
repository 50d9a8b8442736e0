// Reading msgpack through its object tree, bounded, for `rd2h pd-read`'s handshake (the
// protocol's messages are read with msgpack_cursor): a view of one value with its path, and
// a parse that builds the tree only once the bytes are known to bound it.
#pragma once

#include <msgpack.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/msgpack_util.h"
#include "protocol/messages.h"
#include "rd2h/common/status.h"

namespace rd2h::protocol {

// A bounded view of one msgpack object, with the path that led to it for error messages.
class Field {
 public:
  Field(const msgpack::object& o, std::string path) : o_(o), path_(std::move(path)) {}

  const std::string& path() const { return path_; }
  Status error(const std::string& what) const { return invalid_argument(path_ + ": " + what); }

  Expected<std::vector<Field>> array(size_t min_items, size_t max_items) const {
    if (o_.type != msgpack::type::ARRAY) return error("expected an array, got " + type_name());
    const size_t n = o_.via.array.size;
    if (n < min_items || n > max_items) {
      return error(std::to_string(n) + " elements, expected " +
                   (min_items == max_items
                        ? std::to_string(min_items)
                        : std::to_string(min_items) + " to " + std::to_string(max_items)));
    }
    std::vector<Field> items;
    items.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      items.emplace_back(o_.via.array.ptr[i], path_ + "[" + std::to_string(i) + "]");
    }
    return items;
  }

  Expected<std::string> str(size_t max_bytes = kMaxStringBytes) const {
    if (o_.type != msgpack::type::STR) return error("expected a str, got " + type_name());
    if (o_.via.str.size > max_bytes) {
      return error("string of " + std::to_string(o_.via.str.size) + " bytes exceeds " +
                   std::to_string(max_bytes));
    }
    return std::string(o_.via.str.ptr, o_.via.str.size);
  }

  Expected<std::string_view> bin() const {
    if (o_.type != msgpack::type::BIN) return error("expected bin, got " + type_name());
    return std::string_view(o_.via.bin.ptr, o_.via.bin.size);
  }

  // An integer in [min, max].
  Expected<int64_t> integer(int64_t min, int64_t max) const {
    int64_t v = 0;
    if (o_.type == msgpack::type::POSITIVE_INTEGER) {
      if (o_.via.u64 > static_cast<uint64_t>(max)) {
        return error(std::to_string(o_.via.u64) + " exceeds the limit of " + std::to_string(max));
      }
      v = static_cast<int64_t>(o_.via.u64);
    } else if (o_.type == msgpack::type::NEGATIVE_INTEGER) {
      v = o_.via.i64;
    } else {
      return error("expected an integer, got " + type_name());
    }
    if (v < min) {
      return error(std::to_string(v) +
                   (min == 0 ? " is negative" : " is below " + std::to_string(min)));
    }
    if (v > max) return error(std::to_string(v) + " exceeds the limit of " + std::to_string(max));
    return v;
  }

  Expected<uint64_t> unsigned_int() const {
    if (o_.type != msgpack::type::POSITIVE_INTEGER) {
      if (o_.type == msgpack::type::NEGATIVE_INTEGER) {
        return error(std::to_string(o_.via.i64) + " is negative");
      }
      return error("expected an unsigned integer, got " + type_name());
    }
    return o_.via.u64;
  }

  Expected<bool> boolean() const {
    if (o_.type != msgpack::type::BOOLEAN) return error("expected a bool, got " + type_name());
    return o_.via.boolean;
  }

  bool is_map() const { return o_.type == msgpack::type::MAP; }
  const msgpack::object& raw() const { return o_; }

  std::string type_name() const { return msgpack_util::type_name(o_); }

 private:
  const msgpack::object& o_;
  std::string path_;
};

// Parses one msgpack value that must span all of `bytes`. msgpack-c allocates a container's
// items when it reads its header, so every declared item is first checked to be present:
// the tree is bounded by the bytes, whatever the headers claim.
Expected<msgpack::object_handle> parse(std::span<const std::byte> bytes, const std::string& what);

}  // namespace rd2h::protocol
