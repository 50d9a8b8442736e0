// Prefill's sender, per Decode connection: MF_META and its ACK, the link it offers, readiness
// sent, answers read and given to their gates, and connections dropped when lost or late.
#include "prefill/sender.h"
#include "rd2h/common/trace.h"

namespace rd2h::prefill {

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

void Sender::dispatch(Task task) {
  Endpoint& ep = endpoints_[task.url];
  // Never send on a connection the peer no longer knows; what it answered before it went
  // counts (answers nobody waited for may still be in the socket).
  if (ep.zmq) receive(task.url, ep);
  drop_if_lost(task.url, ep);
  if (!ep.zmq) {
    // A new connection, or one rebuilt after a failure: it starts with MF_META, since the
    // Decode side keys its metadata by connection.
    std::optional<control::ClientSecurity> security;
    if (config_.curve) security = control::ClientSecurity{*config_.curve, task.server_key};
    auto zmq = control::DealerPath::connect(context_, task.url, security);
    if (!zmq) return answer_tickets(task.tickets, zmq.status());
    ep.zmq = std::move(*zmq);
    ep.acked = false;
    ep.ack_deadline = Clock::now() + config_.ack_timeout;
    if (Status st = ep.zmq->send(offer_link(ep)); !st) {
      const std::string url = task.url;
      ep.waiting.push_back(std::move(task));
      return fail_endpoint(url, ep, st);
    }
    count(&SenderStats::mf_meta_sent);
  }
  if (!ep.acked) {
    ep.waiting.push_back(std::move(task));
    return;
  }
  transmit(ep, std::move(task));
}

std::vector<std::byte> Sender::offer_link(Endpoint& ep) {
  if (!links_.available()) return mf_meta_;
  auto link = links_.listen();
  if (!link) return mf_meta_;  // this connection stays on ZeroMQ: slower, not wrong
  ep.link = std::move(*link);
  ep.on_link = false;
  protocol::MfMeta offer = meta_;
  offer.control_link = ep.link->channel();
  return protocol::encode(offer);
}

void Sender::transmit(Endpoint& ep, Task task) {
  if (ep.link && !ep.on_link && ep.pending.empty()) {
    // Nothing is owed on ZeroMQ any more: answers cannot overtake each other from here.
    ep.on_link = ep.link->opened() && !ep.link->lost();
  }
  Status st = ep.path().send(task.payload);
  if (!st) return answer_tickets(task.tickets, st);
  ep.pending.push_back({task.layer_idx, std::move(task.tickets),
                        Clock::now() + config_.reply_timeout, std::move(task.final_ids)});
  trace::instant("readiness", "sender", task.layer_idx);
  count(&SenderStats::readiness_sent);
  if (ep.on_link) count(&SenderStats::readiness_on_link);
}

void Sender::receive(const std::string& url, Endpoint& ep) {
  // Answers on the link first: once a connection moved there, ZeroMQ carries no answer.
  while (ep.on_link) {
    auto bytes = ep.link->try_receive();
    if (!bytes || !bytes->has_value()) break;
    if (!answer(url, ep, **bytes)) return;
  }
  // A connection whose first connect failed reaches, at best, a Decode that came up later
  // on the same port and does not know what was said to its predecessor: its ACK must not
  // release the readiness that waited for it.
  if (!ep.acked && drop_if_lost(url, ep)) return;
  for (;;) {
    auto payload = ep.zmq->try_receive();
    if (!payload || !payload->has_value()) return;
    const auto& bytes = **payload;
    if (!ep.acked) {
      if (protocol::is_ack(bytes)) {
        ep.acked = true;
        ep.commits = protocol::is_commit_ack(bytes);
        trace::instant("mf_meta ack", "sender");
        std::deque<Task> waiting;
        waiting.swap(ep.waiting);
        for (auto& t : waiting) transmit(ep, std::move(t));
        continue;
      }
      auto refusal = protocol::decode_message(bytes);
      const std::string why = refusal && std::holds_alternative<protocol::ReadFailed>(*refusal)
                                  ? std::get<protocol::ReadFailed>(*refusal).error
                                  : "Decode answered MF_META with something other than ACK";
      return fail_endpoint(url, ep, failed_precondition(why));
    }
    if (ep.on_link) {
      // Decode speaks on ZeroMQ to a connection that moved to the link only when its end
      // of the link is gone (its session broke); what it says may overtake answers still
      // on the link, so it answers nothing: the connection starts again.
      auto told = protocol::decode_message(bytes);
      const auto* failed = told ? std::get_if<protocol::ReadFailed>(&*told) : nullptr;
      count(&SenderStats::connections_lost);
      return fail_endpoint(url, ep,
                           peer_dead("Decode " + url + " left the transfer link" +
                                     (failed != nullptr ? ": " + failed->error : std::string())));
    }
    if (!answer(url, ep, bytes)) return;
  }
}

bool Sender::answer(const std::string& url, Endpoint& ep, std::span<const std::byte> bytes) {
  auto message = protocol::decode_message(bytes);
  if (ep.pending.empty()) return true;  // nothing waits for it: a late answer
  Pending p = std::move(ep.pending.front());
  ep.pending.pop_front();
  bool ok = false;
  std::string reason;
  // A READ_FAILED is Decode's read failing (kTransport); anything else it says here, a
  // Decode that does not keep to the protocol.
  StatusCode code = StatusCode::kFailedPrecondition;
  int64_t layer = -1;
  if (!message) {
    reason = "undecodable answer from " + url + ": " + message.status().message();
  } else if (auto* done = std::get_if<protocol::ReadDone>(&*message)) {
    ok = true;
    layer = done->layer_idx;
  } else if (auto* failed = std::get_if<protocol::ReadFailed>(&*message)) {
    reason = failed->error.empty() ? "read failed" : failed->error;
    code = StatusCode::kTransport;
    layer = failed->layer_idx;
  } else {
    reason = "unexpected message from " + url;
  }
  if (message && layer != p.layer_idx) {
    // Answers come in request order; one out of order means the connection lost track.
    ep.pending.push_front(std::move(p));
    fail_endpoint(url, ep,
                  failed_precondition("answer for layer " + std::to_string(layer) +
                                      " while layer " +
                                      std::to_string(ep.pending.front().layer_idx) +
                                      " was expected from " + url));
    return false;
  }
  trace::instant(ok ? "answer" : "read failed", "sender", p.layer_idx);
  if (ok && ep.commits && !p.final_ids.empty()) {
    // Decode read these requests whole and no slot of theirs was reused before it answered
    // (this connection was never given up): they may complete. On the path the answer took.
    const auto commit = protocol::encode(protocol::KvCommit{p.layer_idx, std::move(p.final_ids)});
    Status st = ep.path().send(commit);
    if (!st) {
      // Uncommitted, Decode fails those requests; this connection is not to be trusted.
      answer_tickets(p.tickets, Status::ok(), /*from_decode=*/true);
      fail_endpoint(url, ep, Status(st.code(), "cannot commit to " + url + ": " + st.message()));
      return false;
    }
    count(&SenderStats::commits);
  }
  answer_tickets(p.tickets, ok ? Status::ok() : Status(code, reason), /*from_decode=*/true);
  return true;
}

bool Sender::drop_if_lost(const std::string& url, Endpoint& ep) {
  if (!ep.zmq) return false;
  if (ep.link && ep.link->lost()) {
    if (!ep.on_link) {
      ep.link.reset();  // never used: the connection stays on ZeroMQ (slower, not wrong)
    } else {
      count(&SenderStats::connections_lost);
      fail_endpoint(url, ep,
                    peer_dead("the transfer link to " + url + " closed (Decode restarted or died)"));
      return true;
    }
  }
  std::optional<Status> lost = ep.zmq->lost();
  if (!lost) return false;
  count(&SenderStats::connections_lost);
  fail_endpoint(url, ep, *lost);
  return true;
}

void Sender::check_deadlines() {
  const auto now = Clock::now();
  for (auto& [url, ep] : endpoints_) {
    if (!ep.zmq) continue;
    if (!ep.acked && now >= ep.ack_deadline) {
      fail_endpoint(url, ep,
                    timeout_error("no ACK for MF_META from " + url + " within " +
                                  std::to_string(config_.ack_timeout.count()) + " ms"));
    } else if (!ep.pending.empty() && now >= ep.pending.front().deadline) {
      fail_endpoint(url, ep,
                    timeout_error("no answer from " + url + " for layer " +
                                  std::to_string(ep.pending.front().layer_idx) + " within " +
                                  std::to_string(config_.reply_timeout.count()) + " ms"));
    }
  }
}

void Sender::fail_endpoint(const std::string& /*url*/, Endpoint& ep, const Status& why) {
  for (auto& p : ep.pending) answer_tickets(p.tickets, why);
  for (auto& t : ep.waiting) answer_tickets(t.tickets, why);
  ep.pending.clear();
  ep.waiting.clear();
  ep.zmq.reset();  // the next readiness reconnects and sends MF_META again
  ep.acked = false;
  ep.commits = false;
  ep.link.reset();
  ep.on_link = false;
}

}  // namespace rd2h::prefill
