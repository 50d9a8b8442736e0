// The bearer token of rd2h's engine-facing HTTP (metaserver, engines, the proxy's calls to
// them): where it comes from, how it is sent and how it is checked.
#pragma once

#include <string>

#include "rd2h/common/status.h"

namespace rd2h::http {

// The first line of `path` (trailing whitespace dropped) when a path is given, else
// $RD2H_TOKEN, else empty (no token). A given file that cannot be read or is empty is an
// error.
Expected<std::string> load_token(const std::string& path);
// "Bearer <token>" for an Authorization header; empty when there is no token.
std::string bearer(const std::string& token);
// Whether `header` (an Authorization header value) carries `token`, in constant time.
bool token_matches(const std::string& header, const std::string& token);

}  // namespace rd2h::http
