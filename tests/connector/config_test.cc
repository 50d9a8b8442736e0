#include "rd2h/connector/config.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "control/curve.h"
#include "rd2h/connector/metadata.h"

namespace rd2h::connector {
namespace {

TEST(ConnectorConfig, ReadsVllmKvTransferConfig) {
  auto c = ConnectorConfig::from_json(R"({
    "kv_connector": "SfaRemoteD2HConnector", "kv_role": "kv_consumer", "kv_port": 30000,
    "engine_id": "decode-0", "kv_ip": "10.1.2.3", "kv_buffer_device": "cpu", "kv_rank": 1,
    "kv_connector_extra_config": {"transfer_backend": "ucx", "transport": "tcp",
      "use_layerwise": false, "reply_timeout_ms": 1500, "request_id_suffix_chars": 0,
      "prefill_tp_size": 4, "metaserver_attempts": 5, "insecure": true,
      "control_link": false}})");
  ASSERT_TRUE(c) << c.status().to_string();
  EXPECT_EQ(c->role, KvRole::kConsumer);
  EXPECT_EQ(c->kv_port, 30000);
  EXPECT_EQ(c->engine_id, "decode-0");
  EXPECT_EQ(c->host, "10.1.2.3");
  EXPECT_EQ(c->transport, transfer::Transport::kTcp);
  EXPECT_FALSE(c->use_layerwise);
  EXPECT_EQ(c->reply_timeout, std::chrono::milliseconds(1500));
  EXPECT_EQ(c->request_ids.suffix_chars, 0u);
  EXPECT_EQ(c->prefill_tp_size, 4);
  EXPECT_EQ(c->metaserver_attempts, 5);
  EXPECT_TRUE(c->insecure);
  EXPECT_FALSE(c->control_link);
  auto p = ConnectorConfig::from_json(
      R"({"kv_connector": "rd2h", "kv_role": "kv_producer", "kv_port": 1})");
  ASSERT_TRUE(p);
  EXPECT_EQ(p->role, KvRole::kProducer);
  EXPECT_EQ(p->request_ids.suffix_chars, 9u) << "vLLM's id rule by default";
  EXPECT_TRUE(p->control_link) << "links by default";
}

TEST(ConnectorConfig, ToJsonReadsBackAsTheSameConfiguration) {
  ConnectorConfig c;
  c.role = KvRole::kProducer;
  c.engine_id = "prefill-3";
  c.host = "10.0.0.7";
  c.kv_port = 31000;
  c.transport = transfer::Transport::kTcp;
  c.use_layerwise = false;
  c.request_ids.suffix_chars = 0;
  c.prefill_tp_size = 8;
  c.metaserver_attempts = 7;
  c.ack_timeout = std::chrono::milliseconds(11);
  c.reply_timeout = std::chrono::milliseconds(12);
  c.send_timeout = std::chrono::milliseconds(13);
  c.read_timeout = std::chrono::milliseconds(14);
  c.connect_timeout = std::chrono::milliseconds(19);
  c.busy_poll_us = 23;
  c.hold_timeout = std::chrono::milliseconds(15);
  c.kv_arrival_timeout = std::chrono::milliseconds(16);
  c.metaserver_timeout = std::chrono::milliseconds(17);
  c.metaserver_resubmit = std::chrono::milliseconds(18);
  c.insecure = true;
  c.control_link = false;
  auto back = ConnectorConfig::from_json(c.to_json());
  ASSERT_TRUE(back) << back.status().to_string() << "\n" << c.to_json();
  EXPECT_EQ(back->role, c.role);
  EXPECT_EQ(back->engine_id, c.engine_id);
  EXPECT_EQ(back->host, c.host);
  EXPECT_EQ(back->kv_port, c.kv_port);
  EXPECT_EQ(back->transport, c.transport);
  EXPECT_EQ(back->use_layerwise, c.use_layerwise);
  EXPECT_EQ(back->request_ids.suffix_chars, 0u);
  EXPECT_EQ(back->prefill_tp_size, 8);
  EXPECT_EQ(back->metaserver_attempts, 7);
  EXPECT_EQ(back->ack_timeout.count(), 11);
  EXPECT_EQ(back->reply_timeout.count(), 12);
  EXPECT_EQ(back->send_timeout.count(), 13);
  EXPECT_EQ(back->read_timeout.count(), 14);
  EXPECT_EQ(back->connect_timeout.count(), 19);
  EXPECT_EQ(back->busy_poll_us, 23);
  EXPECT_EQ(back->hold_timeout.count(), 15);
  EXPECT_EQ(back->kv_arrival_timeout.count(), 16);
  EXPECT_EQ(back->metaserver_timeout.count(), 17);
  EXPECT_EQ(back->metaserver_resubmit.count(), 18);
  EXPECT_TRUE(back->insecure);
  EXPECT_FALSE(back->control_link);
}

TEST(ConnectorConfig, BadConfigsAreRefusedNamingTheKey) {
  const std::vector<std::pair<const char*, const char*>> cases = {
      {R"({"kv_role": "kv_producer", "kv_port": 1})", "'kv_connector' is missing"},
      {R"({"kv_connector": "Nixl", "kv_role": "kv_producer", "kv_port": 1})", "'kv_connector'"},
      {R"({"kv_connector": "rd2h", "kv_role": "kv_both", "kv_port": 1})", "'kv_role' is 'kv_both'"},
      {R"({"kv_connector": "rd2h", "kv_role": "kv_producer", "kv_port": 70000})",
       "'kv_port' is 70000"},
      {R"({"kv_connector": "rd2h", "kv_role": "kv_producer", "kv_port": "1"})",
       "'kv_port' must be"},
      {R"({"kv_connector": "rd2h", "kv_role": "kv_producer", "kv_port": 1,
          "kv_connector_extra_config": {"transfer_backend": "memfabric"}})",
       "'kv_connector_extra_config.transfer_backend' is 'memfabric'"},
      {R"({"kv_connector": "rd2h", "kv_role": "kv_producer", "kv_port": 1,
          "kv_connector_extra_config": {"reply_timout_ms": 5}})",
       "'kv_connector_extra_config.reply_timout_ms' is not a setting"},
      {R"({"kv_connector": "rd2h", "kv_role": "kv_producer", "kv_port": 1,
          "kv_connector_extra_config": {"send_timeout_ms": 0}})",
       "'kv_connector_extra_config.send_timeout_ms' is 0"},
      {R"({"kv_connector": "rd2h", "kv_role": "kv_producer", "kv_port": 1,
          "kv_connector_extra_config": {"transport": "rdma"}})",
       "'kv_connector_extra_config.transport'"},
      {R"([1, 2])", "must be a JSON object"},
      {R"({"kv_connector": )", "not valid JSON"},
  };
  for (const auto& [text, reason] : cases) {
    auto c = ConnectorConfig::from_json(text);
    ASSERT_FALSE(c) << text;
    EXPECT_NE(c.status().message().find(reason), std::string::npos)
        << "expected \"" << reason << "\" in: " << c.status().message();
  }
}

