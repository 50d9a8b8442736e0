// The control-plane messages as Decode and Prefill receive them (MF_META, READ_READY_BATCH,
// READ_DONE, READ_FAILED, KV_COMMIT, the raw ACKs). A payload decodes or is refused with a reason, in
// heap linear in its size; what decodes re-encodes to bytes that decode to the same message
// (re-encoding is a fixed point); peek_tag and salvage_layer_index agree with the decoder.
#include <variant>

#include "fuzz_support.h"
#include "protocol/messages.h"

namespace {

using namespace rd2h;

std::string_view tag_of(const protocol::Message& m) {
  struct {
    std::string_view operator()(const protocol::MfMeta&) const { return "mf_meta"; }
    std::string_view operator()(const protocol::ReadReadyBatch&) const {
      return "read_ready_batch";
    }
    std::string_view operator()(const protocol::ReadDone&) const { return "read_done"; }
    std::string_view operator()(const protocol::ReadFailed&) const { return "read_failed"; }
    std::string_view operator()(const protocol::KvCommit&) const { return "kv_commit"; }
  } tag;
  return std::visit(tag, m);
}

std::vector<std::byte> encode(const protocol::Message& m) {
  return std::visit([](const auto& x) { return protocol::encode(x); }, m);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto in = fuzz::bytes_of(data, size);
  Expected<protocol::Message> m = internal_error("not decoded");
  {
    fuzz::HeapPeak heap;
    m = protocol::decode_message(in);
    fuzz::check_heap(heap, size, "decode_message");
  }
  const bool ack = protocol::is_ack(in);
  const auto tag = protocol::peek_tag(in);
  const auto layer = protocol::salvage_layer_index(in);
  if (!m) {
    fuzz::check_refusal(m.status(), "decode_message");
    RD2H_FUZZ_CHECK(m.status().code() == StatusCode::kInvalidArgument, m.status().message());
    return 0;
  }
  RD2H_FUZZ_CHECK(!ack, "the raw ACK decoded as a message");
  RD2H_FUZZ_CHECK(tag && *tag == tag_of(*m), "peek_tag differs from the decoded message");
  if (const auto* r = std::get_if<protocol::ReadReadyBatch>(&*m)) {
    RD2H_FUZZ_CHECK(layer && *layer == r->layer_idx, "salvage_layer_index differs");
  }
  if (const auto* meta = std::get_if<protocol::MfMeta>(&*m)) {
    (void)protocol::check_compatible(*meta);
  }
  const auto bytes = encode(*m);
  auto again = protocol::decode_message(bytes);
  RD2H_FUZZ_CHECK(again, "a re-encoded message does not decode: " + again.status().message());
  RD2H_FUZZ_CHECK(encode(*again) == bytes, "re-encoding is not a fixed point");
  return 0;
}
