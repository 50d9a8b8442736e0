#include "transfer/shared_backing.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>

#include "common/format.h"

namespace rd2h::transfer {
namespace {

constexpr size_t kChunk = size_t{64} << 20;  // moved at a time: the extra memory needed

uintptr_t page_size() {
  return static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
}

std::string errno_text() {
  return std::strerror(errno);
}

// Why [start, end) is not private anonymous read-write memory throughout, or empty if it is.
std::string why_not_private_anonymous(uintptr_t start, uintptr_t end) {
  std::ifstream maps("/proc/self/maps");
  if (!maps) return "/proc/self/maps cannot be read";
  uintptr_t covered = start;
  for (std::string line; std::getline(maps, line) && covered < end;) {
    std::istringstream in(line);
    std::string range, perms, offset, device, inode, path;
    in >> range >> perms >> offset >> device >> inode;
    std::getline(in >> std::ws, path);
    const size_t dash = range.find('-');
    if (dash == std::string::npos) continue;
    const uintptr_t lo = std::stoull(range.substr(0, dash), nullptr, 16);
    const uintptr_t hi = std::stoull(range.substr(dash + 1), nullptr, 16);
    if (hi <= covered) continue;
    if (lo > covered) return "the range has an unmapped gap at " + hex(covered);
    if (perms.size() < 4 || perms[0] != 'r' || perms[1] != 'w' || perms[3] != 'p') {
      return "the mapping at " + hex(lo) + " is " + perms + ", not private read-write";
    }
    if (!path.empty() && path != "[heap]") {
      return "the mapping at " + hex(lo) + " is backed by " + path;
    }
    covered = hi;
  }
  if (covered < end) return "the range ends past its mappings, at " + hex(covered);
  return "";
}

}  // namespace

Expected<SharedBacking> share_in_place(void* addr, size_t length) {
  const uintptr_t page = page_size();
  const auto first = reinterpret_cast<uintptr_t>(addr);
  const uintptr_t start = first & ~(page - 1);
  const uintptr_t end = (first + length + page - 1) & ~(page - 1);
  const std::string range = range_text(first, length);
  if (length == 0 || end <= start) return invalid_argument("cannot share the empty range");
  if (std::string why = why_not_private_anonymous(start, end); !why.empty()) {
    return failed_precondition("range " + range + " stays private: " + why);
  }
  UniqueFd memfd(::memfd_create("rd2h-kv", MFD_CLOEXEC));
  if (!memfd.valid()) return internal_error("memfd_create for " + range + ": " + errno_text());
  const int fd = memfd.get();
  auto fail = [&](const std::string& what) -> Expected<SharedBacking> {
    return internal_error(what + " for " + range + ": " + errno_text());
  };
  const uint64_t total = end - start;
  // The pages, then the page of the live word.
  if (::ftruncate(fd, static_cast<off_t>(total + page)) != 0) return fail("sizing the memfd");
  struct stat st {};
  if (::fstat(fd, &st) != 0) return fail("fstat of the memfd");
  for (uint64_t off = 0; off < total; off += kChunk) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunk, total - off));
    void* target = reinterpret_cast<void*>(start + off);
    void* fresh =
        ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, static_cast<off_t>(off));
    if (fresh == MAP_FAILED) return fail("mapping the memfd");
    std::memcpy(fresh, target, n);
    ::munmap(fresh, n);
    // Atomically puts the file's copy where the private pages were (they are freed). A
    // chunk moved earlier stays moved if a later one fails: it holds the same bytes.
    if (::mmap(target, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd,
               static_cast<off_t>(off)) != target) {
      return fail("mapping the memfd over the pages at " + hex(start + off));
    }
  }
  void* live =
      ::mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_SHARED, fd, static_cast<off_t>(total));
  if (live == MAP_FAILED) return fail("mapping the memfd's live word");
  SharedBacking b(std::move(memfd), static_cast<uint64_t>(st.st_ino), start, total, total,
                  static_cast<uint64_t*>(live));
  __atomic_store_n(b.live, uint64_t{1}, __ATOMIC_RELEASE);
  return b;
}