TEST(ConnectorConfig, KvIpMayBeAnExtraSettingAsVllmHasNoKvIpField) {
  const auto config = [](const std::string& top, const std::string& extra) {
    return ConnectorConfig::from_json(
        R"({"kv_connector": "Rd2hConnector", "kv_role": "kv_consumer", "kv_port": 30000)" + top +
        R"(, "kv_connector_extra_config": {)" + extra + "}}");
  };
  auto extra = config("", R"("kv_ip": "127.0.0.2")");
  ASSERT_TRUE(extra) << extra.status().to_string();
  EXPECT_EQ(extra->host, "127.0.0.2");
  auto both = config(R"(, "kv_ip": "127.0.0.2")", R"("kv_ip": "127.0.0.2")");
  ASSERT_TRUE(both) << both.status().to_string();
  EXPECT_EQ(both->host, "127.0.0.2");
  auto differ = config(R"(, "kv_ip": "127.0.0.3")", R"("kv_ip": "127.0.0.2")");
  ASSERT_FALSE(differ);
  EXPECT_NE(differ.status().message().find("kv_connector_extra_config.kv_ip"), std::string::npos)
      << differ.status().message();
  auto open = config("", R"("kv_ip": "10.1.2.3")");
  ASSERT_FALSE(open) << "a non-loopback kv_ip without keys, from the extra config too";
  EXPECT_NE(open.status().message().find("insecure"), std::string::npos);
  auto wrong = config("", R"("kv_ip": 7)");
  ASSERT_FALSE(wrong);
  EXPECT_NE(wrong.status().message().find("kv_connector_extra_config.kv_ip"), std::string::npos)
      << wrong.status().message();
}

