// Prefill's control plane to Decode (spec "Control Protocol"): one connection per Decode
// endpoint, owned by the sender thread; MF_META once per connection, then each readiness,
// whose answer settles its slot gate generation. The gates given must outlive the sender.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "control/channel.h"
#include "control/path.h"
#include "prefill/slot_gate.h"
#include "protocol/messages.h"
#include "rd2h/common/deadline.h"
#include "rd2h/common/status.h"
#include "rd2h/prefill/write_event.h"
#include "rd2h/transfer/transfer_engine.h"
#include "util/unique_fd.h"

namespace rd2h::prefill {

struct SenderConfig {
  std::chrono::milliseconds ack_timeout{10000};
  std::chrono::milliseconds reply_timeout{30000};
  // Bound on waiting for a layer's write event before publishing it.
  std::chrono::milliseconds event_timeout{30000};
  // This Prefill's CURVE keys: with them every connection is encrypted and reaches only the
  // Decode holding the server key its task names.
  std::optional<control::CurveKeyPair> curve;
  // Offer Decode a link on the transfer engine for readiness and answers (when the engine
  // has links; Decode may decline, and a Decode that does not know them ignores the offer).
  bool control_link = true;
};

struct SenderStats {
  uint64_t mf_meta_sent = 0;
  uint64_t readiness_sent = 0;
  uint64_t readiness_on_link = 0;  // of readiness_sent, those sent on a transfer link
  uint64_t answers = 0;
  uint64_t failures = 0;          // gate generations failed by the sender (timeouts, refusals)
  uint64_t connections_lost = 0;  // Decode connections that closed under us
  uint64_t commits = 0;           // KV_COMMIT sent: requests Decode read whole, released
  // Now: readiness the sender thread holds until their layer's write completes.
  uint64_t waiting_for_write = 0;
};

class Sender {
 public:
  // `meta` is what this Prefill publishes: its session, layers and transfer backend.
  // `engine` (optional) is the one `meta` describes: its links carry the control plane
  // where Decode takes them.
  static Expected<std::unique_ptr<Sender>> start(
      SenderConfig config, std::shared_ptr<control::Context> context, protocol::MfMeta meta,
      std::shared_ptr<transfer::TransferEngine> engine = nullptr);
  ~Sender();  // fails what is still pending, stops and joins its threads
  Sender(const Sender&) = delete;
  Sender& operator=(const Sender&) = delete;

  // Queues a layer's readiness (`payload`, for layer `layer_idx`) for the Decode endpoint at
  // `url` and returns: the sender thread sends it once `event` (if any) completed and the
  // connection is acknowledged. Its answer goes to every ticket's gate generation
  // (SlotGate::open counted this endpoint there); wait for it on the gates. Readiness go
  // out in the order they were given. Thread-safe; never touches the network.
  // With CURVE keys, `server_key` is the Decode's public key (Z85). `final_ids`: the
  // requests the readiness completes (its done_ext_ids), committed (KV_COMMIT) once Decode
  // answers READ_DONE, where Decode takes commits.
  // The readiness comes encoded (protocol::encode_readiness): a step's requests are
  // encoded once, not once per layer.
  void send(const std::string& url, int64_t layer_idx, std::vector<std::byte> payload,
            std::vector<GateTicket> tickets, std::shared_ptr<WriteEvent> event = nullptr,
            std::string server_key = {}, std::vector<std::string> final_ids = {});

  SenderStats stats() const;

