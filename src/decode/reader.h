// The reader of one Decode TP rank (spec "Layer transfer", "Control Protocol"): owns the
// rank's ROUTER, keeps each Prefill connection's MF_META (acknowledging it), and answers
// every READ_READY_BATCH with exactly one READ_DONE or READ_FAILED after validating the
// layout, building the descriptors of every ready request, and doing one batched read.
// Final-layer signals feed the rank's CompletionTracker. One thread, joined on destruction.
//
// An rd2h Prefill (its MF_META states a protocol version) commits every request Decode read
// whole (KV_COMMIT, after the READ_DONE of the readiness that completed it): from such a
// Prefill a request completes on its commit, not on its final readiness, so a Decode that
// stalled mid-read past Prefill's deadline never completes a request from bytes Prefill
// overwrote meanwhile (Prefill drops the connection before reusing, and commits nothing on
// it). The existing Python Prefill commits nothing; its requests complete as they did.
//
// A Prefill whose MF_META offers a link (Sender, "control_link") gets it opened on the
// transfer session right after connecting: its readiness may then come on the link, and
// each is answered on the path it came on. A link that closes drops its connection like a
// malformed message does, so its Prefill reconnects with MF_META.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "control/channel.h"
#include "control/path.h"
#include "decode/completion_tracker.h"
#include "layout/layout.h"
#include "protocol/messages.h"
#include "rd2h/common/status.h"
#include "rd2h/transfer/transfer_engine.h"
#include "util/log.h"
#include "util/metrics.h"
#include "util/unique_fd.h"

namespace rd2h::decode {

// Decode's own cache: main layer name -> its tensors (with num_blocks) on this rank.
using DecodeLayout = std::map<std::string, layout::LayerTensors>;

struct ReaderConfig {
  int d_rank = 0;
  int d_tp = 1;
  std::string host = "127.0.0.1";
  int port = 0;  // the rank port; 0 picks a free one (tests)
  std::chrono::milliseconds poll_interval{20};
  // A readiness naming a request whose destinations Decode has not registered yet is held
  // (with the connection's later messages, to keep replies in order) until they are, for
  // at most hold_timeout, and at most max_held messages in all, max_held_per_peer of one
  // connection (so that one Prefill cannot take every place).
  std::chrono::milliseconds hold_timeout{5000};
  size_t max_held = 1024;
  // With keys, only Prefill clients whose CURVE key is trusted get through.
  std::optional<control::ServerSecurity> security;
  size_t max_held_per_peer = 256;
  // Open the links Prefill offers (when the engine has them).
  bool control_link = true;
  // While a request read on a link waits for its later layers, the reader polls its links
  // for up to this long after each message instead of sleeping, so the Prefill sending the
  // next layer does not pay for waking this process. Zero: it always sleeps.
  std::chrono::microseconds busy_poll{0};
};

struct ReaderStats {
  uint64_t layers_done = 0;
  uint64_t layers_failed = 0;
  uint64_t messages_rejected = 0;
  uint64_t readiness_held = 0;  // ever held for destinations
  size_t held_now = 0;
  size_t connections = 0;   // Prefill connections whose MF_META this rank keeps
  uint64_t reads = 0;       // batched engine reads done
  uint64_t bytes_read = 0;  // by reads that succeeded
  uint64_t read_ns = 0;     // time spent inside the engine's batched reads
  uint64_t links_opened = 0;
  uint64_t readiness_on_link = 0;  // readiness that came on a link
  uint64_t readiness_polled = 0;   // of those, while the reader polled (ReaderConfig::busy_poll)
};

class Reader {
 public:
  static Expected<std::unique_ptr<Reader>> start(ReaderConfig config,
                                                 std::shared_ptr<transfer::TransferEngine> engine,
                                                 DecodeLayout layout,
                                                 std::shared_ptr<control::Context> context);
  ~Reader();
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  const std::string& url() const { return router_->url(); }

  // Decode expects `ext_id`; its blocks land in these destination lists. If its KV is not
  // all in by `arrival_deadline`, the get_finished after it reports the request failed.
  Status add_request(const std::string& ext_id, const std::string& internal_id,
                     std::vector<int64_t> main_blocks, std::vector<int64_t> indexer_blocks,
                     std::chrono::steady_clock::time_point arrival_deadline =
                         std::chrono::steady_clock::time_point::max());
  // Decode gave the request up. It is reported finished by the next get_finished that runs
  // after any read into its blocks returned (vLLM keeps an aborted request's blocks until
  // then); an id this rank no longer tracks is left alone.
  void remove_request(const std::string& ext_id);
  // Requests every Decode rank finished (or failed, with their destination blocks): their
  // state on this rank ends here.
  Expected<Finished> get_finished(const AllGather& all_gather);
  ReaderStats stats() const;
  // The latency of each batched read so far.
  metrics::Histogram::Snapshot read_latency() const { return read_seconds_.snapshot(); }
  // Requests this rank holds state for (known, or signalled before they were known).
  size_t tracked_requests() const;

