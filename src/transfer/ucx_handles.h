// Owners of UCX handles: each handle is released once, by whoever holds it, in the order
// its owner's members go. An endpoint is closed on the worker that made it, so it must go
// before that worker (declare the worker first).
#pragma once

#include <ucp/api/ucp.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "rd2h/common/status.h"

namespace rd2h::transfer {

// A transport error naming what failed and UCX's reason.
inline Status ucs_error(std::string_view what, ucs_status_t st) {
  return transport_error(std::string(what) + ": " + ucs_status_string(st));
}

namespace detail {
struct ConfigRelease {
  void operator()(ucp_config_t* c) const { ucp_config_release(c); }
};
struct ContextCleanup {
  void operator()(ucp_context_h c) const { ucp_cleanup(c); }
};
struct WorkerDestroy {
  void operator()(ucp_worker_h w) const { ucp_worker_destroy(w); }
};
struct RkeyDestroy {
  void operator()(ucp_rkey_h k) const { ucp_rkey_destroy(k); }
};
}  // namespace detail

using UcxConfig = std::unique_ptr<ucp_config_t, detail::ConfigRelease>;
using UcxContext = std::unique_ptr<std::remove_pointer_t<ucp_context_h>, detail::ContextCleanup>;
using UcxWorker = std::unique_ptr<std::remove_pointer_t<ucp_worker_h>, detail::WorkerDestroy>;
using UcxRkey = std::unique_ptr<std::remove_pointer_t<ucp_rkey_h>, detail::RkeyDestroy>;

// Memory mapped (registered or allocated) in a context; unmapped when this goes.
class UcxMemory {
 public:
  UcxMemory() = default;
  UcxMemory(ucp_context_h context, ucp_mem_h memh) : context_(context), memh_(memh) {}
  UcxMemory(UcxMemory&& o) noexcept
      : context_(o.context_), memh_(std::exchange(o.memh_, nullptr)) {}
  UcxMemory& operator=(UcxMemory&& o) noexcept {
    if (this != &o) {
      (void)unmap();
      context_ = o.context_;
      memh_ = std::exchange(o.memh_, nullptr);
    }
    return *this;
  }
  UcxMemory(const UcxMemory&) = delete;
  UcxMemory& operator=(const UcxMemory&) = delete;
  ~UcxMemory() { (void)unmap(); }

  ucp_mem_h get() const { return memh_; }
  // Unmaps now; on failure the memory stays mapped and owned.
  ucs_status_t unmap() {
    if (memh_ == nullptr) return UCS_OK;
    const ucs_status_t st = ucp_mem_unmap(context_, memh_);
    if (st == UCS_OK) memh_ = nullptr;
    return st;
  }

 private:
  ucp_context_h context_ = nullptr;
  ucp_mem_h memh_ = nullptr;
};

// An endpoint, closed when this goes: forced where it has peer error handling, otherwise
// gracefully. By default the close is flushed for a short bound on its worker (a graceful
// close to a dead peer may never finish; the worker's destruction discards the rest). An
// owner whose worker must not be progressed inside the close (its handlers would run
// there) asks for no flush: the close request is left to UCX, which frees it when it
// completes or with the worker. Either way the worker must still be there when this closes.
class UcxEndpoint {
 public:
  static constexpr std::chrono::milliseconds kDefaultFlush{100};

  UcxEndpoint() = default;
  UcxEndpoint(ucp_worker_h worker, ucp_ep_h ep, bool force,
              std::chrono::milliseconds flush = kDefaultFlush)
      : worker_(worker), ep_(ep), force_(force), flush_(flush) {}
  UcxEndpoint(UcxEndpoint&& o) noexcept
      : worker_(o.worker_),
        ep_(std::exchange(o.ep_, nullptr)),
        force_(o.force_),
        flush_(o.flush_) {}
  UcxEndpoint& operator=(UcxEndpoint&& o) noexcept {
    if (this != &o) {
      close();
      worker_ = o.worker_;
      ep_ = std::exchange(o.ep_, nullptr);
      force_ = o.force_;
      flush_ = o.flush_;
    }
    return *this;
  }
  UcxEndpoint(const UcxEndpoint&) = delete;
  UcxEndpoint& operator=(const UcxEndpoint&) = delete;
  ~UcxEndpoint() { close(); }

  ucp_ep_h get() const { return ep_; }
  explicit operator bool() const { return ep_ != nullptr; }
  void close();

 private:
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  bool force_ = false;
  std::chrono::milliseconds flush_ = kDefaultFlush;  // zero: no flush, the worker is not progressed
};

// A worker of `context` for one thread at a time (UCS_THREAD_MODE_SERIALIZED).
Expected<UcxWorker> create_worker(ucp_context_h context);

// The address peers reach `worker` at.
Expected<std::vector<std::byte>> worker_address(ucp_worker_h worker);

}  // namespace rd2h::transfer
