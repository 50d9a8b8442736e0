// The control-plane messages (spec "Control Protocol") as plain structs, with msgpack codecs
// byte-compatible with the existing Python implementation (docs/wire-format.md). Decoders check
// arity, types and ranges and never allocate beyond the message's size; rd2h's fields come last.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "rd2h/common/status.h"

namespace rd2h::protocol {

// Versions rd2h states in MF_META. A peer stating a different one is refused.
// Version 2: Prefill commits each request Decode has read whole (KV_COMMIT), and Decode
// finishes a request only on its commit.
inline constexpr uint64_t kProtocolVersion = 2;
inline constexpr uint64_t kCacheLayoutVersion = 1;

inline constexpr std::string_view kAckPayload = "ACK";  // raw bytes, not msgpack
// What an rd2h Decode answers an rd2h Prefill's MF_META with (raw bytes too): the ACK, and
// the promise to take a request as complete only once Prefill commits it (KvCommit). A
// Prefill that gets the plain ACK (the existing Python Decode) commits nothing.
inline constexpr std::string_view kAckCommitPayload = "ACK commit";

// Limits every decoder enforces, sized to what one layer of one step can carry: a step
// schedules at most kMaxReadReqs requests, each of at most kMaxBlockIdsPerRequest blocks
// (a 1M-token context at block size 1), and one readiness names at most
// kMaxBlockIdsPerReadiness block ids in all (main and indexer lists together; 32 MiB
// decoded). The largest legal readiness (every id a 5-byte uint32, every ext id 1 KiB) is
// about 37 MiB; kMaxMessageBytes, with room for a large MF_META, is also every control
// socket's ZMQ_MAXMSGSIZE, so a larger frame closes its connection before it is read.
inline constexpr size_t kMaxMessageBytes = 64u << 20;
inline constexpr size_t kMaxStringBytes = 64u << 10;
inline constexpr size_t kMaxArrayItems = 1u << 22;
inline constexpr size_t kMaxReadReqs = 1u << 14;
inline constexpr size_t kMaxDoneExtIds = 1u << 14;
inline constexpr size_t kMaxBlockIdsPerRequest = 1u << 20;
inline constexpr size_t kMaxBlockIdsPerReadiness = 1u << 22;
inline constexpr size_t kMaxExtIdBytes = 1024;
// MF_META's layer map: layers per model and tensors per layer.
inline constexpr size_t kMaxLayers = 1u << 12;
inline constexpr size_t kMaxTensorsPerLayer = 64;
// Nesting depth any decoder of untrusted msgpack accepts.
inline constexpr size_t kMaxNestingDepth = 32;
inline constexpr int64_t kMaxBlockId = (int64_t{1} << 31) - 1;
inline constexpr int64_t kMaxLayerIndex = 1 << 20;
inline constexpr int64_t kMaxTpRatio = 1 << 12;

// One layer's cache tensors as Prefill exposes them: K, V (main), then indexer, then the
// optional LIC8 scale.
struct LayerMeta {
  std::vector<uint64_t> base_addrs;
  std::vector<uint64_t> block_len;         // bytes per kernel block
  std::vector<uint64_t> block_size_scale;  // kernel blocks per block
  std::vector<uint64_t> tensor_group_idx;
  uint64_t main_tensor_count = 2;
  bool has_indexer = false;

