// Prefill's sender thread (spec "Layer transfer", "Control Protocol"): owns one DEALER per
// Decode endpoint, sends MF_META once per connection and waits for its ACK, then sends the
// queued readiness and routes each Decode answer to the slot gate generation it belongs to.
// Every wait is bounded: an endpoint that does not ACK, or does not answer a readiness in
// time, fails the gates waiting on it and is reconnected (with MF_META again) on next use.
// The gates passed to send() must outlive the sender.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "control/channel.h"
#include "prefill/slot_gate.h"
#include "protocol/messages.h"
#include "rd2h/common/status.h"
#include "rd2h/prefill/write_event.h"

namespace rd2h::prefill {

struct SenderConfig {
  std::chrono::milliseconds ack_timeout{10000};
  std::chrono::milliseconds reply_timeout{30000};
  // Bound on waiting for a layer's write event before publishing it.
  std::chrono::milliseconds event_timeout{30000};
  // This Prefill's CURVE keys: with them every connection is encrypted and reaches only the
  // Decode holding the server key its task names.
  std::optional<control::CurveKeyPair> curve;
};

struct SenderStats {
  uint64_t mf_meta_sent = 0;
  uint64_t readiness_sent = 0;
  uint64_t answers = 0;
  uint64_t failures = 0;          // gate generations failed by the sender (timeouts, refusals)
  uint64_t connections_lost = 0;  // Decode connections that closed under us
};

class Sender {
 public:
  // `meta` is what this Prefill publishes: its session, layers and transfer backend.
  static Expected<std::unique_ptr<Sender>> start(SenderConfig config,
                                                 std::shared_ptr<control::Context> context,
                                                 protocol::MfMeta meta);
  ~Sender();  // fails what is still pending, stops and joins the thread
  Sender(const Sender&) = delete;
  Sender& operator=(const Sender&) = delete;

  // Queues `ready` for the Decode endpoint at `url`, to be sent once `event` (if any)
  // completed; its answer goes to every ticket's gate generation (SlotGate::open counted
  // this endpoint there). Tasks are sent in the order they were queued.
  // With CURVE keys, `server_key` is the Decode's public key (Z85).
  void send(const std::string& url, const protocol::ReadReadyBatch& ready,
            std::vector<GateTicket> tickets, std::shared_ptr<WriteEvent> event = nullptr,
            std::string server_key = {});
  // The same with the readiness encoded already (protocol::encode_readiness): the hot path,
  // which encodes a step's requests once, not once per layer.
  void send(const std::string& url, int64_t layer_idx, std::vector<std::byte> payload,
            std::vector<GateTicket> tickets, std::shared_ptr<WriteEvent> event = nullptr,
            std::string server_key = {});

  SenderStats stats() const;

 private:
  struct Task {
    std::string url;
    int64_t layer_idx = 0;
    std::vector<std::byte> payload;  // the encoded readiness
    std::vector<GateTicket> tickets;
    std::shared_ptr<WriteEvent> event;
    std::string server_key;
    // Sender thread: the event's wait, once the task is taken.
    std::chrono::steady_clock::time_point event_deadline{};
    std::shared_ptr<std::atomic<bool>> written;  // set by the event's notification
    bool asked = false;                          // notify() was called
    bool notifies = false;                       // and the event will call back
  };
  // What an event's notification reaches: the wake-up fd, while the sender lives.
  struct Waker {
    std::mutex mu;
    int fd = -1;  // -1 once the sender is gone
    void wake();
  };
  struct Pending {
    int64_t layer_idx;
    std::vector<GateTicket> tickets;
    std::chrono::steady_clock::time_point deadline;
  };
  struct Endpoint {
    std::unique_ptr<control::DealerChannel> dealer;
    bool acked = false;
    std::chrono::steady_clock::time_point ack_deadline;
    std::deque<Task> waiting;     // queued until the ACK
    std::deque<Pending> pending;  // sent, in the order Decode answers
  };

  Sender(SenderConfig config, std::shared_ptr<control::Context> context, protocol::MfMeta meta,
         int wake_fd);
  void run();
  void take_tasks();
  // Sends the queued tasks whose layer's write completed, in order; the first whose write
  // is still running stops it (it wakes the thread when it completes).
  void pump();
  void dispatch(Task task);
  void transmit(Endpoint& ep, Task task);
  void receive(const std::string& url, Endpoint& ep);
  void check_deadlines();
  // Drops an endpoint whose connection closed (Decode restarted or died): what it owed fails,
  // and the next readiness opens a new connection with MF_META. Returns whether it did.
  bool drop_if_lost(const std::string& url, Endpoint& ep);
  // Fails every gate waiting on the endpoint and drops its connection.
  void fail_endpoint(const std::string& url, Endpoint& ep, const std::string& why);
  // Answers every ticket: ok, or failed with `why`. Counted as an answer when Decode gave
  // it, else as a failure of the sender's own.
  void settle(const std::vector<GateTicket>& tickets, bool ok, const std::string& why,
              bool from_decode = false);

  SenderConfig config_;
  std::shared_ptr<control::Context> context_;
  std::vector<std::byte> mf_meta_;
  int wake_fd_ = -1;
  std::shared_ptr<Waker> waker_;
  std::map<std::string, Endpoint> endpoints_;  // sender thread only
  std::deque<Task> queued_;                    // sender thread only: waiting for their write

  mutable std::mutex mu_;
  std::deque<Task> tasks_;
  SenderStats stats_;

  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace rd2h::prefill
