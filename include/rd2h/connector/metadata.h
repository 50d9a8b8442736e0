// What travels between the connector's parts outside the KV protocol: a request's
// kv_transfer_params (docs/wire-format.md "The rendezvous over HTTP") and the per-step
// metadata a scheduler hands its workers, a value type that serializes for worker processes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "rd2h/common/status.h"
#include "rd2h/prefill/send_request.h"

namespace rd2h::connector {

struct KvTransferChild;

struct KvTransferParams {
  bool do_remote_prefill = false;  // Decode: the prompt's KV comes from a Prefill
  bool do_remote_decode = false;   // Prefill: a Decode pulls the KV
  std::string metaserver;          // Decode: where to post the rendezvous
  // Decode: "virtual": the request's rendezvous is not posted (it reaches Prefill some other
  // way, or the request is a stand-in); Decode still expects its KV.
  bool is_virtual = false;
  // What Decode posts, and Prefill receives.
  std::string request_id;  // the external id
  std::string remote_engine_id;
  std::string remote_host;
  int remote_port = 0;  // Decode's base port
  int remote_tp_size = 1;
  int remote_pcp_size = 1;
  int remote_dcp_size = 1;
  uint64_t remote_cached_tokens = 0;
  // Decode's CURVE public key (Z85), posted when Decode has keys: the Prefill connects only
  // if it trusts this key.
  std::string remote_public_key;
  // A prompt list's children, by child external id (Prefill).
  std::vector<KvTransferChild> batch;

  // Parses a kv_transfer_params JSON object; a wrong type is refused naming the key.
  static Expected<KvTransferParams> from_json(std::string_view text);
  // Decode's rendezvous body: the keys of docs/wire-format.md in their order.
  std::string rendezvous_json() const;
  // Prefill's params for the Decode of `ext_id`: this one, or its child in `batch`; a
  // missing child is an error naming it.
  Expected<KvTransferParams> for_request(const std::string& ext_id) const;
};

// A prompt list's child: its external id and its params. A struct, not a std::pair: a pair
// of a type still being defined does not compile with every standard library.
struct KvTransferChild {
  std::string ext_id;
  KvTransferParams params;
};

// Decode: a request whose KV this worker should expect, and where it lands.
struct LoadRequest {
  std::string ext_id;
  std::string internal_id;
  std::vector<int64_t> main_blocks;
  std::vector<int64_t> indexer_blocks;
};

struct ConnectorMetadata {
  std::vector<LoadRequest> load;           // Decode: requests to expect from now on
  std::vector<std::string> abort;          // Decode: external ids given up
  std::vector<prefill::SendRequest> save;  // Prefill: what this step publishes

  bool empty() const { return load.empty() && abort.empty() && save.empty(); }
};

std::vector<std::byte> encode(const ConnectorMetadata& m);
Expected<ConnectorMetadata> decode_metadata(std::span<const std::byte> bytes);

}  // namespace rd2h::connector
