// rd2h proxy: runs the proxy until SIGINT or SIGTERM, printing where it listens.
#pragma once

#include <string>

#include "rd2h/metaserver/proxy.h"

namespace rd2h::tools {

// `token_file`: the engines' bearer token (empty: $RD2H_TOKEN, if set).
int run_proxy(metaserver::ProxyConfig config, const std::string& token_file);

}  // namespace rd2h::tools