// A Decode may bind a wildcard address, but Prefill must be told one it can reach.
TEST(ConnectorConfig, AWildcardKvIpNeedsAnAdvertisedAddressThatIsNotOne) {
  const auto config = [](const std::string& role, const std::string& ip, const std::string& extra) {
    return ConnectorConfig::from_json(
        R"({"kv_connector": "rd2h", "kv_role": ")" + role + R"(", "kv_port": 30000, "kv_ip": ")" +
        ip + R"(", "kv_connector_extra_config": {"insecure": true)" + extra + "}}");
  };
  for (const char* ip : {"0.0.0.0", "::"}) {
    auto bare = config("kv_consumer", ip, "");
    ASSERT_FALSE(bare) << ip;
    EXPECT_NE(bare.status().message().find("kv_advertise_ip"), std::string::npos)
        << bare.status().message();
    auto told = config("kv_consumer", ip, R"(, "kv_advertise_ip": "10.0.0.2")");
    ASSERT_TRUE(told) << told.status().to_string();
    EXPECT_EQ(told->host, ip);
    EXPECT_EQ(told->advertise_host, "10.0.0.2");
  }
  auto wildcard = config("kv_consumer", "10.0.0.2", R"(, "kv_advertise_ip": "0.0.0.0")");
  ASSERT_FALSE(wildcard);
  EXPECT_NE(wildcard.status().message().find("'kv_connector_extra_config.kv_advertise_ip'"),
            std::string::npos)
      << wildcard.status().message();
  EXPECT_TRUE(config("kv_producer", "0.0.0.0", "")) << "Prefill binds nothing on kv_ip";
}

TEST(ConnectorConfig, WithoutKeysOnlyLoopbackRunsUnlessInsecure) {
  const auto config = [](const std::string& ip, const std::string& extra) {
    return ConnectorConfig::from_json(R"({"kv_connector": "rd2h", "kv_role": "kv_consumer",
        "kv_port": 30000, "kv_ip": ")" +
                                      ip + R"(", "kv_connector_extra_config": {)" + extra + "}}");
  };
  for (const char* ip : {"127.0.0.1", "127.3.2.1", "localhost", "::1"}) {
    EXPECT_TRUE(config(ip, "")) << ip;
  }
  auto open = config("10.1.2.3", "");
  ASSERT_FALSE(open);
  EXPECT_NE(open.status().message().find("'kv_ip'"), std::string::npos) << open.status().message();
  EXPECT_NE(open.status().message().find("insecure"), std::string::npos);
  EXPECT_NE(open.status().message().find("curve_secret_key_file"), std::string::npos);
  auto insecure = config("10.1.2.3", R"("insecure": true)");
  ASSERT_TRUE(insecure) << insecure.status().to_string();
  EXPECT_FALSE(insecure->curve.enabled());
  auto wrong = config("127.0.0.1", R"("insecure": "yes")");
  ASSERT_FALSE(wrong);
  EXPECT_NE(wrong.status().message().find("insecure"), std::string::npos);
}

TEST(ConnectorConfig, CurveKeysComeFromTheFilesNamedInTheExtraConfig) {
  char pattern[] = "/tmp/rd2h-config-keys-XXXXXX";
  ASSERT_NE(::mkdtemp(pattern), nullptr);
  const std::filesystem::path dir = pattern;
  auto self = control::generate_key_pair();
  auto peer = control::generate_key_pair();
  ASSERT_TRUE(self && peer);
  ASSERT_TRUE(control::write_key_pair((dir / "decode").string(), *self).is_ok());
  ASSERT_TRUE(control::write_key_pair((dir / "prefill").string(), *peer).is_ok());
  const auto config = [&](const std::string& secret, const std::string& trusted) {
    return ConnectorConfig::from_json(
        R"({"kv_connector": "rd2h", "kv_role": "kv_consumer", "kv_port": 30000,
            "kv_ip": "10.1.2.3", "kv_connector_extra_config": {"curve_secret_key_file": ")" +
        secret + R"(", "curve_trusted_keys_file": ")" + trusted + R"("}})");
  };
  auto c = config((dir / "decode.key_secret").string(), (dir / "prefill.key").string());
  ASSERT_TRUE(c) << c.status().to_string();
  EXPECT_TRUE(c->curve.enabled());
  EXPECT_EQ(c->curve.public_key, self->public_key);
  EXPECT_EQ(c->curve.secret_key, self->secret_key);
  EXPECT_EQ(c->curve.trusted, std::vector<std::string>{peer->public_key});
  auto back = ConnectorConfig::from_json(c->to_json());
  ASSERT_TRUE(back) << back.status().to_string();
  EXPECT_EQ(back->curve.trusted, c->curve.trusted);
  // A public certificate is not a secret key, and a missing file is named.
  auto not_secret = config((dir / "decode.key").string(), (dir / "prefill.key").string());
  ASSERT_FALSE(not_secret);
  EXPECT_NE(not_secret.status().message().find("curve_secret_key_file"), std::string::npos)
      << not_secret.status().message();
  auto missing = config((dir / "decode.key_secret").string(), (dir / "nobody.key").string());
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.status().message().find("curve_trusted_keys_file"), std::string::npos)
      << missing.status().message();
  std::filesystem::remove_all(dir);
}

