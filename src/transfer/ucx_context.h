// The UCX context of one engine: the transports its configuration asks for, the network
// device that holds its listen address, and the TCP settings reads over TCP need.
#pragma once

#include "rd2h/common/status.h"
#include "rd2h/transfer/transfer_engine.h"
#include "transfer/ucx_handles.h"

namespace rd2h::transfer {

// Whatever the UCX_* environment sets stays as set.
Expected<UcxContext> create_ucx_context(const EngineConfig& config);

}  // namespace rd2h::transfer
