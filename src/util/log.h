// The library's logger (spdlog, from Debian): the one place rd2h code writes diagnostics.
//   log::warn("refused a control connection from {}: {}", peer, why);
#pragma once

#include <spdlog/spdlog.h>

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

}  // namespace rd2h::log
