#include "util/log.h"

#include <spdlog/sinks/stdout_sinks.h>

#include <cstdlib>
#include <optional>
#include <string>

namespace rd2h {

namespace {

std::optional<spdlog::level::level_enum> parse_level(std::string_view name) {
  using L = spdlog::level::level_enum;
  static const std::pair<std::string_view, L> names[] = {
      {"trace", L::trace},  {"debug", L::debug}, {"info", L::info},         {"warn", L::warn},
      {"warning", L::warn}, {"error", L::err},   {"critical", L::critical}, {"off", L::off}};
  for (const auto& [n, level] : names) {
    if (name == n) return level;
  }
  return std::nullopt;
}

std::shared_ptr<spdlog::logger> make_logger() {
  // Not registered with spdlog's global registry: a host's own spdlog setup stays its own.
  auto l =
      std::make_shared<spdlog::logger>("rd2h", std::make_shared<spdlog::sinks::stderr_sink_mt>());
  l->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%n] [%l] %v");
  l->set_level(spdlog::level::info);
  if (const char* env = std::getenv("RD2H_LOG_LEVEL")) {
    if (auto level = parse_level(env)) {
      l->set_level(*level);
    } else {
      l->warn(
          "RD2H_LOG_LEVEL '{}' is not one of trace, debug, info, warn, error, critical, off; "
          "logging at info",
          env);
    }
  }
  l->flush_on(spdlog::level::trace);  // every line whole and at once, as stderr is read live
  return l;
}

}  // namespace

namespace log {
spdlog::logger& logger() {
  static const std::shared_ptr<spdlog::logger> l = make_logger();
  return *l;
}
}  // namespace log

Status set_log_level(std::string_view level) {
  auto l = parse_level(level);
  if (!l) {
    return invalid_argument("log level '" + std::string(level) +
                            "' is not one of trace, debug, info, warn, error, critical, off");
  }
  log::logger().set_level(*l);
  return Status::ok();
}

}  // namespace rd2h
