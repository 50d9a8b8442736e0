// TransferEngine: moves byte ranges from a peer's registered memory into local registered
// memory with one-sided reads, knowing nothing of layers, requests or KV. Implementations: UCX
// (create_ucx_engine) and a fault-injecting decorator for tests.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "rd2h/common/status.h"
#include "rd2h/transfer/read_op.h"

namespace rd2h::transfer {

inline constexpr int kTransferEngineInterfaceVersion = 4;

enum class Role { kPrefill, kDecode };
std::string_view to_string(Role role);
Expected<Role> parse_role(std::string_view text);  // "prefill" | "decode"

// Which medium the engine may use. kAuto lets the backend choose (UCX: RDMA where present,
// shared memory for co-located peers, TCP otherwise); UCX_* environment variables apply.
enum class Transport { kShm, kTcp, kAuto };
std::string_view to_string(Transport transport);
Expected<Transport> parse_transport(std::string_view text);  // "shm" | "tcp" | "auto"

// How reads that cannot be served from a mapped region travel. kAuto: one-sided RMA where
// the transport is RDMA hardware, active messages answered by the peer elsewhere.
enum class ReadPath { kAuto, kRma, kActiveMessage };
std::string_view to_string(ReadPath path);
Expected<ReadPath> parse_read_path(std::string_view text);  // "auto" | "rma" | "am"

struct EngineConfig {
  Role role = Role::kPrefill;
  int device_id = 0;
  std::string hostname;  // advertised host; empty means this machine's hostname
  Transport transport = Transport::kAuto;
  // Bound on one batch_read_sync; a dead or silent peer turns into an error by then.
  std::chrono::milliseconds read_timeout{5000};
  // Bound on connect(), including the first exchange with the peer.
  std::chrono::milliseconds connect_timeout{5000};
  ReadPath read_path = ReadPath::kAuto;
  // Network transports listen only on the interface that holds this address (UCX's
  // NET_DEVICES, unless UCX_NET_DEVICES is set). Empty: every interface.
  std::string listen_host;
  // Prefill, not over TCP only: caller memory given to register_memory moves, in place,
  // into shared memory that co-located readers map, so their reads need nothing of this
  // process (same addresses and bytes; the range must not be written while it registers,
  // and a child forked afterwards shares its pages). false: such reads are answered by
  // this process.
  bool share_registered = true;
};

struct MemoryRegion {
  void* addr = nullptr;
  size_t length = 0;
};

// What an engine keeps of one connected peer (each engine derives its own).
class PeerSession {
 public:
  virtual ~PeerSession() = default;
};

// A session with one peer, as connect() returns it: reads and channels through it reach the
// peer without a lookup. Copies share the session; it stays valid while held (a session
// disconnected or rebuilt meanwhile reads as broken).
struct SessionHandle {
  std::string id;  // the peer's session id (the spec's p_session)
  std::shared_ptr<PeerSession> state;
  explicit operator bool() const { return state != nullptr; }
};

// Reads posted with post_reads(), in flight until done; destroyed before its engine. Local
// memory they read into is not unregistered while they are in flight. Destroyed before it
// is done, it cancels them: their session breaks.
class ReadRequest {
 public:
  virtual ~ReadRequest() = default;
  // Progresses the reads without blocking: nullopt while some are in flight, else their
  // outcome (the same at every later call).
  virtual std::optional<Status> test() = 0;
  // Returns the outcome once they are done, or a timeout error (and a broken session) when
  // the engine's read_timeout from the post ran out first.
  virtual Status wait() = 0;
};

struct SessionInfo {
  std::string session_id;  // the peer's session id, as connect() returned it
  // Transports the backend really uses for reads, e.g. "sysv+mapped" (shared memory,
  // mapped into this process), "tcp", "rc_mlx5".
  std::string transport;
  bool colocated = false;  // the peer runs on this host
  bool broken = false;     // a failure was seen; reads fail until connect() again
  std::string broken_reason;
};

// Notifications (optional, see supports_notifications()): short messages between the two ends
// of a session on the data plane's own connection, for a control plane that would otherwise
// take a round trip through another stack. A channel joins the two ends: the serving side
// picks its number, listens on it and hands the number to the connecting side over its own
// control channel (the number is the capability); the connecting side opens the channel on
// its session to the serving side. Then either side sends on it; messages arrive in the order
// they were sent.
struct Notification {
  enum class Kind {
    kOpened,   // serving side: the peer opened the channel (before any of its messages)
    kMessage,  // a message (in `message`)
    kClosed,   // the channel can carry no more: its session broke or went, the peer failed,
               // or its messages overflowed the engine's queue. Once per channel.
  };
  uint64_t channel = 0;
  Kind kind = Kind::kMessage;
  std::vector<std::byte> message;
};
inline constexpr size_t kMaxNotificationBytes = 64u << 20;  // longer messages are dropped
// What an engine keeps for its consumer between two calls. A message that would go past
// either bound closes the channel that holds the most (its peer sends faster than the
// consumer takes), dropping what it held.
inline constexpr size_t kMaxQueuedNotifications = 1u << 16;
inline constexpr size_t kMaxQueuedNotificationBytes = size_t{256} << 20;

class TransferEngine {
 public:
  virtual ~TransferEngine() = default;

