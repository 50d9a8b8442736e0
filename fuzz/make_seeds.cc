// Writes the seed corpus of every harness under <dir>/<harness>/: gen-* files are small
// valid inputs made by the real encoders (and the legacy forms peers still send), edge-*
// files the edge cases a decoder must refuse cleanly (deep nesting, declared lengths far
// beyond the bytes present, wrong types). `rd2h_fuzz_make_seeds fuzz/corpus` rewrites them;
// fuzz/run-smoke --check-seeds keeps the committed files equal to its output.
#include <filesystem>
#include <fstream>
#include <iostream>
#include <msgpack.hpp>
#include <nlohmann/json.hpp>

#include "kv_pool.h"
#include "protocol/messages.h"
#include "rd2h/connector/config.h"
#include "rd2h/connector/metadata.h"
#include "sim/sim_message.h"
#include "transfer/ucx_metadata.h"

namespace {

using namespace rd2h;
using Bytes = std::vector<std::byte>;
using Packer = msgpack::packer<msgpack::sbuffer>;
using nlohmann::json;

std::filesystem::path root;

void write(const std::string& harness, const std::string& name, std::span<const std::byte> b) {
  const auto dir = root / harness;
  std::filesystem::create_directories(dir);
  std::ofstream out(dir / name, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

Bytes text(std::string_view s) {
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  return {p, p + s.size()};
}

// `b` after a one-byte selector (the harnesses that take a mode or a depth first).
Bytes after(uint8_t selector, const Bytes& b) {
  Bytes out{std::byte{selector}};
  out.insert(out.end(), b.begin(), b.end());
  return out;
}

Bytes hex(std::string_view digits) {
  Bytes out;
  std::string d;
  for (char c : digits) {
    if (std::isxdigit(static_cast<unsigned char>(c))) d += c;
  }
  for (size_t i = 0; i + 1 < d.size(); i += 2) {
    out.push_back(static_cast<std::byte>(std::stoi(d.substr(i, 2), nullptr, 16)));
  }
  return out;
}

template <typename F>
Bytes packed(F&& body) {
  msgpack::sbuffer buf;
  Packer pk(&buf);
  body(pk);
  const auto* p = reinterpret_cast<const std::byte*>(buf.data());
  return {p, p + buf.size()};
}

void pack_bin(Packer& pk, std::string_view s) {
  pk.pack_bin(static_cast<uint32_t>(s.size()));
  pk.pack_bin_body(s.data(), static_cast<uint32_t>(s.size()));
}

void pack_str(Packer& pk, std::string_view s) {
  pk.pack_str(static_cast<uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

// `levels` one-element arrays around a nil.
Bytes nested_msgpack(size_t levels) {
  Bytes b(levels, std::byte{0x91});
  b.push_back(std::byte{0xc0});
  return b;
}

std::string nested_json(size_t levels) {
  return std::string(levels, '[') + std::string(levels, ']');
}

protocol::LayerMeta layer(bool indexer, bool scale) {
  protocol::LayerMeta l;
  l.base_addrs = {0x7f0000000000, 0x7f0000100000};
  l.block_len = {4096, 512};
  l.block_size_scale = {32, 32};
  l.tensor_group_idx = {0, 0};
  if (indexer) {
    l.base_addrs.push_back(0x7f0000200000);
    l.block_len.push_back(512);
    l.block_size_scale.push_back(32);
    l.tensor_group_idx.push_back(1);
    l.has_indexer = true;
  }
  if (scale) {
    l.base_addrs.push_back(0x7f0000300000);
    l.block_len.push_back(4);
    l.block_size_scale.push_back(32);
    l.tensor_group_idx.push_back(1);
  }
  return l;
}

protocol::MfMeta mf_meta() {
  protocol::MfMeta m;
  m.p_session = "10.0.0.1:5000";
  m.layers = {{"model.layers.0.self_attn", layer(true, true)},
              {"model.layers.1.self_attn", layer(false, false)}};
  m.backend_name = "ucx";
  m.backend_metadata = hex("01 02 03");
  return m;
}

// The layer map bin of an encoded MF_META.
Bytes layer_map_of(const Bytes& message) {
  auto oh = msgpack::unpack(reinterpret_cast<const char*>(message.data()), message.size());
  const auto& bin = oh.get().via.array.ptr[2].via.bin;
  const auto* p = reinterpret_cast<const std::byte*>(bin.ptr);
  return {p, p + bin.size};
}

void messages() {
  protocol::ReadReadyBatch example;  // docs/wire-format.md's example
  example.layer_idx = 0;
  example.layer_name = "model.layers.0.self_attn";
  example.read_reqs = {{"req-0", {3, 4}, {7}, 0, 0}};
  example.done_ext_ids = {"req-0"};
  write("message", "gen-read-ready-batch", protocol::encode(example));
  protocol::ReadReadyBatch wide;
  wide.layer_idx = 60;
  wide.layer_name = "model.layers.60.self_attn";
  wide.read_reqs = {{"a", {1, 2, 3, 70000}, {4, 5}, 7, 9}, {"b", {}, {0}, 0, 3}};
  wide.group_member_idx = 1;
  wide.tp_ratio = 2;
  write("message", "gen-read-ready-batch-unequal-tp", protocol::encode(wide));
  // The legacy forms: 4 fields, a 2-field read_req with one list for main and indexer.
  write("message", "gen-read-ready-batch-legacy", packed([](Packer& pk) {
          pk.pack_array(4);
          pack_bin(pk, "read_ready_batch");
          pk.pack_int64(2);
          pack_str(pk, "model.layers.2.self_attn");
          pk.pack_array(1);
          pk.pack_array(2);
          pack_str(pk, "r");
          pk.pack_array(2);
          pk.pack_int64(5);
          pk.pack_int64(6);
        }));
  const Bytes meta = protocol::encode(mf_meta());
  write("message", "gen-mf-meta", meta);
  write("message", "gen-mf-meta-legacy", packed([&](Packer& pk) {
          pk.pack_array(3);
          pack_bin(pk, "mf_meta");
          pack_str(pk, "10.0.0.1:5000");
          const Bytes map = layer_map_of(meta);
          pk.pack_bin(static_cast<uint32_t>(map.size()));
          pk.pack_bin_body(reinterpret_cast<const char*>(map.data()),
                           static_cast<uint32_t>(map.size()));
        }));
  write("message", "gen-read-done", protocol::encode(protocol::ReadDone{0}));
  write("message", "gen-read-failed", protocol::encode(protocol::ReadFailed{3, "boom"}));
  write("message", "gen-kv-commit", protocol::encode(protocol::KvCommit{60, {"req-0", "req-1"}}));
  write("message", "gen-read-failed-no-error", packed([](Packer& pk) {
          pk.pack_array(2);
          pack_bin(pk, "read_failed");
          pk.pack_int64(3);
        }));
  write("message", "gen-ack", text(protocol::kAckPayload));
  write("message", "edge-huge-array", hex("dd ffffffff 00"));
  write("message", "edge-deep", nested_msgpack(2000));
  // Declared sizes far beyond the bytes present, inside each message.
  write("message", "edge-mf-meta-huge-map-bin", hex("93 c4 07 6d665f6d657461 a1 70 c6 ffffffff"));
  write("message", "edge-read-ready-batch-huge-counts",
        hex("97 c4 10 72656164 5f726561 64795f62 61746368 00 a1 78 dd 00004000 "
            "95 a1 72 dd 00100000 00"));
  // A readiness declaring 16384 read requests where 16384 nils follow.
  Bytes reqs = hex("97 c4 10 72656164 5f726561 64795f62 61746368 00 a1 78 dc 4000");
  reqs.resize(reqs.size() + 16384, std::byte{0xc0});
  write("message", "edge-read-ready-batch-forged-reqs", reqs);
  // Nested arrays each declaring as many items as the message has bytes, too few present.
  Bytes claims;
  for (int level = 0; level < 16; ++level) {
    const Bytes header = hex("dc 1000");
    claims.insert(claims.end(), header.begin(), header.end());
  }
  claims.resize(4096, std::byte{0xc0});
  write("message", "edge-nested-claims", claims);
}

void layer_maps() {
  write("layer_map", "gen-two-layers", layer_map_of(protocol::encode(mf_meta())));
  protocol::MfMeta one;
  one.layers = {{"model.layers.0.self_attn", layer(true, false)}};
  write("layer_map", "gen-one-layer-indexer", layer_map_of(protocol::encode(one)));
  write("layer_map", "gen-unknown-key", packed([](Packer& pk) {
          pk.pack_map(1);
          pack_str(pk, "model.layers.0.self_attn");
          pk.pack_map(7);
          for (const char* key :
               {"base_addrs", "block_len", "block_size_scale", "tensor_group_idx"}) {
            pack_str(pk, key);
            pk.pack_array(2);
            pk.pack_uint64(std::string_view(key) == "base_addrs" ? 1u << 20 : 1);
            pk.pack_uint64(std::string_view(key) == "base_addrs" ? 1u << 21 : 1);
          }
          pack_str(pk, "main_tensor_count");
          pk.pack_uint64(2);
          pack_str(pk, "has_indexer");
          pk.pack_false();
          pack_str(pk, "added_later");
          pk.pack_array(0);
        }));
  write("layer_map", "edge-huge-map", hex("df ffffffff"));
  write("layer_map", "edge-deep", nested_msgpack(2000));
  write("layer_map", "edge-address-overflow", packed([](Packer& pk) {
          pk.pack_map(1);
          pack_str(pk, "l");
          pk.pack_map(6);
          pack_str(pk, "base_addrs");
          pk.pack_array(2);
          pk.pack_uint64(~uint64_t{0});
          pk.pack_uint64(~uint64_t{0} - 4096);
          for (const char* key : {"block_len", "block_size_scale", "tensor_group_idx"}) {
            pack_str(pk, key);
            pk.pack_array(2);
            pk.pack_uint64(std::string_view(key) == "block_len" ? 1u << 30 : 1);
            pk.pack_uint64(1);
          }
          pack_str(pk, "main_tensor_count");
          pk.pack_uint64(2);
          pack_str(pk, "has_indexer");
          pk.pack_false();
        }));
}

connector::ConnectorMetadata metadata() {
  connector::ConnectorMetadata m;
  m.load.push_back({"req-0", "req-0-abcdefgh", {0, 1, 2}, {3, 4}});
  m.abort = {"req-9"};
  m.save.push_back({"req-1", "127.0.0.1", 30000, 2, {5, 6}, {7}, 0, 0, true, ""});
  return m;
}

void step_metadata() {
  write("metadata", "gen-empty", connector::encode(connector::ConnectorMetadata{}));
  write("metadata", "gen-load-abort-save", connector::encode(metadata()));
  connector::ConnectorMetadata save;
  save.save.push_back({"r",
                       "10.0.0.2",
                       31000,
                       4,
                       {1},
                       {1},
                       12,
                       3,
                       false,
                       "rq+@*:KG[mL/ZBm2Yc0Q.mzYxb-qVsNo:L^6{B+)"});
  write("metadata", "gen-save-with-key", connector::encode(save));
  write("metadata", "edge-deep", nested_msgpack(2000));
  write("metadata", "edge-huge-map", hex("df ffffffff"));
  // A save entry with floats where integers belong.
  write("metadata", "edge-float-fields",
        sim::pack(json{{"load", json::array()},
                       {"abort", json::array()},
                       {"save", {{"r", "h", 1e300, -1e300, {1.5}, {2}, 1e19, -0.5, true, ""}}}}));
}

void msgpack_bounds() {
  write("msgpack_bounds", "gen-mf-meta", after(32, protocol::encode(mf_meta())));
  write("msgpack_bounds", "gen-metadata", after(32, connector::encode(metadata())));
  write("msgpack_bounds", "gen-scalars",
        after(4, hex("82 a1 61 92 cb 3ff0000000000000 c4 02 0102 a1 62 "
                     "93 cd 0100 d3 ffffffffffffffff d4 01 02")));
  write("msgpack_bounds", "edge-one-too-deep", after(32, nested_msgpack(33)));
  write("msgpack_bounds", "edge-huge-header", after(32, hex("dd ffffffff 00")));
  write("msgpack_bounds", "edge-huge-ext", after(32, hex("c9 ffffffff 01")));
  write("msgpack_bounds", "edge-invalid-byte", after(32, hex("92 00 c1")));
}

void kv_transfer_params() {
  write("kv_transfer_params", "gen-proxy-to-decode",
        text(R"({"do_remote_decode":false,"do_remote_prefill":true,)"
             R"("metaserver":"http://127.0.0.1:8000/v1/metaserver"})"));
  connector::KvTransferParams p;
  p.request_id = "cmpl-1-0";
  p.remote_engine_id = "decode-0";
  p.remote_host = "127.0.0.1";
  p.remote_port = 30000;
  p.remote_tp_size = 2;
  p.remote_cached_tokens = 128;
  write("kv_transfer_params", "gen-rendezvous", text(p.rendezvous_json()));
  json batch = json::parse(p.rendezvous_json());
  batch["batch_kv_transfer_params"] = {{"cmpl-1-0", json::parse(p.rendezvous_json())},
                                       {"cmpl-1-1", json::parse(p.rendezvous_json())}};
  write("kv_transfer_params", "gen-prompt-list", text(batch.dump()));
  write("kv_transfer_params", "edge-deep", text(nested_json(200)));
  write("kv_transfer_params", "edge-wrong-types",
        text(R"({"remote_port":1e300,"remote_tp_size":-1.5,"remote_cached_tokens":-1})"));
}

void connector_configs() {
  connector::ConnectorConfig c;
  c.engine_id = "decode-0";
  c.kv_port = 30000;
  write("connector_config", "gen-consumer", text(c.to_json()));
  c.role = connector::KvRole::kProducer;
  c.engine_id = "prefill-0";
  c.transport = transfer::Transport::kShm;
  c.prefill_tp_size = 4;
  c.insecure = true;
  c.host = "10.0.0.1";
  write("connector_config", "gen-producer", text(c.to_json()));
  write("connector_config", "gen-vllm-decode",
        text(R"({"kv_connector":"Rd2hConnector","kv_connector_module_path":"rd2h.vllm",)"
             R"("kv_role":"kv_consumer","kv_port":30000,"engine_id":"decode-0",)"
             R"("kv_load_failure_policy":"recompute","kv_connector_extra_config":)"
             R"({"transport":"auto","prefill_tp_size":2,"read_timeout_ms":5000}})"));
  write("connector_config", "edge-deep", text(nested_json(200)));
  write("connector_config", "edge-wrong-types",
        text(R"({"kv_connector":"rd2h","kv_role":"kv_consumer","kv_port":3.5e9,)"
             R"("kv_connector_extra_config":{"ack_timeout_ms":-1e300}})"));
}

void proxy_bodies() {
  write("proxy_body", "gen-completion",
        after(0, text(R"({"model":"m","prompt":"hello","max_tokens":8,"stream":true})")));
  write("proxy_body", "gen-completion-tokens",
        after(0, text(R"({"model":"m","prompt":[1,2,3],"max_tokens":8})")));
  write("proxy_body", "gen-completion-list",
        after(0, text(R"({"prompt":["a",[1,2],"c"],"stream":false,"stream_options":{}})")));
  write("proxy_body", "gen-chat",
        after(1, text(R"({"model":"m","messages":[{"role":"user","content":"hi"}],)"
                      R"("max_tokens":4,"kv_transfer_params":null})")));
  connector::KvTransferParams p;
  p.request_id = "cmpl-1-0";
  p.remote_engine_id = "decode-0";
  p.remote_host = "127.0.0.1";
  p.remote_port = 30000;
  write("proxy_body", "gen-rendezvous", after(0x80, text(p.rendezvous_json())));
  write("proxy_body", "edge-deep-field",
        after(0, text(R"({"prompt":"x","extra":)" + nested_json(200) + "}")));
  write("proxy_body", "edge-deep-rendezvous",
        after(0x80, text(R"({"request_id":"r","extra":)" + nested_json(200) + "}")));
  write("proxy_body", "edge-wrong-types",
        after(0, text(R"({"prompt":[1,"a"],"max_tokens":-1,"stream":"yes"})")));
}

void demo_configs() {
  write("demo_config", "gen-demo-small",
        after(0, text(R"({"prefill-tp":4,"decode-tp":2,"layers":8,"block-size":16,)"
                      R"("bytes-per-token":[64,8,16,4],"num-blocks":256,"slots":3,)"
                      R"("token-budget":256,"compute-ns-per-token":2000,"requests":12,)"
                      R"("min-tokens":20,"max-tokens":1500,"concurrency":4,)"
                      R"("prompt-list-share":0.3,"prompt-list-size":3,"output-tokens":4,)"
                      R"("transport":"shm","timeout":120})")));
  write("demo_config", "gen-prefill-given",
        after(1, text(R"({"prefill_tp":2,"prefill_host":"10.0.0.1","dp":2,"timeline":false})")));
  write("demo_config", "edge-wrong-types",
        after(0, text(R"({"layers":-1,"seed":1e300,"bytes-per-token":[1.5,2]})")));
}

void sim_messages() {
  write("sim_message", "gen-hello", sim::pack({{"hello", 1}}));
  write("sim_message", "gen-gather",
        sim::pack({{"round", 3}, {"rank", 1}, {"set", {{"req-0", true}, {"req-1", false}}}}));
  write("sim_message", "gen-gather-reply",
        sim::pack({{"round", 3}, {"sets", {{{"req-0", true}}, {{"req-0", false}}}}}));
  std::vector<trace::Event> events{{"read", "decode.0", 10, 5, 0, 3, 4096, "req-0"}};
  write("sim_message", "gen-reply-events",
        sim::pack({{"seq", 7}, {"ok", true}, {"verified", 12}, {"events", sim::to_json(events)}}));
  write(
      "sim_message", "gen-step-job",
      sim::pack({{"op", "step"},
                 {"seq", 8},
                 {"meta", json::binary({1, 2, 3})},
                 {"tokens", 16},
                 {"writes", {{{"req", "r"}, {"first", 0}, {"blocks", {1, 2}}, {"tokens", {5}}}}}}));
  write("sim_message", "edge-float-event",
        sim::pack({{"events", {{"read", "reader", 1e300, -1e300, 1e10, 1.5, -1, "r"}}}}));
  write("sim_message", "edge-deep", nested_msgpack(2000));
  write("sim_message", "edge-wrong-types",
        sim::pack({{"round", "3"}, {"rank", 1.5}, {"seq", -1}, {"op", 7}, {"events", {{1, 2}}}}));
}

void ucx_metadata() {
  transfer::UcxMetadata m;
  m.session_id = "10.0.0.1:5000";
  m.hostname = "prefill-0";
  m.transport = "tcp";
  m.identity = {"0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", 4026531836, 4242, 123456};
  m.worker_address = hex("00 01 02 03 04 05 06 07");
  const Bytes none = transfer::encode_ucx_metadata(m);
  write("ucx_metadata", "gen-no-regions", none);
  // The regions come last: an empty array, one byte (0x90), that the edges replace.
  const Bytes head(none.begin(), none.end() - 1);
  Bytes huge = head;  // an array32 header declaring 2^32 - 1 regions, and no region
  const Bytes count = hex("dd ff ff ff ff");
  huge.insert(huge.end(), count.begin(), count.end());
  write("ucx_metadata", "edge-huge-region-count", huge);
  Bytes deep = head;  // regions nested ten arrays deep
  deep.insert(deep.end(), 9, std::byte{0x91});
  deep.push_back(std::byte{0x90});
  write("ucx_metadata", "edge-deep", deep);
  Bytes later = none;  // {"v": 4, ...}: the map header, the key "v", then the version
  later[3] = std::byte{4};
  write("ucx_metadata", "edge-later-version", later);
  Bytes legacy = text("RD2HUCXM");  // version 2's little-endian format
  const Bytes legacy_body = hex("02 00 00 00 0d 00 00 00");
  legacy.insert(legacy.end(), legacy_body.begin(), legacy_body.end());
  const Bytes session = text("10.0.0.1:5000");
  legacy.insert(legacy.end(), session.begin(), session.end());
  write("ucx_metadata", "edge-legacy-format", legacy);
  transfer::ExportedRegion a;
  a.base = 0x7f0000000000;
  a.length = 1 << 20;
  a.packed_rkey = hex("aa bb cc");
  transfer::ExportedRegion b = a;
  b.base += 2 << 20;
  b.fd = 7;
  b.inode = 99;
  b.file_offset = 4096;
  b.live_offset = 4096 + (1 << 20);
  m.regions = {a, b};
  const Bytes two = transfer::encode_ucx_metadata(m);
  write("ucx_metadata", "gen-two-regions", two);
  Bytes cut(two.begin(), two.begin() + static_cast<std::ptrdiff_t>(two.size() / 2));
  write("ucx_metadata", "edge-truncated", cut);
}

void pd_read_handshakes() {
  tools::SourceHandshake h;
  h.layout = {4, 8, {64, 8, 16}};
  h.seed = 42;
  h.base = 0x7f0000000000;
  h.engine_metadata = hex("00 01 02 03");
  const Bytes good = tools::encode_handshake(h);
  write("pd_read_handshake", "gen-handshake", good);
  Bytes cut(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(good.size() / 2));
  write("pd_read_handshake", "edge-truncated", cut);
  // A map32 header declaring 2^32 - 1 fields, and no field.
  write("pd_read_handshake", "edge-huge-field-count", hex("df ff ff ff ff"));
  // tensor_bytes as an array32 declaring 2^32 - 1 entries, and none.
  msgpack::sbuffer buffer;
  Packer pk(buffer);
  pk.pack_map(1);
  pk.pack(std::string("tensor_bytes"));
  const Bytes head(reinterpret_cast<const std::byte*>(buffer.data()),
                   reinterpret_cast<const std::byte*>(buffer.data()) + buffer.size());
  Bytes huge = head;
  const Bytes count = hex("dd ff ff ff ff");
  huge.insert(huge.end(), count.begin(), count.end());
  write("pd_read_handshake", "edge-huge-tensor-count", huge);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: " << argv[0] << " <corpus dir>\n";
    return 2;
  }
  root = argv[1];
  messages();
  layer_maps();
  step_metadata();
  msgpack_bounds();
  kv_transfer_params();
  connector_configs();
  proxy_bodies();
  demo_configs();
  sim_messages();
  ucx_metadata();
  pd_read_handshakes();
  return 0;
}
