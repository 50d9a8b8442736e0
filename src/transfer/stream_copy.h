// Copies for reads from mapped shared memory. Large ranges are copied with non-temporal
// (streaming) stores: the destination is a KV pool the CPU does not read back soon, and
// skipping the read-for-ownership of every destination line moves about 1.5x the bytes of
// memcpy per second on the machines measured. Small ranges use memcpy.
#pragma once

#include <cstddef>

namespace rd2h::transfer {

inline constexpr size_t kStreamCopyMin = 64 * 1024;

void stream_copy(void* dst, const void* src, size_t n);
// Orders every streaming store issued so far before the stores that follow it; call before
// reporting the copies complete.
void stream_copy_fence();

}  // namespace rd2h::transfer
