// The library's logger (spdlog, from Debian): the one place rd2h code writes diagnostics.
//   log::warn("refused a control connection from {}: {}", peer, why);
#pragma once

#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdint>
#include <mutex>

#include "rd2h/common/log.h"

namespace rd2h::log {

spdlog::logger& logger();

template <typename... Args>
void debug(spdlog::format_string_t<Args...> f, Args&&... args) {
  logger().debug(f, std::forward<Args>(args)...);
}
template <typename... Args>
void info(spdlog::format_string_t<Args...> f, Args&&... args) {
  logger().info(f, std::forward<Args>(args)...);
}
template <typename... Args>
void warn(spdlog::format_string_t<Args...> f, Args&&... args) {
  logger().warn(f, std::forward<Args>(args)...);
}
template <typename... Args>
void error(spdlog::format_string_t<Args...> f, Args&&... args) {
  logger().error(f, std::forward<Args>(args)...);
}

// At most one line per interval for what a peer can provoke at will (a flood of bad
// messages must not flood the log): allow() says whether to write one now, and how many
// were held back since the last.
class RateLimit {
 public:
  explicit RateLimit(std::chrono::milliseconds interval = std::chrono::seconds(10))
      : interval_(interval) {}
  bool allow(uint64_t* held_back) {
    std::lock_guard lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    if (now < next_) {
      ++held_;
      return false;
    }
    next_ = now + interval_;
    *held_back = held_;
    held_ = 0;
    return true;
  }

 private:
  const std::chrono::milliseconds interval_;
  std::mutex mu_;
  std::chrono::steady_clock::time_point next_{};
  uint64_t held_ = 0;
};

}  // namespace rd2h::log
