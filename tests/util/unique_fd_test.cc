#include "util/unique_fd.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/eventfd.h>

#include <cerrno>

namespace rd2h {
namespace {

bool is_open(int fd) { return ::fcntl(fd, F_GETFD) != -1 || errno != EBADF; }

TEST(UniqueFd, ClosesWhenItsOwnerGoesOrReplacesIt) {
  const int a = ::eventfd(0, EFD_CLOEXEC);
  const int b = ::eventfd(0, EFD_CLOEXEC);
  ASSERT_GE(a, 0);
  ASSERT_GE(b, 0);
  {
    UniqueFd owner(a);
    EXPECT_TRUE(owner.valid());
    EXPECT_EQ(owner.get(), a);
    owner.reset(b);
    EXPECT_FALSE(is_open(a)) << "the replaced fd is closed";
    EXPECT_TRUE(is_open(b));
    UniqueFd moved(std::move(owner));
    EXPECT_FALSE(owner.valid());
    EXPECT_EQ(moved.get(), b);
    EXPECT_TRUE(is_open(b)) << "a move hands the fd on without closing it";
  }
  EXPECT_FALSE(is_open(b)) << "the last owner closed it when it went";
}

TEST(UniqueFd, AnOwnerMovedOntoClosesWhatItHeld) {
  const int a = ::eventfd(0, EFD_CLOEXEC);
  const int b = ::eventfd(0, EFD_CLOEXEC);
  ASSERT_GE(a, 0);
  ASSERT_GE(b, 0);
  UniqueFd first(a);
  UniqueFd second(b);
  first = std::move(second);
  EXPECT_FALSE(is_open(a)) << "the fd an owner held before a move onto it stays open";
  EXPECT_EQ(first.get(), b);
  EXPECT_TRUE(is_open(b));
  EXPECT_FALSE(second.valid());
}

TEST(UniqueFd, ReleaseHandsTheFdToTheCallerUnclosed) {
  const int a = ::eventfd(0, EFD_CLOEXEC);
  ASSERT_GE(a, 0);
  int released = -1;
  {
    UniqueFd owner(a);
    released = owner.release();
    EXPECT_FALSE(owner.valid());
  }
  EXPECT_EQ(released, a);
  EXPECT_TRUE(is_open(a)) << "the owner went without closing what it released";
  EXPECT_EQ(::close(a), 0);
}

}  // namespace
}  // namespace rd2h
