// The bearer token of rd2h's engine-facing HTTP (metaserver, engines, the proxy's calls to
// them): where it comes from, how it is sent and how it is checked.
#pragma once

#include <cstddef>
#include <string>

#include "rd2h/common/status.h"

namespace rd2h::http {

// Characters a token must have at least: guessing one is then out of reach.
inline constexpr size_t kMinTokenChars = 16;

// The first line of `path` (trailing whitespace dropped) when a path is given, else
// $RD2H_TOKEN, else empty (no token). A given file that cannot be read or is empty, and a
// token shorter than kMinTokenChars, are errors.
Expected<std::string> load_token(const std::string& path);
// "Bearer <token>" for an Authorization header; empty when there is no token.
std::string bearer(const std::string& token);
// Whether `header` (an Authorization header value) carries `token`, in constant time.
bool token_matches(const std::string& header, const std::string& token);

}  // namespace rd2h::http