SharedBacking& SharedBacking::operator=(SharedBacking&& o) noexcept {
  if (this != &o) {
    release();
    fd = std::move(o.fd);
    inode = o.inode;
    base = o.base;
    length = o.length;
    live_offset = o.live_offset;
    live = std::exchange(o.live, nullptr);
  }
  return *this;
}

void SharedBacking::release() {
  if (live != nullptr) {
    __atomic_store_n(live, uint64_t{0}, __ATOMIC_RELEASE);
    ::munmap(live, page_size());
    live = nullptr;
  }
  fd.reset();
}

PeerMapping::~PeerMapping() {
  if (map_ != nullptr) ::munmap(map_, map_length_);
  if (live_page_ != nullptr) ::munmap(live_page_, page_size());
}

PeerMapping::PeerMapping(PeerMapping&& other) noexcept
    : map_(std::exchange(other.map_, nullptr)),
      map_length_(std::exchange(other.map_length_, 0)),
      data_(std::exchange(other.data_, nullptr)),
      live_page_(std::exchange(other.live_page_, nullptr)) {}

PeerMapping& PeerMapping::operator=(PeerMapping&& other) noexcept {
  if (this != &other) {
    if (map_ != nullptr) ::munmap(map_, map_length_);
    if (live_page_ != nullptr) ::munmap(live_page_, page_size());
    map_ = std::exchange(other.map_, nullptr);
    map_length_ = std::exchange(other.map_length_, 0);
    data_ = std::exchange(other.data_, nullptr);
    live_page_ = std::exchange(other.live_page_, nullptr);
  }
  return *this;
}

bool PeerMapping::live() const {
  return live_page_ != nullptr &&
         __atomic_load_n(static_cast<const uint64_t*>(live_page_), __ATOMIC_ACQUIRE) == 1;
}

Expected<PeerMapping> PeerMapping::map(pid_t pid, int fd, uint64_t inode, uint64_t offset,
                                       uint64_t length, uint64_t live_offset) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  const UniqueFd file(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!file.valid()) return unreachable("cannot open " + path + ": " + errno_text());
  struct stat st {};
  const bool same = ::fstat(file.get(), &st) == 0 && S_ISREG(st.st_mode) &&
                    static_cast<uint64_t>(st.st_ino) == inode && offset + length >= offset &&
                    static_cast<uint64_t>(st.st_size) >= offset + length &&
                    live_offset % page_size() == 0 &&
                    static_cast<uint64_t>(st.st_size) >= live_offset + page_size();
  if (!same) return unreachable(path + " is no longer the memory the peer exported");
  const uintptr_t page = page_size();
  const uint64_t aligned = offset & ~static_cast<uint64_t>(page - 1);
  const size_t map_length = static_cast<size_t>(offset + length - aligned);
  void* p =
      ::mmap(nullptr, map_length, PROT_READ, MAP_SHARED, file.get(), static_cast<off_t>(aligned));
  int saved = errno;
  void* live = p == MAP_FAILED ? MAP_FAILED
                               : ::mmap(nullptr, page, PROT_READ, MAP_SHARED, file.get(),
                                        static_cast<off_t>(live_offset));
  if (p != MAP_FAILED && live == MAP_FAILED) {
    saved = errno;
    ::munmap(p, map_length);
    p = MAP_FAILED;
  }
  if (p == MAP_FAILED) return unreachable("cannot map " + path + ": " + std::strerror(saved));
  // Not populated: the pages fault in as reads touch them (see map_region in ucx_session.cc).
  PeerMapping m;
  m.map_ = p;
  m.map_length_ = map_length;
  m.data_ = static_cast<const std::byte*>(p) + (offset - aligned);
  m.live_page_ = live;
  return m;
}

}  // namespace rd2h::transfer
