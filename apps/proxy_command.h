// rd2h proxy: runs the proxy until SIGINT or SIGTERM, printing where it listens.
#pragma once

#include "rd2h/metaserver/proxy.h"

namespace rd2h::tools {

int run_proxy(const metaserver::ProxyConfig& config);

}  // namespace rd2h::tools