 private:
  // One layer of a Prefill connection, checked against Decode's once, at MF_META.
  struct PeerLayer {
    layout::LayerTensors tensors;
    const layout::LayerTensors* decode = nullptr;  // Decode's tensors of the same layer
    Status layout;  // the layouts' verdict: a layer that does not match fails when read
  };
  struct Peer {
    transfer::SessionHandle session;
    std::map<std::string, PeerLayer, std::less<>> layers;
    bool commits = false;  // an rd2h Prefill: its requests complete on KV_COMMIT
    // Requests whose final readiness was read and answered, waiting for the commit: the
    // contributor signal (group_member_idx, tp_ratio) each then counts.
    std::map<std::string, std::pair<int, int>> uncommitted;
  };
  // The paths back to one connection of the router: ZeroMQ, and the transfer link once
  // it is open. Kept from the connection's first message until it closes.
  struct ConnectionPaths {
    ConnectionPaths(control::RouterChannel& router, const std::string& identity)
        : zmq(router, identity) {}
    control::RouterPath zmq;
    std::unique_ptr<control::NotificationPath> link;
    bool answer_on_link = false;  // the connection's last message came on the link
  };
  // A Prefill whose MF_META was accepted and whose session (and link) the connect thread is
  // opening: what the connection sends meanwhile waits, in order, for the answer.
  struct Connecting {
    uint64_t job = 0;  // the connect job it waits for (a later MF_META starts another)
    Peer peer;
    std::string p_session;
    std::unique_ptr<control::NotificationPath> link;  // the link being opened, if any
    std::deque<control::Inbound> waiting;             // at most max_held_per_peer
  };
  // What the connect thread does and says: connect to a Prefill, open its link.
  struct ConnectJob {
    uint64_t job = 0;
    std::string identity;
    std::vector<std::byte> backend_metadata;
    std::optional<uint64_t> link;  // the link token to open, if any
  };
  struct Connected {
    uint64_t job = 0;
    std::string identity;
    Expected<transfer::SessionHandle> session = internal_error("not connected");
    std::optional<uint64_t> link;  // the link opened, if any
    Status link_status;            // why it was not, if one was asked for
  };
  struct ConnectQueue {
    std::mutex mu;
    std::condition_variable cv;
    // Bounded: a job per connection that sent MF_META, each answered in connect_timeout.
    std::deque<ConnectJob> jobs;
    std::deque<Connected> done;  // taken by the reader thread, woken through `fd`
    bool stopping = false;
    UniqueFd fd;
  };

  Reader(ReaderConfig config, std::shared_ptr<transfer::TransferEngine> engine, DecodeLayout layout,
         std::unique_ptr<control::RouterChannel> router);
  void run();
  // `polled`, for a message that came on a link: whether the reader was polling the links
  // for it (counted in the stats if it is a readiness; cleared once nothing is owed).
  void handle(const control::Inbound& in, bool* polled = nullptr);
  // A message that could not be decoded: a readiness is answered READ_FAILED in its turn,
  // an MF_META refused, anything else drops the connection.
  void handle_undecodable(const control::Inbound& in, const std::string& why);
  // A readiness: held (behind held ones, or until its requests are known) or read now.
  void take_readiness(const std::string& identity, protocol::ReadReadyBatch ready);
  // Handles what came on the links as if it came on their connections (`polled`: while the
  // reader polled them, unarmed), and drops the connections whose link closed; true when
  // there was a message.
  bool drain_links(bool polled);
  // The connect thread: sessions and links opened off the reader thread, so one slow new
  // Prefill does not stall the others.
  void connect_loop();
  // Ends the wait of the connections whose session is open (or failed): ACK or refusal,
  // then what they sent meanwhile.
  void finish_connects();
  void close_link(const std::string& identity);
  // Answers held readiness whose destinations arrived or whose hold expired, in order.
  void drain_held();
  bool destinations_known(const protocol::ReadReadyBatch& ready) const;  // caller holds mu_
  void handle_mf_meta(const std::string& identity, const protocol::MfMeta& meta);
  void refuse_mf_meta(const std::string& identity, const std::string& why);
  // A line of what a peer can provoke at will: at most one per `limit`'s interval.
  void warn_limited(log::RateLimit& limit, const char* what, const std::string& why);
  // Forgets a connection that sent what cannot be answered: fails what it has held, drops
  // its MF_META and tells it (answering `last`, if given, as the final READ_FAILED), so that
  // its Prefill fails at once rather than at a deadline.
  void drop_peer(const std::string& identity, const std::string& why,
                 const protocol::ReadReadyBatch* last = nullptr);
  // A readiness whose turn came: its layer read (or its read posted, answered once done).
  void handle_ready(const std::string& identity, const protocol::ReadReadyBatch& ready);
  // The answer to a readiness whose read ended with `st`, and what it means for its
  // requests.
  void answer_ready(const std::string& identity, const protocol::ReadReadyBatch& ready,
                    const Status& st);
  // Prefill committed requests of this connection: their final-layer signals count now.
  void handle_commit(const std::string& identity, const protocol::KvCommit& commit);
  // The connection is gone: what it still owed fails. Caller holds mu_.
  void fail_owed(const std::string& identity);
  // Starts reading the layer: its outcome when it is known at once (nothing to read here,
  // reads refused, or reads done as they were posted; an error explains why it was not
  // read), or nullopt with the read in flight (in_flight_).
  std::optional<Status> start_read(const std::string& identity,
                                   const protocol::ReadReadyBatch& ready);
  // The layer's reads on this rank, into reads_ (none: nothing to read here), begun in the
  // tracker as planned_read_ when there are some.
  Status plan_read(const PeerLayer& layer, const protocol::ReadReadyBatch& ready);
  // Posts what plan_read() planned, in one batch, as start_read() says.
  std::optional<Status> post_planned(const std::string& identity,
                                     const transfer::SessionHandle& session,
                                     const protocol::ReadReadyBatch& ready);
  // Answers the reads in flight that are done, then what their connections sent meanwhile.
  void progress_reads();
  // Ends the read in flight of `identity` (waiting for it if need be) and answers it; with
  // `replay`, handles what its connection sent meanwhile, else drops that.
  void complete_read(const std::string& identity, bool replay);
  // Answers on the path the connection's message being handled came on.
  void reply(const std::string& identity, const std::vector<std::byte>& payload);
  ConnectionPaths& paths_of(const std::string& identity);
  // Whether the connection's message being handled came on its link; and setting that, for
  // a message handled after others came (its answer goes back on the path it came on).
  bool came_on_link(const std::string& identity) const;
  void answer_on(const std::string& identity, bool on_link);

