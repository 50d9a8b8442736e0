// Every key of kv_transfer_config reaches what it configures: the modules' configurations
// through the one function per module, or the connector's own settings. A key added to the
// table without a row here fails, so a setting cannot be read and then dropped.
#include "connector/module_configs.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "control/curve.h"

namespace rd2h::connector {
namespace {

using json = nlohmann::json;
using std::chrono::milliseconds;

// What one configuration becomes.
struct Mapped {
  ConnectorConfig c;
  transfer::EngineConfig engine;
  prefill::WorkerConfig prefill;
  decode::WorkerConfig decode;
  metaserver::ClientConfig metaserver;
};

struct Row {
  json value;                                  // not the key's default
  std::function<bool(const Mapped&)> reached;  // whether that value got where it belongs
};

TEST(ModuleConfigs, EveryKeyReachesWhatItConfigures) {
  char pattern[] = "/tmp/rd2h-module-configs-XXXXXX";
  ASSERT_NE(::mkdtemp(pattern), nullptr);
  const std::filesystem::path dir = pattern;
  auto self = control::generate_key_pair();
  auto peer = control::generate_key_pair();
  ASSERT_TRUE(self && peer);
  ASSERT_TRUE(control::write_key_pair((dir / "self").string(), *self).is_ok());
  ASSERT_TRUE(control::write_key_pair((dir / "peer").string(), *peer).is_ok());

  const std::map<std::string, Row> top = {
      {"kv_connector", {"Rd2hConnector", [](const Mapped&) { return true; }}},
      {"kv_role",
       {"kv_consumer", [](const Mapped& m) { return m.engine.role == transfer::Role::kDecode; }}},
      {"kv_port", {30007, [](const Mapped& m) { return m.decode.kv_port == 30007; }}},
      {"engine_id", {"decode-7", [](const Mapped& m) { return m.c.engine_id == "decode-7"; }}},
      {"kv_ip",
       {"127.0.0.7",
        [](const Mapped& m) {
          return m.decode.reader.host == "127.0.0.7" && m.engine.listen_host == "127.0.0.7";
        }}},
  };
  const std::map<std::string, Row> extra = {
      {"kv_ip", {"127.0.0.7", [](const Mapped& m) { return m.decode.reader.host == "127.0.0.7"; }}},
      {"transfer_backend", {"ucx", [](const Mapped& m) { return m.c.transfer_backend == "ucx"; }}},
      {"transport",
       {"tcp", [](const Mapped& m) { return m.engine.transport == transfer::Transport::kTcp; }}},
      {"use_layerwise", {false, [](const Mapped& m) { return !m.c.use_layerwise; }}},
      {"request_id_suffix_chars",
       {3, [](const Mapped& m) { return m.c.request_ids.suffix_chars == 3; }}},
      {"prefill_tp_size", {4, [](const Mapped& m) { return m.decode.p_tp == 4; }}},
      {"curve_secret_key_file",
       {(dir / "self.key_secret").string(),
        [&](const Mapped& m) {
          return m.prefill.sender.curve && m.prefill.sender.curve->secret_key == self->secret_key &&
                 m.decode.reader.security &&
                 m.decode.reader.security->self.secret_key == self->secret_key;
        }}},
      {"curve_trusted_keys_file",
       {(dir / "peer.key").string(),
        [&](const Mapped& m) {
          const std::vector<std::string> trusted{peer->public_key};
          return m.prefill.trusted_decode_keys == trusted && m.decode.reader.security &&
                 m.decode.reader.security->trusted_clients == trusted;
        }}},
      {"kv_advertise_ip",
       {"10.0.0.7", [](const Mapped& m) { return m.c.advertise_host == "10.0.0.7"; }}},
      {"insecure", {true, [](const Mapped& m) { return m.prefill.insecure; }}},
      {"metaserver_token_file",
       {"/nowhere/token",
        [](const Mapped& m) { return m.c.metaserver_token_file == "/nowhere/token"; }}},
      {"on_peer_failure",
       {"raise", [](const Mapped& m) { return m.prefill.raise_on_peer_failure; }}},
      {"busy_poll_us",
       {7,
        [](const Mapped& m) { return m.decode.reader.busy_poll == std::chrono::microseconds(7); }}},
      {"share_registered_memory",
       {false, [](const Mapped& m) { return !m.engine.share_registered; }}},
      {"control_link",
       {false,
        [](const Mapped& m) {
          return !m.prefill.sender.control_link && !m.decode.reader.control_link;
        }}},
      {"ack_timeout_ms",
       {1001, [](const Mapped& m) { return m.prefill.sender.ack_timeout == milliseconds(1001); }}},
      {"reply_timeout_ms",
       {1002,
        [](const Mapped& m) { return m.prefill.sender.reply_timeout == milliseconds(1002); }}},
      {"send_timeout_ms",
       {1003, [](const Mapped& m) { return m.prefill.send_timeout == milliseconds(1003); }}},
      {"read_timeout_ms",
       {1004, [](const Mapped& m) { return m.engine.read_timeout == milliseconds(1004); }}},
      {"connect_timeout_ms",
       {1005, [](const Mapped& m) { return m.engine.connect_timeout == milliseconds(1005); }}},
      {"hold_timeout_ms",
       {1006, [](const Mapped& m) { return m.decode.reader.hold_timeout == milliseconds(1006); }}},
      {"event_timeout_ms",
       {1007,
        [](const Mapped& m) { return m.prefill.sender.event_timeout == milliseconds(1007); }}},
      {"max_held", {17, [](const Mapped& m) { return m.decode.reader.max_held == 17u; }}},
      {"max_held_per_peer",
       {5, [](const Mapped& m) { return m.decode.reader.max_held_per_peer == 5u; }}},
      {"read_path",
       {"am",
        [](const Mapped& m) { return m.engine.read_path == transfer::ReadPath::kActiveMessage; }}},
      // The connector's own wait for a request's KV (ConnectorWorker), not a module's.
      {"kv_arrival_timeout_ms",
       {1008, [](const Mapped& m) { return m.c.kv_arrival_timeout == milliseconds(1008); }}},
      {"metaserver_timeout_ms",
       {1009, [](const Mapped& m) { return m.metaserver.timeout == milliseconds(1009); }}},
      {"metaserver_attempts", {9, [](const Mapped& m) { return m.metaserver.attempts == 9; }}},
      {"metaserver_resubmit_ms",
       {1010, [](const Mapped& m) { return m.metaserver.resubmit == milliseconds(1010); }}},
  };

  // Every key the connector reads has a row, and every row a key.
  std::set<std::string> top_keys, extra_keys;
  for (const auto& k : config_reference()) {
    const bool at_top = k.section.empty();
    (at_top ? top_keys : extra_keys).insert(k.name);
    EXPECT_EQ((at_top ? top : extra).count(k.name), 1u)
        << "'" << k.name << "' has no row: check where it is mapped, then add one";
  }
  EXPECT_EQ(top_keys.size(), top.size());
  EXPECT_EQ(extra_keys.size(), extra.size());

  json j = json::object();
  for (const auto& [key, row] : top) j[key] = row.value;
  for (const auto& [key, row] : extra) j["kv_connector_extra_config"][key] = row.value;
  auto c = ConnectorConfig::from_json(j.dump());
  ASSERT_TRUE(c) << c.status().to_string();
  const Parallel parallel{2, 1, 1, 3};
  Mapped m{*c, c->engine_config(1), prefill_config(*c, parallel, 1, false),
           decode_config(*c, parallel, 1, false), metaserver_config(*c, "a token")};
  for (const auto& [key, row] : top) EXPECT_TRUE(row.reached(m)) << key;
  for (const auto& [key, row] : extra)
    EXPECT_TRUE(row.reached(m)) << "kv_connector_extra_config." << key;

  // What the functions take beside the configuration.
  EXPECT_EQ(m.engine.device_id, 1);
  EXPECT_EQ(m.prefill.p_rank, 1);
  EXPECT_EQ(m.prefill.p_tp, 2);
  EXPECT_TRUE(m.prefill.register_memory);
  EXPECT_EQ(m.decode.reader.d_rank, 1);
  EXPECT_EQ(m.decode.reader.d_tp, 2);
  EXPECT_EQ(m.decode.global_dp_rank, 3);
  EXPECT_TRUE(m.decode.register_memory);
  EXPECT_EQ(m.metaserver.token, "a token");
  EXPECT_FALSE(prefill_config(*c, parallel, 1, true).register_memory);
  EXPECT_FALSE(decode_config(*c, parallel, 1, true).register_memory);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace rd2h::connector
