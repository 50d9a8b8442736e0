// What tests reach inside the connector facade and a host never needs: the Prefill and
// Decode workers a ConnectorWorker wraps, its transfer engine, and how many requests a
// Scheduler still holds state for. Private: hosts see only include/rd2h.
#pragma once

#include <cstddef>
#include <memory>

#include "decode/worker.h"
#include "metaserver/client.h"
#include "prefill/worker.h"
#include "rd2h/connector/metadata.h"
#include "rd2h/connector/scheduler.h"
#include "rd2h/connector/worker.h"
#include "rd2h/transfer/transfer_engine.h"

namespace rd2h::connector::testing {

struct WorkerAccess {
  // Null unless the worker's role (Prefill) registered its caches.
  static prefill::Worker* prefill(ConnectorWorker& w) { return w.prefill_.get(); }
  // Null unless the worker's role (Decode) registered its caches.
  static decode::Worker* decode(ConnectorWorker& w) { return w.decode_.get(); }
  static const std::shared_ptr<transfer::TransferEngine>& engine(const ConnectorWorker& w) {
    return w.engine_;
  }
};

// The metadata a step hands the workers, decoded as a worker decodes it.
inline Expected<ConnectorMetadata> built(KvConnectorScheduler& s,
                                         const std::vector<ScheduledRequest>& scheduled) {
  RD2H_TRY(bytes, s.build_connector_meta(scheduled));
  return decode_metadata(bytes);
}

struct SchedulerAccess {
  // Requests with state in the scheduler.
  static size_t tracked(const Scheduler& s) { return s.recv_.size() + s.send_.size(); }
  // Decode's metaserver client (null on Prefill).
  static const metaserver::Client* metaserver(const Scheduler& s) { return s.metaserver_.get(); }
};

}  // namespace rd2h::connector::testing
