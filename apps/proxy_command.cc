#include "proxy_command.h"

#include <malloc.h>

#include <cstdio>
#include <cstdlib>

#include "stop_signal.h"
#include "util/token.h"

namespace rd2h::tools {

int run_proxy(metaserver::ProxyConfig config, const std::string& token_file,
              std::chrono::seconds drain_timeout) {
  // Buffers of 1 MiB and more (request bodies, answers) are mapped for themselves and
  // unmapped when freed. glibc would otherwise raise this threshold to the largest buffer
  // freed so far and keep such memory in its per-thread heaps after the request: a proxy
  // sent a few large bodies at once would hold hundreds of MB for good. Only the proxy:
  // it moves no KV, and a process whose transfer buffers of 1 MiB and more were mapped and
  // unmapped on every use reads over TCP at a third of its speed.
  ::mallopt(M_MMAP_THRESHOLD, 1 << 20);
  auto token = http::load_token(token_file);
  if (!token) {
    std::fprintf(stderr, "rd2h proxy: --token-file: %s\n", token.status().message().c_str());
    return 2;
  }
  config.token = *token;
  if (config.api_key.empty()) {
    if (const char* key = std::getenv("RD2H_API_KEY")) config.api_key = key;
  }
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
  // Drain: new requests get 503 while those in flight finish; what is left after the bound
  // is aborted (its engine requests closed, so the engines free its blocks).
  std::printf("rd2h proxy: signal %d: draining for up to %lld s\n", signal,
              static_cast<long long>(drain_timeout.count()));
  std::fflush(stdout);
  const bool drained = (*proxy)->drain(drain_timeout);
  const auto stats = (*proxy)->stats();
  proxy->reset();
  std::printf("rd2h proxy: stopped after %llu requests (%s)\n",
              static_cast<unsigned long long>(stats.requests),
              drained ? "all finished" : "the rest aborted");
  return 0;
}

}  // namespace rd2h::tools