TEST(RequestIdRule, StripsVllmSuffixAndRefusesIdsWithoutOne) {
  RequestIdRule vllm;
  EXPECT_EQ(*vllm.to_external("cmpl-5f2e-0-1a2b3c4d"), "cmpl-5f2e-0");
  EXPECT_EQ(*vllm.to_external("chatcmpl-abc-deadbeef"), "chatcmpl-abc");
  auto plain = vllm.to_external("cmpl-5f2e-0");  // an engine that adds no suffix
  ASSERT_FALSE(plain) << "an id without the suffix was cut: " << *plain;
  EXPECT_NE(plain.status().message().find("cmpl-5f2e-0"), std::string::npos);
  EXPECT_FALSE(vllm.to_external("-1234567"));
  RequestIdRule none{0};
  EXPECT_EQ(*none.to_external("cmpl-5f2e-0"), "cmpl-5f2e-0");
}

TEST(KvTransferParams, RendezvousKeysFollowTheWireOrder) {
  KvTransferParams p;
  p.request_id = "cmpl-x-0";
  p.remote_engine_id = "decode-0";
  p.remote_host = "10.0.0.2";
  p.remote_port = 30002;
  p.remote_tp_size = 2;
  p.remote_cached_tokens = 128;
  EXPECT_EQ(p.rendezvous_json(),
            R"({"request_id":"cmpl-x-0","do_remote_prefill":false,"do_remote_decode":true,)"
            R"("remote_engine_id":"decode-0","remote_host":"10.0.0.2","remote_port":30002,)"
            R"("remote_tp_size":2,"remote_pcp_size":1,"remote_dcp_size":1,)"
            R"("remote_cached_tokens":128})");
  auto back = KvTransferParams::from_json(p.rendezvous_json());
  ASSERT_TRUE(back);
  EXPECT_TRUE(back->do_remote_decode);
  EXPECT_EQ(back->remote_port, 30002);
  EXPECT_EQ(back->remote_cached_tokens, 128u);
}

TEST(KvTransferParams, PromptListChildrenAreFoundByIdAndAMissingOneIsNamed) {
  auto p = KvTransferParams::from_json(R"({"request_id": "cmpl-p-0", "do_remote_decode": true,
    "remote_host": "h", "remote_port": 100, "batch_kv_transfer_params": {
      "cmpl-p-0": {"request_id": "cmpl-p-0", "remote_host": "h", "remote_port": 100},
      "cmpl-p-1": {"request_id": "cmpl-p-1", "remote_host": "h2", "remote_port": 200,
                   "remote_cached_tokens": 16}}})");
  ASSERT_TRUE(p) << p.status().to_string();
  ASSERT_EQ(p->batch.size(), 2u);
  auto child = p->for_request("cmpl-p-1");
  ASSERT_TRUE(child);
  EXPECT_EQ(child->remote_host, "h2");
  EXPECT_EQ(child->remote_cached_tokens, 16u);
  auto missing = p->for_request("cmpl-p-2");
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.status().message().find("cmpl-p-2"), std::string::npos);
  auto wrong = KvTransferParams::from_json(R"({"remote_port": "x"})");
  ASSERT_FALSE(wrong);
  EXPECT_NE(wrong.status().message().find("'remote_port'"), std::string::npos);
}

TEST(KvTransferParams, VirtualIsReadAsABoolean) {
  auto p = KvTransferParams::from_json(R"({"do_remote_prefill":true,"virtual":true})");
  ASSERT_TRUE(p);
  EXPECT_TRUE(p->is_virtual);
  EXPECT_FALSE(KvTransferParams::from_json(R"({"virtual":"yes"})"));
}

