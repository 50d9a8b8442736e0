// MF_META's layer map (the bin Prefill nests in MF_META) and what Decode does with it: each
// layer becomes layout::LayerTensors and is validated against Decode's, then read
// reads are built over it. The map decodes or is refused with a reason, in heap linear
// in its size; a decoded map re-encodes to itself; a layer that converts validates against
// itself; reads cover exactly the requested blocks, or are refused with nothing added.
#include <msgpack.hpp>

#include "decode/layer_meta.h"
#include "fuzz_support.h"
#include "layout/layout.h"
#include "protocol/messages.h"

namespace {

using namespace rd2h;

// MF_META around `map`, as Prefill sends it.
std::vector<std::byte> mf_meta_around(std::span<const std::byte> map) {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(&buf);
  pk.pack_array(3);
  pk.pack_bin(7);
  pk.pack_bin_body("mf_meta", 7);
  pk.pack_str(4);
  pk.pack_str_body("fuzz", 4);
  pk.pack_bin(static_cast<uint32_t>(map.size()));
  pk.pack_bin_body(reinterpret_cast<const char*>(map.data()), static_cast<uint32_t>(map.size()));
  const auto* p = reinterpret_cast<const std::byte*>(buf.data());
  return {p, p + buf.size()};
}

void check_reads(const layout::LayerTensors& t) {
  layout::LayerTensors decode = t;
  decode.num_blocks = 8;
  const std::vector<int64_t> dest{0, 1, 2, 3, 4, 5, 6, 7};
  const protocol::ReadReq req{"r", {0, 1, 2, 3, 5}, {6, 7}, 1, 2};
  for (int member = 0; member < 2; ++member) {
    const layout::ReadRole role{0, 2, member, 2};
    std::vector<transfer::ReadOp> out{{1, 2, 3}};
    const Status st =
        layout::append_request_reads(t, decode, {decode::source_blocks(req), dest, dest}, role, out);
    if (!st) {
      RD2H_FUZZ_CHECK(out.size() == 1, "a refused request left reads behind");
      continue;
    }
    // Member 0 pulls rank 0's share of the main blocks; each member its share of the indexer.
    const size_t main = layout::share(0, 2, req.main_start, req.main_block_ids.size()).size();
    const size_t idx =
        layout::share(member, 2, req.indexer_start, req.indexer_block_ids.size()).size();
    uint64_t expected = 0;
    if (member == 0) {
      for (size_t i = 0; i < t.main_tensor_count; ++i) expected += main * t.bytes_per_block[i];
    }
    if (t.has_indexer) {
      for (size_t i = t.indexer_index(); i < t.base_addrs.size(); ++i) {
        expected += idx * t.bytes_per_block[i];
      }
    }
    uint64_t got = 0;
    for (size_t i = 1; i < out.size(); ++i) got += out[i].length;
    RD2H_FUZZ_CHECK(got == expected, "reads cover " + std::to_string(got) +
                                         " bytes, the request " + std::to_string(expected));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto message = mf_meta_around(fuzz::bytes_of(data, size));
  Expected<protocol::Message> m = internal_error("not decoded");
  {
    fuzz::HeapPeak heap;
    m = protocol::decode_message(message);
    fuzz::check_heap(heap, message.size(), "the MF_META layer map");
  }
  if (!m) {
    fuzz::check_refusal(m.status(), "the MF_META layer map");
    return 0;
  }
  const auto& meta = std::get<protocol::MfMeta>(*m);
  const auto bytes = protocol::encode(meta);
  auto again = protocol::decode_message(bytes);
  RD2H_FUZZ_CHECK(again, "a re-encoded layer map does not decode: " + again.status().message());
  RD2H_FUZZ_CHECK(protocol::encode(std::get<protocol::MfMeta>(*again)) == bytes,
                  "re-encoding the layer map is not a fixed point");
  for (size_t i = 0; i < meta.layers.size(); ++i) {
    auto t = decode::from_layer_meta(meta.layers[i].second);
    if (!t) {
      fuzz::check_refusal(t.status(), "decode::from_layer_meta");
      continue;
    }
    const Status same = layout::validate_layer(static_cast<int64_t>(i), *t, *t);
    RD2H_FUZZ_CHECK(same.is_ok(), "a layer does not validate against itself: " + same.message());
    check_reads(*t);
  }
  return 0;
}
