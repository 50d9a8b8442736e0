// The connector's configuration, read from vLLM's kv_transfer_config JSON (from_json). Top-level
// keys the connector does not use are ignored; every key inside kv_connector_extra_config must
// be known, and a bad value is refused naming its key.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "rd2h/common/status.h"
#include "rd2h/transfer/transfer_engine.h"

namespace rd2h::connector {

enum class KvRole { kProducer, kConsumer };  // Prefill, Decode

// How a host engine's internal request id relates to the external id the proxy, Prefill
// and Decode share. vLLM appends "-" and 8 characters: suffix_chars = 9. An id that does
// not carry the suffix is an error, never cut blindly. suffix_chars = 0: the ids are equal.
struct RequestIdRule {
  size_t suffix_chars = 9;
  char separator = '-';

  Expected<std::string> to_external(std::string_view internal_id) const;
};

struct ConnectorConfig {
  KvRole role = KvRole::kConsumer;
  std::string engine_id;
  std::string host = "127.0.0.1";  // kv_ip: where Decode binds (and what it advertises)
  // kv_advertise_ip: the address Decode tells Prefill to reach it at; empty: kv_ip.
  std::string advertise_host;
  int kv_port = 0;

  // kv_connector_extra_config
  std::string transfer_backend = "ucx";
  transfer::Transport transport = transfer::Transport::kAuto;
  // Prefill publishes each layer as it is saved (true), or every saved layer at once in
  // wait_for_save (false: needs one physical buffer per layer).
  bool use_layerwise = true;
  RequestIdRule request_ids;
  // Decode: the TP size of the Prefill instances it expects, checked at start to be a
  // multiple of Decode's; 0: not checked. Each readiness carries its own contributor count,
  // so Prefill instances of any TP size that is a multiple of Decode's are served.
  int prefill_tp_size = 0;
  std::chrono::milliseconds ack_timeout{10000};
  std::chrono::milliseconds reply_timeout{30000};
  std::chrono::milliseconds send_timeout{60000};         // Prefill's waits for its layers
  std::chrono::milliseconds read_timeout{5000};          // one batched engine read
  std::chrono::milliseconds connect_timeout{5000};       // Decode's connect to a Prefill
  std::chrono::milliseconds hold_timeout{5000};          // readiness held for unseeded requests
  std::chrono::milliseconds event_timeout{30000};        // Prefill: a layer's write event
  size_t max_held = 1024;          // Decode: readiness held for unseeded requests, in all
  size_t max_held_per_peer = 256;  // and of one Prefill connection
  transfer::ReadPath read_path = transfer::ReadPath::kAuto;  // how the engine reads
  std::chrono::milliseconds kv_arrival_timeout{120000};  // a Decode request's KV must arrive
  std::chrono::milliseconds metaserver_timeout{5000};    // one metaserver POST
  int metaserver_attempts = 3;                           // before resubmitting
  std::chrono::milliseconds metaserver_resubmit{1000};
  // Decode: a file holding the bearer token its metaserver posts carry; empty: the
  // environment variable RD2H_TOKEN, if set.
  std::string metaserver_token_file;

  // Control-plane trust. With keys, Decode accepts only Prefill clients whose public key is
  // trusted, and Prefill talks only to Decode servers whose key is trusted (ZeroMQ CURVE).
  // Without keys the connector runs on loopback addresses only, unless `insecure`.
  struct Curve {
    std::string secret_key_file;    // "curve_secret_key_file", written by `rd2h keygen`
    std::string trusted_keys_file;  // "curve_trusted_keys_file": the peers' public keys
    // Read from the files by from_json (Z85).
    std::string public_key;
    std::string secret_key;
    std::vector<std::string> trusted;
    bool enabled() const { return !secret_key.empty(); }
  };
  Curve curve;
  bool insecure = false;  // "insecure": run without keys beyond loopback (warned at start)
  // Prefill: registered KV memory moves into shared memory co-located Decode processes map
  // (transfer::EngineConfig::share_registered); "share_registered_memory": false keeps it
  // private, and such reads are answered by the Prefill process.
  bool share_registered_memory = true;
  // Readiness and answers travel on the transfer engine's own connection (a link, offered
  // in MF_META and opened by Decode) where both ends are rd2h; "control_link": false keeps
  // them on ZeroMQ.
  bool control_link = true;
  // Decode: while a request read on a link waits for its later layers, Decode polls the
  // link for up to this many microseconds after each layer instead of sleeping, so the
  // Prefill publishing the next layer does not pay for waking it (decode::ReaderConfig::
  // busy_poll). 0: Decode always sleeps.
  int busy_poll_us = 50000;
  // Prefill, "on_peer_failure": what a failing Decode (dead, stalled past reply_timeout_ms,
  // refusing, unreachable, a READ_FAILED) does to the compute path. "fail" (false, the
  // default): only that Decode's requests fail; the step goes on, the failure is logged and
  // counted (TransferStats::peer_failures), and the Decode never completes those requests
  // (KV_COMMIT). "raise" (true): wait_for_save and the reuse waits return the failure, as
  // the design's fail-fast has it.
  bool raise_on_peer_failure = false;
  // Fills `curve` from the two files.
  Status load_curve_keys(std::string secret_key_file, std::string trusted_keys_file);

  // The transfer engine's settings for the TP rank on `device_id`: one place maps them, for
  // every host that builds an engine from this configuration.
  transfer::EngineConfig engine_config(int device_id) const;

  static Expected<ConnectorConfig> from_json(std::string_view text);
  // The kv_transfer_config that from_json reads back as this configuration.
  std::string to_json() const;
};

// One key of kv_transfer_config as the connector reads it, for its reference document.
struct ConfigKey {
  std::string name;
  std::string section;        // "" (top level) or "kv_connector_extra_config"
  std::string type;           // what values it takes
  std::string default_value;  // as JSON; else "required" or what it follows, in words
  bool literal = true;        // default_value is JSON
  std::string who;            // "Prefill", "Decode" or "both"
  std::string doc;
};

// Every key the connector reads, from the table from_json reads them with.
std::vector<ConfigKey> config_reference();

}  // namespace rd2h::connector
