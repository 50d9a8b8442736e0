// rd2h proxy: runs the proxy until SIGINT or SIGTERM, printing where it listens; then
// drains it for up to `drain_timeout` and aborts what is left.
#pragma once

#include <chrono>
#include <string>

#include "rd2h/metaserver/proxy.h"

namespace rd2h::tools {

// `token_file`: the engines' bearer token (empty: $RD2H_TOKEN, if set). The client API key
// is config.api_key, else $RD2H_API_KEY if set.
int run_proxy(metaserver::ProxyConfig config, const std::string& token_file,
              std::chrono::seconds drain_timeout);

}  // namespace rd2h::tools