  ReaderConfig config_;
  std::shared_ptr<transfer::TransferEngine> engine_;
  DecodeLayout layout_;
  std::unique_ptr<control::RouterChannel> router_;
  control::Notifications links_;       // reader thread only; outlives the links below
  std::map<std::string, Peer> peers_;  // by ZMQ identity; reader thread only
  // By ZMQ identity; reader thread only. Bounded by the router's connections.
  std::map<std::string, ConnectionPaths> paths_;
  std::vector<transfer::ReadOp> reads_;        // plan_read's, reused (reader thread only)
  uint64_t planned_read_ = 0;
  // A layer's read in flight on one connection: that connection's later messages wait
  // behind it, in order, so its answers keep theirs. Reads of different connections (the
  // contributors of a request, other Prefills) overlap.
  struct InFlight {
    protocol::ReadReadyBatch ready;
    std::unique_ptr<transfer::ReadRequest> request;
    std::optional<Status> outcome;  // once done
    uint64_t read = 0;              // its number in the tracker
    uint64_t bytes = 0;
    std::chrono::steady_clock::time_point start;
    int64_t start_us = 0;
    bool on_link = false;  // the readiness came on the link: answered there
    // With the path each came on; at most max_held_per_peer.
    std::deque<std::pair<control::Inbound, bool>> behind;
  };
  std::map<std::string, InFlight> in_flight_;  // by ZMQ identity; reader thread only
  // Accounts for a read that ended with `st`: the tracker, counters, latency and trace.
  Status end_read(const InFlight& f, Status st);
  struct Held {
    protocol::ReadReadyBatch ready;
    std::chrono::steady_clock::time_point since;
    std::string refusal;  // set: a readiness that could not be decoded, answered READ_FAILED
    bool on_link = false;  // it came on the link: answered there
  };
  std::map<std::string, std::deque<Held>> held_;  // by ZMQ identity; reader thread only
  size_t held_count_ = 0;
  log::RateLimit unknown_log_;  // messages ignored as unknown
  log::RateLimit refused_log_;  // MF_META refused (a Prefill of another model, say)

  mutable std::mutex mu_;  // guards what the worker's thread shares with the reader
  CompletionTracker tracker_;  // every request's state on this rank
  // The reader's counters: written by the reader thread, read by stats() from any thread,
  // each on its own (no lock).
  struct Counters {
    std::atomic<uint64_t> layers_done{0}, layers_failed{0}, messages_rejected{0}, readiness_held{0},
        reads{0}, bytes_read{0}, read_ns{0}, links_opened{0}, readiness_on_link{0},
        readiness_polled{0};
    std::atomic<size_t> held_now{0}, connections{0};
  };
  Counters counters_;
  void count(std::atomic<uint64_t> Counters::*counter, uint64_t n = 1) {
    (counters_.*counter).fetch_add(n, std::memory_order_relaxed);
  }
  void set_held_now() { counters_.held_now.store(held_count_, std::memory_order_relaxed); }
  void set_connections() { counters_.connections.store(peers_.size(), std::memory_order_relaxed); }
  metrics::Histogram read_seconds_{metrics::transfer_buckets()};

  std::map<std::string, Connecting> connecting_;  // by ZMQ identity; reader thread only
  uint64_t next_job_ = 0;                         // reader thread only
  std::shared_ptr<ConnectQueue> connects_;
  std::thread connect_thread_;

  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace rd2h::decode
