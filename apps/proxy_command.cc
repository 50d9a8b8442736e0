#include "proxy_command.h"

#include <csignal>
#include <cstdio>

namespace rd2h::tools {

int run_proxy(const metaserver::ProxyConfig& config) {
  // Block the stop signals in every thread the proxy starts; this thread waits for them.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  auto proxy = metaserver::Proxy::start(config);
  if (!proxy) {
    std::fprintf(stderr, "rd2h proxy: %s\n", proxy.status().to_string().c_str());
    return 1;
  }
  std::printf("rd2h proxy: serving %s (metaserver %s)\n", (*proxy)->url().c_str(),
              (*proxy)->metaserver_url().c_str());
  std::fflush(stdout);
  int signal = 0;
  sigwait(&stop, &signal);
  std::printf("rd2h proxy: stopping on signal %d\n", signal);
  return 0;
}

}  // namespace rd2h::tools
