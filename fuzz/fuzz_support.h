// What the harnesses share: the input as bytes or text, a property check that aborts naming
// the property (libFuzzer keeps the input), and the peak heap one decode call takes.
#pragma once

#include <sanitizer/allocator_interface.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <string_view>

#include "rd2h/common/status.h"

namespace rd2h::fuzz {

inline std::span<const std::byte> bytes_of(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const std::byte*>(data), size};
}

inline std::string_view text_of(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

[[noreturn]] inline void violated(const char* property, const char* file, int line,
                                  const std::string& detail) {
  std::fprintf(stderr, "%s:%d: property violated: %s\n  %s\n", file, line, property,
               detail.c_str());
  std::abort();
}

#define RD2H_FUZZ_CHECK(cond, detail)                                         \
  do {                                                                        \
    if (!(cond)) ::rd2h::fuzz::violated(#cond, __FILE__, __LINE__, (detail)); \
  } while (0)

// A refusal is an error with a reason, never an exception, a crash or an empty message.
inline void check_refusal(const Status& st, const char* what) {
  RD2H_FUZZ_CHECK(!st.is_ok(), what);
  RD2H_FUZZ_CHECK(!st.message().empty(), std::string(what) + ": refused without a reason");
}

// The most heap a decoder may hold per input byte, with its result: the decoded forms are
// wider than their wire bytes (a 3-byte read request is a 96-byte ReadReq, a 1-byte block id
// an 8-byte one, a 1-byte msgpack value a 16-byte tree node), so the bound is linear, not 1.
// What it catches is an allocation sized by a declared count instead of the bytes present.
inline constexpr size_t kHeapPerInputByte = 32;
inline constexpr size_t kHeapSlack = 64u << 10;

// The peak of live heap bytes allocated between construction and peak(), on this thread's
// watch (the harnesses are single-threaded). Uses the sanitizer allocator's hooks.
class HeapPeak {
 public:
  HeapPeak() {
    static const bool installed = [] {
      __sanitizer_install_malloc_and_free_hooks(&on_malloc, &on_free);
      return true;
    }();
    (void)installed;
    live_ = 0;
    peak_ = 0;
    active_ = true;
  }
  ~HeapPeak() { active_ = false; }
  HeapPeak(const HeapPeak&) = delete;
  HeapPeak& operator=(const HeapPeak&) = delete;

  size_t peak() const { return static_cast<size_t>(peak_); }

 private:
  static void on_malloc(const volatile void*, size_t size) {
    if (!active_) return;
    live_ += static_cast<int64_t>(size);
    if (live_ > peak_) peak_ = live_;
  }
  static void on_free(const volatile void* p) {
    if (!active_ || p == nullptr) return;
    live_ -= static_cast<int64_t>(__sanitizer_get_allocated_size(const_cast<const void*>(p)));
  }

  static inline bool active_ = false;
  static inline int64_t live_ = 0;
  static inline int64_t peak_ = 0;
};

inline void check_heap(const HeapPeak& heap, size_t input_size, const char* what) {
  const size_t limit = kHeapPerInputByte * input_size + kHeapSlack;
  RD2H_FUZZ_CHECK(heap.peak() <= limit, std::string(what) + " held " + std::to_string(heap.peak()) +
                                            " heap bytes for " + std::to_string(input_size) +
                                            " input bytes (limit " + std::to_string(limit) + ")");
}

}  // namespace rd2h::fuzz
