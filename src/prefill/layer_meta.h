// A Prefill layer as MF_META describes it: where the cache layout meets the wire format.
#pragma once

#include "protocol/messages.h"
#include "rd2h/layout/cache_layer.h"

namespace rd2h::prefill {

protocol::LayerMeta to_layer_meta(const layout::CacheLayer& layer);

}  // namespace rd2h::prefill
