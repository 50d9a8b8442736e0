// Caller-registered memory that co-located peers read without the caller's help: share_in_place
// moves a range's pages into a memfd in place (same addresses, same bytes). Preconditions:
// nothing writes the range while it moves, and no forked child writes it afterwards.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "rd2h/common/status.h"
#include "util/unique_fd.h"

namespace rd2h::transfer {

// Owns the memfd and the mapped live word; released (the range marked unregistered, the
// file let go) when this goes, or earlier by release().
struct SharedBacking {
  SharedBacking() = default;
  SharedBacking(UniqueFd fd, uint64_t inode, uintptr_t base, uint64_t length, uint64_t live_offset,
                uint64_t* live)
      : fd(std::move(fd)),
        inode(inode),
        base(base),
        length(length),
        live_offset(live_offset),
        live(live) {}
  SharedBacking(SharedBacking&& o) noexcept { *this = std::move(o); }
  SharedBacking& operator=(SharedBacking&& o) noexcept;
  SharedBacking(const SharedBacking&) = delete;
  SharedBacking& operator=(const SharedBacking&) = delete;
  ~SharedBacking() { release(); }

  UniqueFd fd;          // the memfd now holding the pages
  uint64_t inode = 0;   // its identity, checked by readers against fd reuse
  uintptr_t base = 0;   // the address offset 0 of the file is mapped at (page aligned)
  uint64_t length = 0;  // whole pages covering the range
  // The page after them in the file holds a word that says the range is still registered
  // (1) or not (0): readers look at it before each read, as a serving peer would check.
  uint64_t live_offset = 0;
  uint64_t* live = nullptr;  // that word, mapped here

  // Marks the range unregistered and lets the file go (the caller's pages stay mapped).
  void release();
};

// Moves the pages covering [addr, addr+length) into a new memfd in place, a chunk at a time
// (at most one chunk of extra memory). Only private anonymous read-write memory is moved:
// anything else (a file or shared mapping, a guard page) is refused, saying why, and left
// as it was.
Expected<SharedBacking> share_in_place(void* addr, size_t length);

// A co-located process's shared range, mapped read-only into this one.
class PeerMapping {
 public:
  PeerMapping() = default;
  ~PeerMapping();
  PeerMapping(PeerMapping&& other) noexcept;
  PeerMapping& operator=(PeerMapping&& other) noexcept;
  PeerMapping(const PeerMapping&) = delete;
  PeerMapping& operator=(const PeerMapping&) = delete;

  // Maps `length` bytes at `offset` of the file that process `pid` holds open as `fd`,
  // which must be the memfd `inode` and hold them, and its live word at `live_offset`.
  // Its pages fault in as they are read.
  static Expected<PeerMapping> map(pid_t pid, int fd, uint64_t inode, uint64_t offset,
                                   uint64_t length, uint64_t live_offset);
  // The mapped bytes (offset of the file at data()).
  const std::byte* data() const { return data_; }
  // Whether the owner still has the range registered.
  bool live() const;

 private:
  void* map_ = nullptr;
  size_t map_length_ = 0;
  const std::byte* data_ = nullptr;
  void* live_page_ = nullptr;
};

}  // namespace rd2h::transfer
