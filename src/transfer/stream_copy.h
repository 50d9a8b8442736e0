// Copies for reads from mapped shared memory: ranges of kStreamCopyMin bytes and more with
// non-temporal (streaming) stores, smaller ones with memcpy. Call stream_copy_fence() before
// reporting the copies complete.
#pragma once

#include <cstddef>

namespace rd2h::transfer {

inline constexpr size_t kStreamCopyMin = 64 * 1024;

void stream_copy(void* dst, const void* src, size_t n);
// Orders every streaming store issued so far before the stores that follow it; call before
// reporting the copies complete.
void stream_copy_fence();

}  // namespace rd2h::transfer
