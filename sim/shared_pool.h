// A POSIX shared-memory region the Decode TP rank processes map together (the main KV pool):
// the creator names and sizes it, every rank opens it by name. Unmapped on destruction; its
// creator unlinks it once every rank mapped it, at the latest on destruction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "rd2h/common/status.h"

namespace rd2h::sim {

class SharedPool {
 public:
  static Expected<SharedPool> create(uint64_t bytes);
  static Expected<SharedPool> open(const std::string& name, uint64_t bytes);

  SharedPool(SharedPool&& other) noexcept;
  SharedPool& operator=(SharedPool&& other) noexcept;
  SharedPool(const SharedPool&) = delete;
  SharedPool& operator=(const SharedPool&) = delete;
  ~SharedPool();

  void unlink();
  // Locks the pages in memory; false (and nothing locked) where the process may not.
  bool lock();

  std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  SharedPool() = default;
  void reset();

  std::string name_;
  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  bool owner_ = false;
  bool locked_ = false;
};

}  // namespace rd2h::sim