 private:
  // What is known of a task's write event, shared with its notification or its waiter.
  struct Written {
    std::atomic<bool> done{false};
    Status status;  // of the waiter's wait (an event that cannot notify), set before done
  };
  struct Task {
    std::string url;
    int64_t layer_idx = 0;
    std::vector<std::byte> payload;  // the encoded readiness
    std::vector<GateTicket> tickets;
    std::shared_ptr<WriteEvent> event;
    std::string server_key;
    std::vector<std::string> final_ids;
    std::chrono::steady_clock::time_point event_deadline{};
    std::shared_ptr<Written> written;  // once notify() was asked
    bool notifies = false;             // the event calls back; else the waiter waits on it
  };
  // The sender thread's wake-up eventfd, for whatever outlives the sender (an event's
  // notification): -1 once the sender is gone.
  struct Waker {
    std::mutex mu;
    int fd = -1;
    void wake();
  };
  struct Pending {
    int64_t layer_idx;
    std::vector<GateTicket> tickets;
    std::chrono::steady_clock::time_point deadline;
    std::vector<std::string> final_ids;  // committed on READ_DONE (Endpoint::commits)
  };
  struct Endpoint {
    std::unique_ptr<control::DealerPath> zmq;  // null: no connection (the next opens one)
    bool acked = false;
    bool commits = false;  // Decode's ACK promised to complete requests on KV_COMMIT only
    std::chrono::steady_clock::time_point ack_deadline;
    // Both bounded by the slots: a layer's buffer is not written again, so no further task
    // is given for it, until its tasks are answered or failed.
    std::deque<Task> waiting;         // given before the ACK
    std::deque<Pending> pending;      // sent, in the order Decode answers
    // The transfer link offered in MF_META, if any (the ZeroMQ connection stays for
    // MF_META, its ACK, and to notice Decode going).
    std::unique_ptr<control::NotificationPath> link;
    bool on_link = false;  // readiness go on the link (from a point with nothing pending)
    // Where readiness and commits go, and answers come from.
    control::Path& path() { return on_link ? static_cast<control::Path&>(*link) : *zmq; }
  };
  class EventWaiter;

  Sender(SenderConfig config, std::shared_ptr<control::Context> context, protocol::MfMeta meta,
         std::shared_ptr<transfer::TransferEngine> engine, UniqueFd wake_fd);
  // The sender thread: the only one that touches the connections, the links and what
  // follows below the submissions.
  void run();
  // Takes what send() queued; false once the sender stops.
  bool take_submitted();
  // Sends what became ready, reads every answer that is in (after the sends, which can
  // consume a socket's notification), drops closed connections and enforces deadlines.
  void serve();
  // Sends the queued tasks whose layer's write completed, in order; stops at the first
  // whose write is still running (its notification, or the waiter, wakes the thread).
  void pump();
  // The outcome of the task's write, or nullopt while it is still being written (asking
  // its event to notify, or the waiter to wait on it, the first time).
  std::optional<Status> write_outcome(Task& t);
  void dispatch(Task task);
  void transmit(Endpoint& ep, Task task);
  void receive(const std::string& url, Endpoint& ep);
  // One answer to the oldest readiness pending on the connection; false when it failed the
  // connection (the caller stops reading it).
  bool answer(const std::string& url, Endpoint& ep, std::span<const std::byte> bytes);
  // Offers a new connection a link: MF_META with its token, or without one.
  std::vector<std::byte> offer_link(Endpoint& ep);
  void check_deadlines();
  // The earliest deadline the sender enforces, or `cap` if sooner.
  std::chrono::steady_clock::time_point next_deadline(
      std::chrono::steady_clock::time_point cap) const;
  // Drops an endpoint whose connection closed (Decode restarted or died): what it owed fails,
  // and the next readiness opens a new connection with MF_META. Returns whether it did.
  bool drop_if_lost(const std::string& url, Endpoint& ep);
  // Fails every gate waiting on the endpoint with `why` (its code says what kind of failure:
  // kPeerDead, kTimeout, ...) and drops its connection.
  void fail_endpoint(const std::string& url, Endpoint& ep, const Status& why);
  // Answers every ticket with `outcome`. Counted as an answer when Decode gave it, else as a
  // failure of the sender's own.
  void answer_tickets(const std::vector<GateTicket>& tickets, const Status& outcome,
                      bool from_decode = false);
  void count(uint64_t SenderStats::*field);
  void set_waiting_for_write();

  SenderConfig config_;
  std::shared_ptr<control::Context> context_;
  protocol::MfMeta meta_;
  std::vector<std::byte> mf_meta_;  // without a link
  control::Notifications links_;    // the sender thread's; outlives the endpoints' links
  UniqueFd wake_fd_;  // drained by the sender thread; closed after the waker let it go
  std::shared_ptr<Waker> waker_;

  // send() to the sender thread. Bounded by the slots, as the tasks are.
  std::mutex submit_mu_;
  std::deque<Task> submitted_;
  bool stopping_ = false;  // under submit_mu_

  // The sender thread's alone:
  std::map<std::string, Endpoint> endpoints_;
  std::deque<Task> queued_;  // waiting for their layer's write; bounded by the slots too
  std::unique_ptr<EventWaiter> waiter_;  // started for the first event that cannot notify

  mutable std::mutex stats_mu_;
  SenderStats stats_;

  std::thread thread_;
};

}  // namespace rd2h::prefill
