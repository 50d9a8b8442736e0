#include "protocol/msgpack_field.h"

#include <algorithm>

namespace rd2h::protocol {

Expected<msgpack::object_handle> parse(std::span<const std::byte> bytes, const std::string& what) {
  if (bytes.size() > kMaxMessageBytes) {
    return invalid_argument(what + ": " + std::to_string(bytes.size()) +
                            " bytes exceed the limit of " + std::to_string(kMaxMessageBytes));
  }
  if (bytes.empty()) return invalid_argument(what + ": empty");
  RD2H_RETURN_IF_ERROR(check_msgpack_bounds(bytes, kTreeDepth, what));
  const size_t items = std::min(bytes.size(), kMaxArrayItems);
  msgpack::unpack_limit limit(items, items, kMaxMessageBytes, kMaxMessageBytes, 0, kTreeDepth);
  size_t offset = 0;
  try {
    auto oh = msgpack::unpack(reinterpret_cast<const char*>(bytes.data()), bytes.size(), offset,
                              nullptr, nullptr, limit);
    if (offset != bytes.size()) {
      return invalid_argument(what + ": " + std::to_string(bytes.size() - offset) +
                              " trailing bytes after the message");
    }
    return oh;
  } catch (const msgpack::insufficient_bytes&) {
    return invalid_argument(what + ": truncated");
  } catch (const std::exception& e) {
    return invalid_argument(what + ": not valid msgpack (" + e.what() + ")");
  }
}

}  // namespace rd2h::protocol
