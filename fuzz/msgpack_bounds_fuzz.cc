// protocol::check_msgpack_bounds, the guard before every recursive msgpack reader, against
// msgpack-c's own parser as the oracle: the guard accepts a value exactly when msgpack-c
// parses it whole within the same nesting depth. It never allocates beyond its container
// stack, whatever the declared sizes.
#include <msgpack.hpp>

#include "fuzz_support.h"
#include "protocol/messages.h"

namespace {

// Whether msgpack-c reads `bytes` as exactly one value nested at most `depth` deep. Item
// counts are capped at the input's size (larger ones cannot be present), so the oracle
// allocates no more than the guard lets through.
bool msgpack_c_accepts(std::span<const std::byte> bytes, size_t depth) {
  const size_t n = bytes.size();
  msgpack::unpack_limit limit(n, n, n, n, n, depth);
  size_t offset = 0;
  try {
    auto oh = msgpack::unpack(reinterpret_cast<const char*>(bytes.data()), n, offset, nullptr,
                              nullptr, limit);
    return offset == n;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  // The first byte picks the depth limit, the rest is the value.
  const size_t depth = data[0] % 40;
  const auto value = rd2h::fuzz::bytes_of(data + 1, size - 1);
  rd2h::Status st = rd2h::Status::ok();
  {
    rd2h::fuzz::HeapPeak heap;
    st = rd2h::protocol::check_msgpack_bounds(value, depth, "fuzz input");
    RD2H_FUZZ_CHECK(heap.peak() <= 64 * depth + (4u << 10),
                    "check_msgpack_bounds held " + std::to_string(heap.peak()) + " heap bytes");
  }
  if (!st) rd2h::fuzz::check_refusal(st, "check_msgpack_bounds");
  const bool oracle = msgpack_c_accepts(value, depth);
  RD2H_FUZZ_CHECK(st.is_ok() == oracle,
                  std::string("check_msgpack_bounds ") + (st.is_ok() ? "accepts" : "refuses") +
                      " what msgpack-c " + (oracle ? "accepts" : "refuses") + ": " + st.message());
  return 0;
}
