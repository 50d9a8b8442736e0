#include "transfer/stream_copy.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "util/pattern.h"

namespace rd2h::transfer {
namespace {

TEST(StreamCopy, CopiesEveryByteForAnyAlignmentAndSize) {
  const size_t sizes[] = {0,
                          1,
                          63,
                          4096,
                          kStreamCopyMin - 1,
                          kStreamCopyMin,
                          kStreamCopyMin + 1,
                          kStreamCopyMin + 63,
                          3 * kStreamCopyMin + 17};
  std::vector<unsigned char> src(4 * kStreamCopyMin + 256), dst(src.size());
  for (size_t n : sizes) {
    for (size_t src_off : {0u, 1u, 15u, 64u}) {
      for (size_t dst_off : {0u, 3u, 16u, 63u}) {
        fill_pattern(src.data(), src.size(), n + src_off);
        std::fill(dst.begin(), dst.end(), 0xee);
        stream_copy(dst.data() + dst_off, src.data() + src_off, n);
        stream_copy_fence();
        ASSERT_EQ(0, std::memcmp(dst.data() + dst_off, src.data() + src_off, n))
            << n << " bytes, offsets " << src_off << "/" << dst_off;
        // Nothing outside the destination range is written.
        for (size_t i = 0; i < dst_off; ++i) ASSERT_EQ(dst[i], 0xee);
        for (size_t i = dst_off + n; i < dst.size(); ++i) ASSERT_EQ(dst[i], 0xee) << i;
      }
    }
  }
}

}  // namespace
}  // namespace rd2h::transfer
