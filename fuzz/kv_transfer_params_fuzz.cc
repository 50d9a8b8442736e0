// A request's kv_transfer_params, as an engine reads it from a client's or the proxy's body
// (Decode: the metaserver to post to; Prefill: Decode's rendezvous, or a prompt list's
// children). It parses or is refused with a reason, never with an exception or a sanitizer
// report; every child is found by its id; Decode's rendezvous body of what parsed parses
// back to the same rendezvous.
#include "fuzz_support.h"
#include "rd2h/connector/metadata.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rd2h;
  using connector::KvTransferParams;
  Expected<KvTransferParams> p = internal_error("not parsed");
  try {
    p = KvTransferParams::from_json(fuzz::text_of(data, size));
  } catch (const std::exception& e) {
    RD2H_FUZZ_CHECK(false, std::string("KvTransferParams::from_json threw: ") + e.what());
  }
  if (!p) {
    fuzz::check_refusal(p.status(), "KvTransferParams::from_json");
    return 0;
  }
  for (const auto& [child, params] : p->batch) {
    auto found = p->for_request(child);
    RD2H_FUZZ_CHECK(found, "child " + child + " is not found: " + found.status().message());
  }
  const std::string rendezvous = p->rendezvous_json();
  auto back = KvTransferParams::from_json(rendezvous);
  RD2H_FUZZ_CHECK(back, "the rendezvous body does not parse: " + back.status().message());
  RD2H_FUZZ_CHECK(back->rendezvous_json() == rendezvous, "the rendezvous does not round-trip");
  RD2H_FUZZ_CHECK(back->do_remote_decode && !back->do_remote_prefill,
                  "a rendezvous is not a Prefill's params");
  return 0;
}