TEST(KvTransferParams, DoVirtualTheExistingConnectorsSpellingMakesTheRequestVirtualToo) {
  auto p = KvTransferParams::from_json(R"({"do_remote_prefill":true,"do_virtual":true})");
  ASSERT_TRUE(p) << p.status().to_string();
  EXPECT_TRUE(p->is_virtual);
  p = KvTransferParams::from_json(R"({"do_remote_prefill":true,"do_virtual":false})");
  ASSERT_TRUE(p);
  EXPECT_FALSE(p->is_virtual);
  auto wrong = KvTransferParams::from_json(R"({"do_virtual":1})");
  ASSERT_FALSE(wrong);
  EXPECT_NE(wrong.status().message().find("'do_virtual'"), std::string::npos);
}

TEST(KvTransferParams, FloatsAndOutOfRangeNumbersAreRefusedNamingTheKey) {
  struct Case {
    const char* json;
    const char* key;
  };
  for (const Case& c : {Case{R"({"remote_port": 1e300})", "'remote_port'"},
                        Case{R"({"remote_tp_size": 2.5})", "'remote_tp_size'"},
                        Case{R"({"remote_cached_tokens": -1})", "'remote_cached_tokens'"},
                        Case{R"({"remote_cached_tokens": -1e300})", "'remote_cached_tokens'"},
                        Case{R"({"remote_pcp_size": 4294967297})", "'remote_pcp_size'"}}) {
    auto p = KvTransferParams::from_json(c.json);
    ASSERT_FALSE(p) << c.json;
    EXPECT_NE(p.status().message().find(c.key), std::string::npos) << p.status().message();
  }
  auto big = KvTransferParams::from_json(R"({"remote_cached_tokens": 18446744073709551615})");
  ASSERT_TRUE(big) << big.status().to_string();
  EXPECT_EQ(big->remote_cached_tokens, UINT64_MAX);
}

TEST(ConnectorMetadata, FloatsAndOutOfRangeNumbersAreRefused) {
  // A save entry as nlohmann writes it, with a float where an integer belongs in each case.
  auto save_with = [](size_t field, nlohmann::json value) {
    nlohmann::json s = {"e", "h", 30000, 2, {1}, {1}, 0, 0, true, ""};
    s[field] = std::move(value);
    const auto b = nlohmann::json::to_msgpack(nlohmann::json{
        {"load", nlohmann::json::array()}, {"abort", nlohmann::json::array()}, {"save", {s}}});
    std::vector<std::byte> out(b.size());
    std::memcpy(out.data(), b.data(), b.size());
    return out;
  };
  EXPECT_TRUE(decode_metadata(save_with(2, 30001)));
  const std::vector<std::pair<size_t, nlohmann::json>> cases = {
      {2, 1e300}, {3, -1e300}, {2, int64_t{1} << 40}, {4, nlohmann::json::array({1.5})},
      {6, 1e19},  {7, -0.5}};
  for (const auto& [field, value] : cases) {
    auto m = decode_metadata(save_with(field, value));
    ASSERT_FALSE(m) << "field " << field << " = " << value.dump();
    EXPECT_NE(m.status().message().find("not an integer in range"), std::string::npos)
        << m.status().message();
  }
}

TEST(ConnectorMetadata, RoundTripsAndRefusesBrokenBytes) {
  ConnectorMetadata m;
  m.load.push_back({"e1", "e1-abcdefgh", {1, 2, 3}, {4}});
  m.abort = {"e0"};
  m.save.push_back({"e2", "10.0.0.2", 30000, 2, {7, 8}, {9}, 3, 1, true, "rq+key"});
  const auto bytes = encode(m);
  auto back = decode_metadata(bytes);
  ASSERT_TRUE(back) << back.status().to_string();
  ASSERT_EQ(back->load.size(), 1u);
  EXPECT_EQ(back->load[0].main_blocks, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(back->abort, m.abort);
  ASSERT_EQ(back->save.size(), 1u);
  EXPECT_EQ(back->save[0].d_base_port, 30000);
  EXPECT_EQ(back->save[0].main_start, 3);
  EXPECT_TRUE(back->save[0].final_chunk);
  EXPECT_EQ(back->save[0].d_public_key, "rq+key");
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_FALSE(decode_metadata(std::span(bytes.data(), n))) << "truncated at " << n;
  }
}

}  // namespace
}  // namespace rd2h::connector
