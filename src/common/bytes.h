// Little-endian byte writer and a bounds-checked reader for rd2h's own binary formats
// (engine metadata, tool handshakes). The reader never reads past its span: every
// accessor fails with a Status naming the field that was truncated or oversized.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "rd2h/common/status.h"

namespace rd2h {

class ByteWriter {
 public:
  void u8(uint8_t v) { buf_.push_back(static_cast<std::byte>(v)); }
  void u32(uint32_t v) { put_le(v, 4); }
  void u64(uint64_t v) { put_le(v, 8); }
  void raw(const void* p, size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    buf_.insert(buf_.end(), b, b + n);
  }
  // u32 length, then the bytes.
  void bytes(std::span<const std::byte> b) {
    u32(static_cast<uint32_t>(b.size()));
    raw(b.data(), b.size());
  }
  void str(std::string_view s) { bytes(std::as_bytes(std::span(s.data(), s.size()))); }

  std::vector<std::byte>& buffer() { return buf_; }
  std::vector<std::byte> take() { return std::move(buf_); }

 private:
  void put_le(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) buf_.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xff));
  }
  std::vector<std::byte> buf_;
};

class ByteReader {
 public:
  explicit ByteReader(std::span<const std::byte> data) : data_(data) {}

  size_t remaining() const { return data_.size() - pos_; }
  bool at_end() const { return pos_ == data_.size(); }

  Expected<uint8_t> u8(std::string_view field) {
    RD2H_TRY(v, get_le(1, field));
    return static_cast<uint8_t>(v);
  }
  Expected<uint32_t> u32(std::string_view field) {
    RD2H_TRY(v, get_le(4, field));
    return static_cast<uint32_t>(v);
  }
  Expected<uint64_t> u64(std::string_view field) { return get_le(8, field); }

  // A u32-length-prefixed byte string of at most `max_len` bytes.
  Expected<std::span<const std::byte>> bytes(std::string_view field, size_t max_len) {
    RD2H_TRY(n, u32(field));
    if (n > max_len) {
      return invalid_metadata(std::string(field) + ": length " + std::to_string(n) +
                              " exceeds the limit of " + std::to_string(max_len));
    }
    if (n > remaining()) return truncated(field, n);
    auto out = data_.subspan(pos_, n);
    pos_ += n;
    return out;
  }
  Expected<std::string> str(std::string_view field, size_t max_len) {
    RD2H_TRY(b, bytes(field, max_len));
    return std::string(reinterpret_cast<const char*>(b.data()), b.size());
  }
  Expected<std::span<const std::byte>> raw(std::string_view field, size_t n) {
    if (n > remaining()) return truncated(field, n);
    auto out = data_.subspan(pos_, n);
    pos_ += n;
    return out;
  }

 private:
  Status truncated(std::string_view field, size_t want) const {
    return invalid_metadata("truncated at " + std::string(field) + ": needs " +
                            std::to_string(want) + " bytes, " + std::to_string(remaining()) +
                            " left");
  }
  Expected<uint64_t> get_le(int n, std::string_view field) {
    if (remaining() < static_cast<size_t>(n)) return truncated(field, n);
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) {
      v |= static_cast<uint64_t>(std::to_integer<uint8_t>(data_[pos_ + i])) << (8 * i);
    }
    pos_ += n;
    return v;
  }

  std::span<const std::byte> data_;
  size_t pos_ = 0;
};

}  // namespace rd2h
