#include "rd2h/common/status.h"

namespace rd2h {

std::string_view to_string(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "ok";
    case StatusCode::kInvalidArgument:
      return "invalid argument";
    case StatusCode::kOutOfRange:
      return "out of range";
    case StatusCode::kAlreadyExists:
      return "already exists";
    case StatusCode::kNotFound:
      return "not found";
    case StatusCode::kFailedPrecondition:
      return "failed precondition";
    case StatusCode::kInvalidMetadata:
      return "invalid metadata";
    case StatusCode::kUnreachable:
      return "unreachable";
    case StatusCode::kPeerDead:
      return "peer dead";
    case StatusCode::kTimeout:
      return "timeout";
    case StatusCode::kTransport:
      return "transport error";
    case StatusCode::kInternal:
      return "internal error";
  }
  return "unknown";
}

std::string Status::to_string() const {
  if (is_ok()) return "ok";
  std::string s(rd2h::to_string(code_));
  s += ": ";
  s += message_;
  return s;
}

Status Status::with_context(std::string_view context) const {
  if (is_ok()) return *this;
  std::string m(context);
  m += ": ";
  m += message_;
  return {code_, std::move(m)};
}

}  // namespace rd2h