  virtual std::string_view backend_name() const = 0;
  virtual const EngineConfig& config() const = 0;
  // This engine's session id: what a peer's connect() returns for it (the spec's p_session).
  virtual const std::string& session_id() const = 0;

  // Registers caller-owned memory for reads by peers and as a read destination.
  // Zero-length and overlapping ranges are errors.
  virtual Status register_memory(void* addr, size_t length) = 0;
  // Allocates registered memory owned by the engine (freed by unregister_memory or the
  // engine's destruction). Shared-memory peers read it without this process's help.
  virtual Expected<MemoryRegion> allocate_memory(size_t length) = 0;
  // Unregisters a range by its start address; frees it when the engine allocated it.
  virtual Status unregister_memory(void* addr) = 0;

  // Opaque bytes a peer passes to connect(): how to reach this engine and every region
  // registered at the time of the call.
  virtual Expected<std::vector<std::byte>> export_metadata() const = 0;
  // Connects to the peer that exported `peer_metadata`. Connecting to a live session again
  // returns it unchanged; a broken session is rebuilt (a handle of the old one stays broken).
  virtual Expected<SessionHandle> connect(std::span<const std::byte> peer_metadata) = 0;
  virtual Status disconnect(const SessionHandle& session) = 0;
  virtual Expected<SessionInfo> session_info(const SessionHandle& session) const = 0;

  // Posts every read of `ops` from the session's peer and returns them in flight. Every
  // range is checked before any read is posted: a batch with a remote range outside the
  // peer's exported regions or a local range outside local registrations reads nothing and
  // is an error. A session carries one request at a time: posting while another is in
  // flight on it first waits for that one. A transport failure, a dead peer or a timeout
  // marks the session broken.
  virtual Expected<std::unique_ptr<ReadRequest>> post_reads(const SessionHandle& session,
                                                            std::span<const ReadOp> ops) = 0;
  // post_reads(), then wait().
  Status batch_read_sync(const SessionHandle& session, std::span<const ReadOp> ops);

  // Notifications (see Notification). A backend without them returns false and refuses
  // the calls.
  virtual bool supports_notifications() const { return false; }
  // Serving side: a peer may open `channel`.
  virtual Status listen_notifications(uint64_t channel);
  // Connecting side: opens `channel` to the peer of `session`, which listens on it.
  virtual Status open_notifications(const SessionHandle& session, uint64_t channel);
  // Sends one message (at most kMaxNotificationBytes) on an open channel, in order with the
  // channel's earlier ones; the engine may still hold it when this returns. An error means
  // the channel can carry no more; a failure found later closes it (kClosed).
  virtual Status send_notification(uint64_t channel, std::span<const std::byte> message);
  // Forgets the channel: nothing more is delivered for it, a message in flight may be lost.
  virtual void close_notifications(uint64_t channel);
  // The progress rule. An engine's notifications have one consumer, the thread that calls
  // get_notifications(): that call progresses, on the calling thread, every connection that
  // carries channels, and appends what arrived to `out` (in order per channel). Nothing
  // else delivers notifications and no engine thread works for a consumer that does not
  // call; what arrives meanwhile waits in the engine (up to kMaxQueuedNotifications). The
  // call never blocks. It returns false when more may be in already: call again before
  // sleeping. After a call that returned true with `arm`, notification_fd() becomes
  // readable when more may have come; with `arm` false the consumer polls instead of
  // sleeping (the fd is not armed), so a peer sending meanwhile does not pay for waking it.
  virtual bool get_notifications(std::vector<Notification>& out, bool arm = true);
  // A descriptor to poll(2) among the consumer's own; -1 without notifications.
  virtual int notification_fd() { return -1; }
  // get_notifications() until something came or `timeout` passed, sleeping on
  // notification_fd() between calls that allow it. Returns how many it appended.
  size_t wait_notifications(std::vector<Notification>& out, std::chrono::milliseconds timeout);
};

Expected<std::unique_ptr<TransferEngine>> create_ucx_engine(const EngineConfig& config);

// The process-wide engine. The first call creates it; a later call with the same role,
// device id, hostname and transport returns the same engine; a call that differs in any of
// them is an error naming the value that differs.
Expected<std::shared_ptr<TransferEngine>> bind_process_engine(const EngineConfig& config);
// Drops the process-wide binding; the engine is destroyed once no caller holds it.
void unbind_process_engine();

}  // namespace rd2h::transfer
