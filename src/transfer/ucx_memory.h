// The memory an engine exposes: ranges registered or allocated in its UCX context, each with
// its packed rkey and, for a Prefill's own KV memory, the memfd co-located readers map. A caller
// holds the shared lock for as long as it uses what a lookup found.
#pragma once

#include <ucp/api/ucp.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <vector>

#include "rd2h/common/status.h"
#include "rd2h/transfer/transfer_engine.h"
#include "transfer/shared_backing.h"
#include "transfer/ucx_handles.h"
#include "transfer/ucx_metadata.h"

namespace rd2h::transfer {

// Replies the server is sending from one registration. UCX reads a reply's bytes until
// its send completes, so unregistering waits for them to drain.
struct ReplyTracker {
  std::mutex mu;
  std::condition_variable drained;
  int in_flight = 0;

  void add();
  void done();
  bool wait_drained(std::chrono::milliseconds timeout);
};

struct LocalRegistration {
  uint64_t length = 0;
  // Caller memory moved into a memfd for co-located readers (fd -1: none). Declared before
  // the mapping, so it is released after it.
  SharedBacking shared;
  uint64_t file_offset = 0;  // of the registration's start in the memfd
  UcxMemory memh;
  std::vector<std::byte> packed_rkey;
  std::shared_ptr<ReplyTracker> replies = std::make_shared<ReplyTracker>();
};

class Registrations {
 public:
  Registrations(ucp_context_h context, const EngineConfig& config)
      : context_(context), config_(config) {}

  // Registers [addr, addr+length) (allocate false) or allocates `length` bytes.
  Expected<MemoryRegion> add(void* addr, size_t length, bool allocate);
  // Unregisters the range starting at `addr` once the replies sent from it drained (within
  // the read timeout); on failure it stays registered.
  Status remove(void* addr);
  // Every registration as peers see it, sorted by base.
  std::vector<ExportedRegion> exported() const;

  std::shared_lock<std::shared_mutex> lock_shared() const { return std::shared_lock(mu_); }
  // A batch of reads into local memory is in flight from pin_reads() to unpin_reads():
  // remove() waits for none to be (within the read timeout).
  void pin_reads() const;
  void unpin_reads() const;
  // The registration covering the whole range, or null. Caller holds lock_shared().
  const LocalRegistration* find(uintptr_t addr, size_t len) const;

 private:
  // Maps (or allocates) the range with UCX into `reg` (its memory handle, packed rkey and
  // length); `mapped` is where UCX put it. Caller holds mu_.
  Status map(void* addr, size_t length, bool allocate, LocalRegistration& reg, void*& mapped);
  // The registration overlapping [base, base+len), if any. Caller holds mu_.
  const std::pair<const uintptr_t, LocalRegistration>* overlapping(uintptr_t base,
                                                                   size_t len) const;

  ucp_context_h context_;
  const EngineConfig& config_;
  mutable std::shared_mutex mu_;
  std::map<uintptr_t, LocalRegistration> regs_;
  mutable std::mutex pins_mu_;
  mutable std::condition_variable unpinned_;
  mutable size_t pins_ = 0;  // batches of reads in flight
};

}  // namespace rd2h::transfer
