// The simulator's IPC messages (engine core <-> TP rank processes, the Decode ranks'
// all-gather): sim::unpack never throws and refuses what nests too deep; what it reads packs
// to bytes it reads back to the same bytes; the timeline events in a message read back to
// the same events.
#include "fuzz_support.h"
#include "sim/sim_message.h"

namespace {

using nlohmann::json;
using rd2h::trace::Event;

bool same(const std::vector<Event>& a, const std::vector<Event>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const Event &x = a[i], &y = b[i];
    if (x.name != y.name || x.lane != y.lane || x.ts_us != y.ts_us || x.dur_us != y.dur_us ||
        x.rank != y.rank || x.layer != y.layer || x.bytes != y.bytes || x.request != y.request) {
      return false;
    }
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rd2h;
  const std::vector<std::byte> in(reinterpret_cast<const std::byte*>(data),
                                  reinterpret_cast<const std::byte*>(data) + size);
  json j;
  try {
    j = sim::unpack(in);
  } catch (const std::exception& e) {
    RD2H_FUZZ_CHECK(false, std::string("sim::unpack threw: ") + e.what());
  }
  if (j.is_discarded()) return 0;
  const auto bytes = sim::pack(j);
  const json back = sim::unpack(bytes);
  RD2H_FUZZ_CHECK(!back.is_discarded(), "a packed message does not unpack");
  RD2H_FUZZ_CHECK(sim::pack(back) == bytes, "packing is not a fixed point");
  const json& events = j.is_object() && j.contains("events") ? j["events"] : j;
  std::vector<Event> read;
  try {
    read = sim::events_from_json(events);
  } catch (const std::exception& e) {
    RD2H_FUZZ_CHECK(false, std::string("events_from_json threw: ") + e.what());
  }
  RD2H_FUZZ_CHECK(same(sim::events_from_json(sim::to_json(read)), read),
                  "timeline events do not round-trip");
  return 0;
}
