// The bodies the proxy reads: a client's /v1/completions or /v1/chat/completions (first
// input byte even or odd below 0x80), or a Decode's /v1/metaserver rendezvous (0x80 and
// up); the rest is the body. A client body is checked with check_openai_body as the proxy
// (its routing rules) and the engines (all rules) do; one the proxy accepts nests at most
// kMaxBodyNesting levels and survives what the proxy does with it next (copied, given
// kv_transfer_params, written out for Decode and for Prefill); an engine that accepts the
// client's body accepts the written body with the same prompt count. A
// rendezvous the proxy takes (an object with a string request_id) is what it hands Prefill
// as its kv_transfer_params: Prefill parses it or refuses it with a reason.
#include <algorithm>
#include <nlohmann/json.hpp>

#include "fuzz_support.h"
#include "rd2h/connector/metadata.h"
#include "util/openai_body.h"

namespace {

using namespace rd2h;
using nlohmann::json;
using nlohmann::ordered_json;

// How deep the text nests arrays and objects, read from the characters (outside strings)
// up to the first NUL, where nlohmann's reader ends its input.
size_t text_depth(std::string_view text) {
  size_t depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (c == '\0') break;
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return deepest;
}

void client_body(std::string_view text, bool chat) {
  auto body = ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object()) return;  // the proxy's 400
  const http::PromptLimits limits;
  const auto prompts = http::check_openai_body(body, chat, limits, http::BodyRules::kRoute);
  if (!prompts) {
    fuzz::check_refusal(prompts.status(), "check_openai_body");
    return;
  }
  RD2H_FUZZ_CHECK(*prompts >= 1 && *prompts <= limits.max_prompts,
                  std::to_string(*prompts) + " prompts accepted");
  RD2H_FUZZ_CHECK(!chat || *prompts == 1, "a chat body is one prompt");
  RD2H_FUZZ_CHECK(text_depth(text) <= http::kMaxBodyNesting,
                  "a body nested " + std::to_string(text_depth(text)) + " levels deep is accepted");
  // The proxy forwards what an engine may refuse; what an engine accepts from the client, it
  // accepts as the proxy writes it.
  const auto served = http::check_openai_body(body, chat, limits, http::BodyRules::kServe);
  if (served) RD2H_FUZZ_CHECK(*served == *prompts, "the engine counts other prompts");
  // To Decode: the client's body with the proxy's kv_transfer_params.
  ordered_json to_decode = body;
  to_decode["kv_transfer_params"] = {{"do_remote_decode", false},
                                     {"do_remote_prefill", true},
                                     {"metaserver", "http://127.0.0.1:1/v1/metaserver"}};
  // To Prefill: one token, not streamed, with Decode's rendezvous as kv_transfer_params.
  ordered_json to_prefill = body;
  to_prefill["stream"] = false;
  to_prefill.erase("stream_options");
  to_prefill["max_tokens"] = 1;
  to_prefill["min_tokens"] = 1;
  connector::KvTransferParams rendezvous;
  rendezvous.request_id = "cmpl-0";
  to_prefill["kv_transfer_params"] = ordered_json::parse(rendezvous.rendezvous_json());
  for (const auto* sent : {&to_decode, &to_prefill}) {
    const std::string payload = sent->dump();
    const json engine_body = json::parse(payload, nullptr, /*allow_exceptions=*/false);
    RD2H_FUZZ_CHECK(!engine_body.is_discarded(), "the proxy wrote a body that does not parse");
    const auto at_engine =
        http::check_openai_body(engine_body, chat, limits, http::BodyRules::kServe);
    if (served) {
      RD2H_FUZZ_CHECK(at_engine && *at_engine == *prompts,
                      "the engine refuses as the proxy wrote it what it accepts from the "
                      "client: " +
                          at_engine.status().message());
    } else if (!at_engine) {
      fuzz::check_refusal(at_engine.status(), "check_openai_body at the engine");
    }
    auto params = connector::KvTransferParams::from_json(engine_body["kv_transfer_params"].dump());
    RD2H_FUZZ_CHECK(params,
                    "the proxy's kv_transfer_params are refused: " + params.status().message());
  }
}

void rendezvous_body(std::string_view text) {
  auto body = ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object() || !body.contains("request_id") ||
      !body["request_id"].is_string()) {
    return;  // the proxy's 400
  }
  auto params = connector::KvTransferParams::from_json(text);
  if (!params) fuzz::check_refusal(params.status(), "Prefill's KvTransferParams::from_json");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string_view text = fuzz::text_of(data + 1, size - 1);
  try {
    if (data[0] >= 0x80) {
      rendezvous_body(text);
    } else {
      client_body(text, data[0] % 2 == 1);
    }
  } catch (const std::exception& e) {
    RD2H_FUZZ_CHECK(false, std::string("an exception escaped: ") + e.what());
  }
  return 0;
}