  // Bytes per block of tensor i.
  uint64_t bytes_per_block(size_t i) const { return block_len[i] * block_size_scale[i]; }
};

struct MfMeta {
  std::string p_session;
  std::vector<std::pair<std::string, LayerMeta>> layers;  // ascending layer order
  // Appended by rd2h; absent when a legacy peer sent the message.
  std::optional<uint64_t> protocol_version;
  std::optional<uint64_t> cache_layout_version;
  std::string backend_name;
  std::vector<std::byte> backend_metadata;
  // A notification channel (TransferEngine::listen_notifications): this Prefill takes
  // readiness answers, and sends readiness, on the transfer engine's own connection once
  // Decode opens it (the link).
  // Absent: the control plane stays on this connection.
  std::optional<uint64_t> control_link;
};

struct ReadReq {
  std::string ext_id;
  std::vector<int64_t> main_block_ids;
  std::vector<int64_t> indexer_block_ids;
  int64_t main_start = 0;
  int64_t indexer_start = 0;
};

struct ReadReadyBatch {
  int64_t layer_idx = 0;
  std::string layer_name;
  std::vector<ReadReq> read_reqs;
  std::vector<std::string> done_ext_ids;
  int64_t group_member_idx = 0;
  int64_t tp_ratio = 1;
};

struct ReadDone {
  int64_t layer_idx = 0;
};

struct ReadFailed {
  int64_t layer_idx = 0;
  std::string error;
};

// KV_COMMIT (P -> D, rd2h peers only; see kAckCommitPayload): Prefill got READ_DONE for the
// readiness of `layer_idx` that completed `ext_ids`, on a connection it never gave up on, so
// no slot those requests were read from was reused before Decode's reads: the requests are
// complete. A Prefill that gives up on a Decode (a deadline, a lost connection) drops the
// connection before it reuses a slot, and commits nothing on it again: a Decode that stalled
// mid-read and read overwritten bytes never completes those requests.
// `[bin "kv_commit", int layer_idx, array of str ext_ids]`.
struct KvCommit {
  int64_t layer_idx = 0;
  std::vector<std::string> ext_ids;
};

using Message = std::variant<MfMeta, ReadReadyBatch, ReadDone, ReadFailed, KvCommit>;

std::vector<std::byte> encode(const MfMeta& m);
std::vector<std::byte> encode(const ReadReadyBatch& m);
// A readiness in two parts: what stays the same for every layer of a step (read_reqs,
// done_ext_ids, group_member_idx, tp_ratio), encoded once, and the layer's own fields,
// put in front for each layer. encode_readiness(i, name, encode_readiness_body(m)) is
// encode(m) with m's layer_idx and layer_name replaced by i and name.
std::vector<std::byte> encode_readiness_body(const ReadReadyBatch& m);
std::vector<std::byte> encode_readiness(int64_t layer_idx, std::string_view layer_name,
                                        std::span<const std::byte> body);
std::vector<std::byte> encode(const ReadDone& m);
std::vector<std::byte> encode(const ReadFailed& m);
std::vector<std::byte> encode(const KvCommit& m);

// Decodes any msgpack message of the protocol (not the raw ACK).
Expected<Message> decode_message(std::span<const std::byte> payload);
// The ACK, plain or committing.
bool is_ack(std::span<const std::byte> payload);
// The committing ACK (kAckCommitPayload).
bool is_commit_ack(std::span<const std::byte> payload);

// The layer index of a message too broken to decode, when it can still be read: lets
// Decode answer READ_FAILED for it rather than stay silent.
std::optional<int64_t> salvage_layer_index(std::span<const std::byte> payload);

// The tag of a protocol message ("mf_meta", "read_ready_batch", ...) when `payload` starts
// like one (an array whose first item is bin or, wrongly, str), read without decoding the
// rest: lets Decode answer a broken MF_META and tell a message it does not know from noise.
// `as_str`, if given, says whether the tag was a str.
std::optional<std::string> peek_tag(std::span<const std::byte> payload, bool* as_str = nullptr);

// Checks, without recursion and without allocating, that `bytes` is exactly one msgpack
// value nested at most `max_depth` containers deep whose container headers fit the bytes
// left. Run it before handing untrusted msgpack to a recursive parser (nlohmann's
// from_msgpack). The error names `what` and the offending offset.
Status check_msgpack_bounds(std::span<const std::byte> bytes, size_t max_depth,
                            std::string_view what);
// How deep the messages other than the readiness may nest (MF_META's layer map is 3).
inline constexpr size_t kTreeDepth = 16;

// Refuses a peer whose stated protocol or cache-layout version differs from ours, naming
// both. A legacy peer states none and is accepted.
Status check_compatible(const MfMeta& peer);

}  // namespace rd2h::protocol
