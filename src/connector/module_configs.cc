#include "connector/module_configs.h"

namespace rd2h::connector {

prefill::WorkerConfig prefill_config(const ConnectorConfig& c, const Parallel& parallel,
                                     int tp_rank, bool engine_allocated) {
  prefill::WorkerConfig pc;
  pc.p_rank = tp_rank;
  pc.p_tp = parallel.tp_size;
  pc.sender.ack_timeout = c.ack_timeout;
  pc.sender.reply_timeout = c.reply_timeout;
  pc.sender.event_timeout = c.event_timeout;
  pc.sender.control_link = c.control_link;
  pc.send_timeout = c.send_timeout;
  pc.raise_on_peer_failure = c.raise_on_peer_failure;
  pc.register_memory = !engine_allocated;
  if (c.curve.enabled()) {
    pc.sender.curve = control::CurveKeyPair{c.curve.public_key, c.curve.secret_key};
    pc.trusted_decode_keys = c.curve.trusted;
  }
  pc.insecure = c.insecure;
  return pc;
}

decode::WorkerConfig decode_config(const ConnectorConfig& c, const Parallel& parallel, int tp_rank,
                                   bool engine_allocated) {
  decode::WorkerConfig dc;
  dc.reader.d_rank = tp_rank;
  dc.reader.d_tp = parallel.tp_size;
  dc.reader.host = c.host;
  dc.reader.hold_timeout = c.hold_timeout;
  dc.reader.max_held = c.max_held;
  dc.reader.max_held_per_peer = c.max_held_per_peer;
  dc.reader.control_link = c.control_link;
  dc.reader.busy_poll = std::chrono::microseconds(c.busy_poll_us);
  if (c.curve.enabled()) {
    dc.reader.security =
        control::ServerSecurity{{c.curve.public_key, c.curve.secret_key}, c.curve.trusted};
  }
  dc.p_tp = c.prefill_tp_size;
  dc.kv_port = c.kv_port;
  dc.global_dp_rank = parallel.global_dp_rank;
  dc.register_memory = !engine_allocated;
  return dc;
}

metaserver::ClientConfig metaserver_config(const ConnectorConfig& c, std::string token) {
  metaserver::ClientConfig mc;
  mc.timeout = c.metaserver_timeout;
  mc.attempts = c.metaserver_attempts;
  mc.resubmit = c.metaserver_resubmit;
  mc.token = std::move(token);
  return mc;
}

}  // namespace rd2h::connector
