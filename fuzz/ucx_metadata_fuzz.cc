// The UCX engine's metadata a peer exports (MF_META's backend_metadata: its worker address,
// identity and regions with their rkeys). It decodes or is refused with a reason, in heap
// linear in its size; what decodes re-encodes to a fixed point.
#include "fuzz_support.h"
#include "transfer/ucx_metadata.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rd2h;
  Expected<transfer::UcxMetadata> m = internal_error("not decoded");
  {
    fuzz::HeapPeak heap;
    m = transfer::decode_ucx_metadata(fuzz::bytes_of(data, size));
    fuzz::check_heap(heap, size, "decode_ucx_metadata");
  }
  if (!m) {
    fuzz::check_refusal(m.status(), "decode_ucx_metadata");
    return 0;
  }
  const auto bytes = transfer::encode_ucx_metadata(*m);
  auto again = transfer::decode_ucx_metadata(bytes);
  RD2H_FUZZ_CHECK(again, "re-encoded metadata does not decode: " + again.status().message());
  RD2H_FUZZ_CHECK(transfer::encode_ucx_metadata(*again) == bytes,
                  "re-encoding is not a fixed point");
  return 0;
}
