// What Decode reads off the wire into the read arithmetic: a Prefill layer as MF_META
// describes it, and a request's blocks as a readiness publishes them.
#pragma once

#include "layout/layout.h"
#include "protocol/messages.h"
#include "rd2h/common/status.h"

namespace rd2h::decode {

// A scale is present when a tensor follows the indexer.
Expected<layout::LayerTensors> from_layer_meta(const protocol::LayerMeta& meta);

// A view of `req`, valid while it lives.
inline layout::SourceBlocks source_blocks(const protocol::ReadReq& req) {
  return {req.ext_id, req.main_block_ids, req.indexer_block_ids, req.main_start, req.indexer_start};
}

}  // namespace rd2h::decode
