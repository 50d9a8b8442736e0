// What a connector has done so far, for a host's metrics (every count only grows).
#pragma once

#include <cstdint>
#include <vector>

namespace rd2h::connector {

// A Decode rank's reads (Prefill ranks read nothing: all zero).
struct TransferStats {
  uint64_t layers_done = 0;    // layers of requests whose KV arrived whole
  uint64_t layers_failed = 0;  // layers that failed (a read, a refusal, a dead Prefill)
  uint64_t reads = 0;          // batched reads from a Prefill rank (one per layer and peer)
  uint64_t bytes_read = 0;     // by the reads that succeeded
  // Each read's latency: how many took at most read_seconds_bounds[i] (and more than the
  // bound before), then how many took longer than the last; their sum in seconds.
  std::vector<double> read_seconds_bounds;
  std::vector<uint64_t> read_seconds_buckets;
  double read_seconds_sum = 0;
  // Prefill: the layers' readiness messages sent to Decode so far.
  uint64_t readiness_sent = 0;
  // Prefill: failures of a Decode (dead, stalled, refusing, a failed read) that failed only
  // that Decode's requests (on_peer_failure "fail"), one per layer slot they reached.
  uint64_t peer_failures = 0;
};

// Decode's posts of its rendezvous to the metaserver.
struct MetaserverStats {
  uint64_t delivered = 0;         // answered 2xx
  uint64_t refused = 0;           // answered otherwise (not tried again)
  uint64_t failed_attempts = 0;   // attempts that got no answer (each is tried again)
  uint64_t cancelled = 0;         // given up with their request
};

}  // namespace rd2h::connector
