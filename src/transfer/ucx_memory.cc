#include "transfer/ucx_memory.h"

#include <optional>
#include <string>
#include <utility>

#include "common/format.h"
#include "util/log.h"

namespace rd2h::transfer {

void ReplyTracker::add() {
  std::lock_guard lock(mu);
  ++in_flight;
}

void ReplyTracker::done() {
  {
    std::lock_guard lock(mu);
    --in_flight;
  }
  drained.notify_all();
}

bool ReplyTracker::wait_drained(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu);
  return drained.wait_for(lock, timeout, [this] { return in_flight == 0; });
}

Expected<MemoryRegion> Registrations::add(void* addr, size_t length, bool allocate) {
  if (length == 0) return invalid_argument("cannot register a zero-length range");
  if (!allocate && addr == nullptr) return invalid_argument("cannot register a null address");
  auto base = reinterpret_cast<uintptr_t>(addr);
  if (!allocate && base + length < base) {
    return invalid_argument("range " + range_text(base, length) + " wraps the address space");
  }

  std::unique_lock lock(mu_);
  if (!allocate) {
    if (auto conflict = overlapping(base, length)) {
      return already_exists("range " + range_text(base, length) + " overlaps registered range " +
                            range_text(conflict->first, conflict->second.length));
    }
  }

  // A Prefill's own KV memory is read by co-located Decode processes: its pages move into
  // a memfd they map, so those reads need nothing of this process. Where they cannot move
  // (a file or shared mapping), readers are answered over the am path.
  LocalRegistration reg;
  if (!allocate && config_.role == Role::kPrefill && config_.transport != Transport::kTcp &&
      config_.share_registered) {
    auto moved = share_in_place(addr, length);
    if (moved) {
      reg.shared = std::move(*moved);
    } else {
      log::info("transfer: {}; co-located peers read it through this process",
                moved.status().message());
    }
  }

  void* mapped = nullptr;
  RD2H_RETURN_IF_ERROR(map(addr, length, allocate, reg, mapped));
  // Caller memory is known by the caller's address (UCX may report its page instead).
  const uintptr_t actual = allocate ? reinterpret_cast<uintptr_t>(mapped) : base;
  if (allocate && overlapping(actual, length)) {
    // Cannot happen for fresh memory unless a caller registered a range it did not own.
    return internal_error("allocated memory " + range_text(actual, length) +
                          " overlaps an existing registration");
  }
  if (reg.shared.fd.valid()) reg.file_offset = actual - reg.shared.base;
  regs_.emplace(actual, std::move(reg));
  return MemoryRegion{reinterpret_cast<void*>(actual), length};
}

Status Registrations::map(void* addr, size_t length, bool allocate, LocalRegistration& reg,
                          void*& mapped) {
  const auto base = reinterpret_cast<uintptr_t>(addr);
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                  UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  mp.address = addr;
  mp.length = length;
  mp.flags = allocate ? UCP_MEM_MAP_ALLOCATE : 0;
  ucp_mem_h memh = nullptr;
  if (ucs_status_t st = ucp_mem_map(context_, &mp, &memh); st != UCS_OK) {
    return ucs_error((allocate ? "allocating " : "registering ") + range_text(base, length), st);
  }
  reg.memh = UcxMemory(context_, memh);
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  if (ucs_status_t st = ucp_mem_query(memh, &attr); st != UCS_OK) {
    return ucs_error("ucp_mem_query", st);
  }
  mapped = attr.address;
  void* rkey_buf = nullptr;
  size_t rkey_size = 0;
  if (ucs_status_t st = ucp_rkey_pack(context_, memh, &rkey_buf, &rkey_size); st != UCS_OK) {
    return ucs_error("ucp_rkey_pack", st);
  }
  // Expose exactly what the caller asked for, even if UCX rounded the allocation up.
  reg.length = length;
  const auto* rb = static_cast<const std::byte*>(rkey_buf);
  reg.packed_rkey.assign(rb, rb + rkey_size);
  ucp_rkey_buffer_release(rkey_buf);

  return Status::ok();
}

void Registrations::pin_reads() const {
  std::lock_guard lock(pins_mu_);
  ++pins_;
}

void Registrations::unpin_reads() const {
  {
    std::lock_guard lock(pins_mu_);
    --pins_;
  }
  unpinned_.notify_all();
}

Status Registrations::remove(void* addr) {
  const auto base = reinterpret_cast<uintptr_t>(addr);
  std::unique_lock lock(mu_);
  auto it = regs_.find(base);
  if (it == regs_.end()) return not_found("no registration starts at " + hex(base));
  {
    // No batch starts meanwhile (it would plan under mu_); those in flight may write here.
    std::unique_lock pins(pins_mu_);
    if (!unpinned_.wait_for(pins, config_.read_timeout, [this] { return pins_ == 0; })) {
      return timeout_error("reads into local memory were still in flight after " +
                           std::to_string(config_.read_timeout.count()) + " ms; " +
                           range_text(base, it->second.length) + " stays registered");
    }
  }
  // Out of the table first, so no new reply is sent from it; then wait for those in flight.
  LocalRegistration reg = std::move(it->second);
  regs_.erase(it);
  lock.unlock();
  const std::string range = range_text(base, reg.length);
  Status result;
  if (!reg.replies->wait_drained(config_.read_timeout)) {
    result = timeout_error("replies from " + range + " were still being sent after " +
                           std::to_string(config_.read_timeout.count()) +
                           " ms; the range stays registered");
  } else if (ucs_status_t st = reg.memh.unmap(); st != UCS_OK) {
    result = ucs_error("unregistering " + range + " (it stays registered)", st);
  } else {
    // Its pages stay shared-backed for the caller; readers that mapped them see it gone.
    return Status::ok();
  }
  lock.lock();
  regs_.emplace(base, std::move(reg));
  return result;
}

std::vector<ExportedRegion> Registrations::exported() const {
  std::vector<ExportedRegion> regions;
  std::shared_lock lock(mu_);
  for (const auto& [base, reg] : regs_) {
    regions.push_back({base, reg.length, reg.packed_rkey, reg.shared.fd.get(), reg.shared.inode,
                       reg.file_offset, reg.shared.live_offset});
  }
  return regions;
}

const std::pair<const uintptr_t, LocalRegistration>* Registrations::overlapping(uintptr_t base,
                                                                                size_t len) const {
  auto it = regs_.lower_bound(base + len);  // first registration starting at or after end
  if (it == regs_.begin()) return nullptr;
  --it;
  if (it->first + it->second.length > base) return &*it;
  return nullptr;
}

const LocalRegistration* Registrations::find(uintptr_t addr, size_t len) const {
  auto it = regs_.upper_bound(addr);
  if (it == regs_.begin()) return nullptr;
  --it;
  if (addr + len > it->first + it->second.length) return nullptr;
  return &it->second;
}

}  // namespace rd2h::transfer
