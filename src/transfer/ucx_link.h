// Links of the UCX engine: control messages on the data plane's own connection, as eager active
// messages. A token, handed over the authenticated control channel, is the capability: a message
// naming one not expected, or longer than kMaxNotificationBytes, is dropped.
#pragma once

#include <ucp/api/ucp.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "rd2h/common/status.h"
#include "rd2h/transfer/transfer_engine.h"
#include "transfer/ucx_handles.h"

namespace rd2h::transfer {

// The engine's own view of a channel (a link): its events go to a handler, which runs on
// whichever thread progresses the link's worker, with that worker's locks held: it may copy
// the message and wake a waiter, and must not call the engine. kClosed comes once.
using LinkHandler =
    std::function<void(Notification::Kind event, std::span<const std::byte> message)>;

inline constexpr uint16_t kAmLinkOpen = 0x7266;     // connecting -> serving side
inline constexpr uint16_t kAmLinkMessage = 0x7267;  // either way
inline constexpr size_t kMaxLinkAddressBytes = 64u << 10;

struct LinkOpenHeader {
  uint64_t token;
  uint32_t network;  // non-zero: the session uses peer error handling (not shared memory)
  uint32_t reserved;
};
struct LinkMessageHeader {
  uint64_t token;
};

// Installs `cb` (with `arg`) as the worker's handler of active messages `id`; the error
// names the id.
Status set_am_handler(ucp_worker_h worker, uint16_t id, ucp_am_recv_callback_t cb, void* arg);

// Whether an active message carries a link message this side may take: eager, and within
// the bound. Rendezvous data that is not received is dropped by UCX.
bool acceptable_link_message(size_t length, const ucp_am_recv_param_t* param);

// The serving side's links, on the engine's serving worker. Everything here runs with `mu`
// held, and the engine's progress thread holds it while it progresses that worker, so the
// handlers see the same state as the callers.
class ServedLinks {
 public:
  explicit ServedLinks(ucp_worker_h worker) : worker_(worker) {}
  ServedLinks(const ServedLinks&) = delete;
  ServedLinks& operator=(const ServedLinks&) = delete;

  std::mutex mu;

  // Installs the handlers of kAmLinkOpen and kAmLinkMessage on the worker.
  Status install();
  bool has(uint64_t token);
  Status expect(uint64_t token, LinkHandler handler);
  // Sends at once, or, while whoever progresses the worker holds mu, queues the message
  // for it (a failure then reaches the handler as kClosed). The caller bounded its length.
  Status send(uint64_t token, std::span<const std::byte> message);
  void close(uint64_t token);
  // Once the worker's progress stopped, before the worker is destroyed (which cancels what
  // is still in flight; this object goes after it, its endpoints closed already).
  void close_all();
  // After each progress of the worker (mu held): connects the links opened meanwhile (an
  // endpoint is not created inside a handler) and frees sends that completed.
  void after_progress();

 private:
  // What a link endpoint's error handler gets: where to report.
  struct EndpointOwner {
    ServedLinks* links;
    uint64_t token;
  };
  struct Link {
    LinkHandler handler;
    bool opening = false;  // an open is waiting for after_progress
    bool closed = false;   // kClosed was delivered
    bool network = false;  // the endpoint has peer error handling
    std::unique_ptr<EndpointOwner> owner;
    // Closed (forced when `network`) without progressing the worker, whose handlers would
    // run inside the close: UCX finishes it. Declared after `owner`, so it goes first.
    UcxEndpoint ep;
  };
  struct Opening {
    uint64_t token;
    bool network;
    std::vector<std::byte> address;
  };
  // A message UCX is still sending: its bytes stay put until then.
  struct InFlight {
    LinkMessageHeader header;
    std::vector<std::byte> bytes;
    bool done = false;
  };

  static ucs_status_t on_open(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t on_message(void* arg, const void* header, size_t header_length, void* data,
                                 size_t length, const ucp_am_recv_param_t* param);
  static void on_endpoint_error(void* arg, ucp_ep_h ep, ucs_status_t status);
  void fail(Link& link);
  Status post(Link& link, uint64_t token, std::span<const std::byte> message);
  void send_queued();  // mu held

  ucp_worker_h worker_;
  std::unordered_map<uint64_t, Link> links_;
  std::vector<Opening> opening_;
  std::list<InFlight> in_flight_;
  std::mutex queue_mu_;  // after mu, when both are taken
  // Messages sent while another thread progressed the worker, sent by it next: no more
  // than the callers' own bounds (a readiness per slot, an answer per readiness).
  std::deque<std::pair<uint64_t, std::vector<std::byte>>> queued_;
  // Owners of closed links' endpoints: UCX may still hold their address until the worker goes.
  std::vector<std::unique_ptr<EndpointOwner>> retired_;
};

}  // namespace rd2h::transfer
