// ConnectorConfig::from_json, the kv_transfer_config an engine is started with. It parses
// or is refused with a reason naming a key, never with an exception or a sanitizer report;
// what parses writes (to_json) a config that parses back to the same one.
#include "fuzz_support.h"
#include "rd2h/connector/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rd2h;
  const std::string_view text = fuzz::text_of(data, size);
  // CURVE key files are read from disk by name; what those files hold is not this input.
  if (text.find("curve_") != std::string_view::npos) return 0;
  Expected<connector::ConnectorConfig> c = internal_error("not parsed");
  try {
    c = connector::ConnectorConfig::from_json(text);
  } catch (const std::exception& e) {
    RD2H_FUZZ_CHECK(false, std::string("ConnectorConfig::from_json threw: ") + e.what());
  }
  if (!c) {
    fuzz::check_refusal(c.status(), "ConnectorConfig::from_json");
    return 0;
  }
  const std::string written = c->to_json();
  auto back = connector::ConnectorConfig::from_json(written);
  RD2H_FUZZ_CHECK(back, "the written config does not parse: " + back.status().message());
  RD2H_FUZZ_CHECK(back->to_json() == written, "the config does not round-trip: " + written);
  return 0;
}
