// The tags that open each control-plane message on the wire (docs/wire-format.md), shared by
// the encoders (messages_encode.cc) and the decoders (messages.cc).
#pragma once

#include <string_view>

namespace rd2h::protocol {

inline constexpr std::string_view kTagMfMeta = "mf_meta";
inline constexpr std::string_view kTagReadReadyBatch = "read_ready_batch";
inline constexpr std::string_view kTagReadDone = "read_done";
inline constexpr std::string_view kTagReadFailed = "read_failed";
inline constexpr std::string_view kTagKvCommit = "kv_commit";

}  // namespace rd2h::protocol
