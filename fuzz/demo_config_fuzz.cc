// The demo's JSON config (rd2h demo --config). The first input byte says whether the
// command line gave the Prefill settings (odd: their keys are skipped), the rest is the
// file. It applies or is refused with a reason, never with an exception or a sanitizer
// report; what applies leaves every setting in its range and the given ones untouched, and
// applying it again changes nothing.
#include <sstream>

#include "fuzz_support.h"
#include "sim/demo.h"

namespace {

using rd2h::sim::DemoOptions;

std::string describe(const DemoOptions& o) {
  std::ostringstream s;
  s << o.prefill_tp << ' ' << o.decode_tp << ' ' << o.dp << ' ' << o.host << ' ' << o.prefill_host
    << ' ' << o.decode_host << ' ' << o.proxy_port << ' ' << o.metaserver_port << ' ' << o.kv_port
    << ' ' << o.transport << ' ' << o.prefill_wrapper << ' ' << o.decode_wrapper << ' ' << o.layers
    << ' ' << o.block_size << ' ' << o.num_blocks << ' ' << o.slots << ' ' << o.token_budget << ' '
    << o.compute_ns_per_token << ' ' << o.compute_min_layer_us << ' ' << o.requests << ' '
    << o.min_tokens << ' ' << o.max_tokens << ' ' << o.concurrency << ' ' << o.prompt_list_share
    << ' ' << o.prompt_list_size << ' ' << o.output_tokens << ' ' << o.seed << ' ' << o.timeout_s
    << ' ' << o.trace_file << ' ' << o.timeline << ' ' << o.quiet << ' ' << o.test_corrupt_layer
    << " [";
  for (auto b : o.bytes_per_token) s << b << ' ';
  s << ']';
  return s.str();
}

void check_ranges(const DemoOptions& o) {
  const std::string d = describe(o);
  RD2H_FUZZ_CHECK(o.prefill_tp >= 1 && o.decode_tp >= 1 && o.dp >= 1 && o.layers >= 1, d);
  for (int port : {o.proxy_port, o.metaserver_port, o.kv_port}) {
    RD2H_FUZZ_CHECK(port >= 0 && port <= 65535, d);
  }
  RD2H_FUZZ_CHECK(o.slots >= 0 && o.block_size >= 1 && o.num_blocks >= 1, d);
  RD2H_FUZZ_CHECK(o.requests >= 1 && o.concurrency >= 1 && o.timeout_s >= 1, d);
  RD2H_FUZZ_CHECK(o.min_tokens >= 1 && o.max_tokens >= 1 && o.token_budget >= 1, d);
  RD2H_FUZZ_CHECK(o.prompt_list_share >= 0.0 && o.prompt_list_share <= 1.0, d);
  RD2H_FUZZ_CHECK(o.transport == "shm" || o.transport == "tcp" || o.transport == "auto", d);
  RD2H_FUZZ_CHECK(o.bytes_per_token.size() >= 2 && o.bytes_per_token.size() <= 4, d);
  for (auto b : o.bytes_per_token) RD2H_FUZZ_CHECK(b >= 1, d);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const bool prefill_given = data[0] % 2 == 1;
  const std::string text(rd2h::fuzz::text_of(data + 1, size - 1));
  auto given = [&](const std::string& key) {
    return prefill_given && key.rfind("prefill-", 0) == 0;
  };
  const DemoOptions defaults;
  DemoOptions o;
  rd2h::Status st = rd2h::Status::ok();
  try {
    st = rd2h::sim::apply_demo_config_text(text, "fuzz.json", o, given);
  } catch (const std::exception& e) {
    RD2H_FUZZ_CHECK(false, std::string("apply_demo_config_text threw: ") + e.what());
  }
  if (!st) {
    rd2h::fuzz::check_refusal(st, "apply_demo_config_text");
    RD2H_FUZZ_CHECK(st.message().find("fuzz.json") != std::string::npos,
                    "the refusal does not name the file: " + st.message());
    return 0;
  }
  check_ranges(o);
  if (prefill_given) {
    RD2H_FUZZ_CHECK(o.prefill_tp == defaults.prefill_tp && o.prefill_host == defaults.prefill_host,
                    "a setting given on the command line was overwritten");
  }
  DemoOptions twice = o;
  const rd2h::Status again = rd2h::sim::apply_demo_config_text(text, "fuzz.json", twice, given);
  RD2H_FUZZ_CHECK(again.is_ok(), "applying the config again fails: " + again.message());
  RD2H_FUZZ_CHECK(describe(twice) == describe(o), "applying the config again changes it");
  return 0;
}
