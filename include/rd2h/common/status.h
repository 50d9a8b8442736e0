// Status and Expected<T>: how every rd2h module reports an error across its boundary.
// A Status is a code plus a message a user can act on; code kOk (0) means success.
#pragma once

#include <cassert>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace rd2h {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,     // the caller passed something malformed
  kOutOfRange = 2,          // an address range, id or index outside what exists
  kAlreadyExists = 3,       // e.g. an overlapping registration
  kNotFound = 4,            // unknown session, region or name
  kFailedPrecondition = 5,  // valid request in the wrong state (e.g. broken session)
  kInvalidMetadata = 6,     // peer metadata bytes that do not decode
  kUnreachable = 7,         // a peer that cannot be connected to
  kPeerDead = 8,            // the peer process is gone or its connection failed
  kTimeout = 9,             // a bounded wait ran out
  kTransport = 10,          // the transport reported an error of its own
  kInternal = 11,
};

std::string_view to_string(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return {}; }

  bool is_ok() const { return code_ == StatusCode::kOk; }
  explicit operator bool() const { return is_ok(); }
  StatusCode code() const { return code_; }
  // The numeric result of a call shaped like MemFabric's: 0 on success.
  int raw_code() const { return static_cast<int>(code_); }
  const std::string& message() const { return message_; }
  // "<code>: <message>", or "ok".
  std::string to_string() const;

  // Returns a copy whose message is prefixed with `context: `.
  Status with_context(std::string_view context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status invalid_argument(std::string m) {
  return {StatusCode::kInvalidArgument, std::move(m)};
}
inline Status out_of_range(std::string m) {
  return {StatusCode::kOutOfRange, std::move(m)};
}
inline Status already_exists(std::string m) {
  return {StatusCode::kAlreadyExists, std::move(m)};
}
inline Status not_found(std::string m) {
  return {StatusCode::kNotFound, std::move(m)};
}
inline Status failed_precondition(std::string m) {
  return {StatusCode::kFailedPrecondition, std::move(m)};
}
inline Status invalid_metadata(std::string m) {
  return {StatusCode::kInvalidMetadata, std::move(m)};
}
inline Status unreachable(std::string m) {
  return {StatusCode::kUnreachable, std::move(m)};
}
inline Status peer_dead(std::string m) {
  return {StatusCode::kPeerDead, std::move(m)};
}
inline Status timeout_error(std::string m) {
  return {StatusCode::kTimeout, std::move(m)};
}
inline Status transport_error(std::string m) {
  return {StatusCode::kTransport, std::move(m)};
}
inline Status internal_error(std::string m) {
  return {StatusCode::kInternal, std::move(m)};
}

// A value or the Status that explains why there is none. Never holds an ok Status.
template <typename T>
class [[nodiscard]] Expected {
 public:
  Expected(T value) : v_(std::move(value)) {}        // NOLINT(google-explicit-constructor)
  Expected(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    assert(!std::get<Status>(v_).is_ok());
  }

  bool has_value() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return has_value(); }

  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  Status status() const { return has_value() ? Status::ok() : std::get<Status>(v_); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace rd2h

#define RD2H_RETURN_IF_ERROR(expr)                  \
  do {                                              \
    ::rd2h::Status rd2h_status_ = (expr);           \
    if (!rd2h_status_.is_ok()) return rd2h_status_; \
  } while (0)

// Declares `var` as the value of `expr` (an Expected), or returns the Status that explains
// why there is none.
#define RD2H_TRY(var, expr)                        \
  auto var##_result = (expr);                      \
  if (!var##_result) return var##_result.status(); \
  auto var = std::move(*var##_result)
