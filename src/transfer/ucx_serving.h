// An engine's serving worker, whose address the engine exports. Its own thread progresses it,
// so peers' reads are served without the application's help: it answers the am read path's
// requests from registered memory and carries the links this engine serves (ucx_link.h).
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "rd2h/common/status.h"
#include "transfer/ucx_handles.h"
#include "transfer/ucx_link.h"
#include "transfer/ucx_memory.h"
#include "util/unique_fd.h"

namespace rd2h::transfer {

class ServingWorker {
 public:
  // Serves reads of `registrations`, which must outlive this.
  static Expected<std::unique_ptr<ServingWorker>> start(ucp_context_h context,
                                                        const Registrations& registrations);
  ServingWorker(const ServingWorker&) = delete;
  ServingWorker& operator=(const ServingWorker&) = delete;
  // Stops the thread; then the served links' endpoints close and the worker goes, which
  // cancels unfinished replies (they may still read registered memory).
  ~ServingWorker();

  const std::vector<std::byte>& address() const { return address_; }
  ServedLinks& links() { return *links_; }
  // The worker's event fd, for the notification consumer to sleep on.
  int event_fd() const { return event_fd_; }
  // One progress of the worker for the notification consumer; true when it had no events and
  // is armed (the driver may sleep). Without `arm` it is left unarmed (and false returned).
  bool progress_once(bool arm);
  // Stops serving: the thread is joined. Idempotent.
  void stop();

 private:
  explicit ServingWorker(const Registrations& registrations) : registrations_(registrations) {}
  Status init(ucp_context_h context);
  void loop();
  // The am read path's server side, on the progress thread: answers each requested range
  // with its bytes, straight from registered memory.
  static ucs_status_t on_read_request(void* arg, const void* header, size_t header_length,
                                      void* data, size_t length, const ucp_am_recv_param_t* param);

  const Registrations& registrations_;
  UcxWorker worker_;
  std::vector<std::byte> address_;
  std::unique_ptr<ServedLinks> links_;
  int event_fd_ = -1;  // the worker's, owned by UCX
  UniqueFd stop_fd_;
  UniqueFd epoll_fd_;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
};

}  // namespace rd2h::transfer
