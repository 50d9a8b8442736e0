// The connector's configuration mapped onto the configurations of the modules it drives:
// one function per module, the only place a setting of kv_transfer_config reaches it.
#pragma once

#include <string>

#include "decode/worker.h"
#include "metaserver/client.h"
#include "prefill/worker.h"
#include "rd2h/connector/config.h"
#include "rd2h/connector/scheduler.h"

namespace rd2h::connector {

// Prefill's TP rank `tp_rank`; `engine_allocated`: its KV lives in memory the engine
// allocated (registered already).
prefill::WorkerConfig prefill_config(const ConnectorConfig& c, const Parallel& parallel,
                                     int tp_rank, bool engine_allocated);
// Decode's TP rank `tp_rank`, likewise.
decode::WorkerConfig decode_config(const ConnectorConfig& c, const Parallel& parallel, int tp_rank,
                                   bool engine_allocated);
// Decode's rendezvous posts, with the token read from metaserver_token_file (or
// $RD2H_TOKEN).
metaserver::ClientConfig metaserver_config(const ConnectorConfig& c, std::string token);

}  // namespace rd2h::connector
