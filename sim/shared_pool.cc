#include "sim/shared_pool.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

namespace rd2h::sim {
namespace {

Expected<std::byte*> map(int fd, uint64_t bytes, const std::string& name) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    return internal_error("cannot map " + std::to_string(bytes) + " bytes of shared memory " +
                          name + ": " + std::strerror(errno));
  }
  return static_cast<std::byte*>(p);
}

}  // namespace

Expected<SharedPool> SharedPool::create(uint64_t bytes) {
  static std::atomic<int> counter{0};
  SharedPool pool;
  pool.name_ = "/rd2h-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
  int fd = shm_open(pool.name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0 && errno == EEXIST) {
    // Left by a dead process that had this pid (no live one has it): not anyone's now.
    shm_unlink(pool.name_.c_str());
    fd = shm_open(pool.name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  }
  if (fd < 0) {
    return internal_error("cannot create shared memory " + pool.name_ + ": " +
                          std::strerror(errno));
  }
  pool.owner_ = true;
  // Reserve the pages now: a pool larger than /dev/shm fails here, naming the size, rather
  // than with SIGBUS at the first write past what tmpfs can hold.
  if (const int e = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); e != 0) {
    close(fd);
    return internal_error("cannot reserve " + std::to_string(bytes) +
                          " bytes of shared memory for " + pool.name_ +
                          " (is /dev/shm large "
                          "enough?): " +
                          std::strerror(e));
  }
  auto data = map(fd, bytes, pool.name_);
  close(fd);
  if (!data) return data.status();
  pool.data_ = *data;
  pool.size_ = bytes;
  return pool;
}

Expected<SharedPool> SharedPool::open(const std::string& name, uint64_t bytes) {
  SharedPool pool;
  pool.name_ = name;
  int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0)
    return internal_error("cannot open shared memory " + name + ": " + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < bytes) {
    close(fd);
    return invalid_argument("shared memory " + name + " is smaller than the " +
                            std::to_string(bytes) + " bytes of the main pool");
  }
  auto data = map(fd, bytes, name);
  close(fd);
  if (!data) return data.status();
  pool.data_ = *data;
  pool.size_ = bytes;
  return pool;
}

SharedPool::SharedPool(SharedPool&& other) noexcept {
  *this = std::move(other);
}

SharedPool& SharedPool::operator=(SharedPool&& other) noexcept {
  if (this != &other) {
    reset();
    name_ = std::move(other.name_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    owner_ = std::exchange(other.owner_, false);
    locked_ = std::exchange(other.locked_, false);
  }
  return *this;
}

SharedPool::~SharedPool() {
  reset();
}

void SharedPool::reset() {
  if (data_ != nullptr) {
    if (locked_) munlock(data_, size_);
    munmap(data_, size_);
  }
  data_ = nullptr;
  unlink();
}

void SharedPool::unlink() {
  if (owner_) shm_unlink(name_.c_str());
  owner_ = false;
}

bool SharedPool::lock() {
  if (!locked_ && data_ != nullptr) locked_ = mlock(data_, size_) == 0;
  return locked_;
}

}  // namespace rd2h::sim
