#include "proxy_command.h"

#include <cstdio>

#include "metaserver/token.h"
#include "stop_signal.h"

namespace rd2h::tools {

int run_proxy(metaserver::ProxyConfig config, const std::string& token_file) {
  auto token = metaserver::load_token(token_file);
  if (!token) {
    std::fprintf(stderr, "rd2h proxy: --token-file: %s\n", token.status().message().c_str());
    return 2;
  }
  config.token = *token;
  StopSignal stop;  // before the proxy starts its threads
  auto proxy = metaserver::Proxy::start(config);
  if (!proxy) {
    std::fprintf(stderr, "rd2h proxy: %s\n", proxy.status().to_string().c_str());
    return 1;
  }
  std::printf("rd2h proxy: serving %s (metaserver %s)\n", (*proxy)->url().c_str(),
              (*proxy)->metaserver_url().c_str());
  std::fflush(stdout);
  const int signal = stop.wait();
  std::printf("rd2h proxy: stopping on signal %d\n", signal);
  return 0;
}

}  // namespace rd2h::tools
