// The per-step connector metadata a scheduler hands its workers (msgpack through nlohmann's
// reader, behind check_msgpack_bounds). It decodes or is refused with a reason, never with
// an exception or a sanitizer report; what decodes re-encodes to a fixed point.
#include "fuzz_support.h"
#include "rd2h/connector/metadata.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rd2h;
  Expected<connector::ConnectorMetadata> m = internal_error("not decoded");
  try {
    m = connector::decode_metadata(fuzz::bytes_of(data, size));
  } catch (const std::exception& e) {
    RD2H_FUZZ_CHECK(false, std::string("decode_metadata threw: ") + e.what());
  }
  if (!m) {
    fuzz::check_refusal(m.status(), "decode_metadata");
    return 0;
  }
  const auto bytes = connector::encode(*m);
  auto again = connector::decode_metadata(bytes);
  RD2H_FUZZ_CHECK(again, "re-encoded metadata does not decode: " + again.status().message());
  RD2H_FUZZ_CHECK(connector::encode(*again) == bytes, "re-encoding is not a fixed point");
  return 0;
}
