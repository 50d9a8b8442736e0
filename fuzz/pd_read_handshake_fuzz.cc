// The handshake a `rd2h pd-read` source sends its destination over ZeroMQ (the pool's
// layout, the pattern seed, its base and the engine metadata to connect with). It decodes or
// is refused with a reason, in heap linear in its size; what decodes re-encodes to a fixed
// point.
#include "fuzz_support.h"
#include "kv_pool.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rd2h;
  Expected<tools::SourceHandshake> h = internal_error("not decoded");
  {
    fuzz::HeapPeak heap;
    h = tools::decode_handshake(fuzz::bytes_of(data, size));
    fuzz::check_heap(heap, size, "decode_handshake");
  }
  if (!h) {
    fuzz::check_refusal(h.status(), "decode_handshake");
    return 0;
  }
  const auto bytes = tools::encode_handshake(*h);
  auto again = tools::decode_handshake(bytes);
  RD2H_FUZZ_CHECK(again, "a re-encoded handshake does not decode: " + again.status().message());
  RD2H_FUZZ_CHECK(tools::encode_handshake(*again) == bytes, "re-encoding is not a fixed point");
  return 0;
}
