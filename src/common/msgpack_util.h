// What every msgpack format of the project writes and names the same way, over msgpack-cxx:
// str and bin from views, a byte vector as the packer's output, and the name of an object's
// type for error messages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <msgpack.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace rd2h::msgpack_util {

// Appends what a msgpack packer writes to a byte vector.
struct ByteSink {
  std::vector<std::byte>& out;
  // Grown and then copied into, rather than vector::insert, which GCC 12 at -O3 wrongly
  // reports as an overflow once inlined into a packer of a fresh vector.
  void write(const char* p, size_t n) {
    if (n == 0) return;  // an empty str or bin body: `p` may be null, which memcpy must not get
    const size_t at = out.size();
    out.resize(at + n);
    std::memcpy(out.data() + at, p, n);
  }
};

template <typename Packer>
void pack_str(Packer& pk, std::string_view s) {
  pk.pack_str(static_cast<uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

template <typename Packer>
void pack_bin(Packer& pk, std::span<const std::byte> b) {
  pk.pack_bin(static_cast<uint32_t>(b.size()));
  pk.pack_bin_body(reinterpret_cast<const char*>(b.data()), static_cast<uint32_t>(b.size()));
}

template <typename Packer>
void pack_bin(Packer& pk, std::string_view s) {
  pk.pack_bin(static_cast<uint32_t>(s.size()));
  pk.pack_bin_body(s.data(), static_cast<uint32_t>(s.size()));
}

// msgpack's name of the object's type: "nil", "int", "str", "map"...
inline std::string type_name(const msgpack::object& o) {
  switch (o.type) {
    case msgpack::type::NIL:
      return "nil";
    case msgpack::type::BOOLEAN:
      return "bool";
    case msgpack::type::POSITIVE_INTEGER:
    case msgpack::type::NEGATIVE_INTEGER:
      return "int";
    case msgpack::type::FLOAT32:
    case msgpack::type::FLOAT64:
      return "float";
    case msgpack::type::STR:
      return "str";
    case msgpack::type::BIN:
      return "bin";
    case msgpack::type::ARRAY:
      return "array";
    case msgpack::type::MAP:
      return "map";
    case msgpack::type::EXT:
      return "ext";
  }
  return "unknown";
}

}  // namespace rd2h::msgpack_util
