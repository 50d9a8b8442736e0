#include "transfer/ucx_context.h"

#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

namespace rd2h::transfer {

namespace {

// UCX settings for engines that move data over TCP, by the name ucp_config_modify takes
// (the environment variable is UCX_<name>, except that TCP_ options take it without TCP_).
struct UcxSetting {
  const char* name;
  const char* env;
  const char* value;
};
constexpr UcxSetting kTcpTuning[] = {
    {"TX_SEG_SIZE", "UCX_TCP_TX_SEG_SIZE", "1M"},
    {"RX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE", "2M"},
    {"ZCOPY_THRESH", "UCX_ZCOPY_THRESH", "inf"},
};

bool host_has_rdma() {
  std::error_code ec;
  std::filesystem::directory_iterator it("/sys/class/infiniband", ec);
  return !ec && it != std::filesystem::directory_iterator();
}

// The network interface that holds `host` (an address, or "localhost").
Expected<std::string> interface_of(const std::string& host) {
  addrinfo hints{};
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0 || found == nullptr) {
    return invalid_argument("cannot resolve the listen address " + host);
  }
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) != 0) {
    freeaddrinfo(found);
    return internal_error(std::string("getifaddrs: ") + std::strerror(errno));
  }
  std::string device;
  for (addrinfo* a = found; a != nullptr && device.empty(); a = a->ai_next) {
    for (ifaddrs* i = ifs; i != nullptr; i = i->ifa_next) {
      if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != a->ai_family) continue;
      const bool same =
          a->ai_family == AF_INET
              ? reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr ==
                    reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr.s_addr
              : a->ai_family == AF_INET6 &&
                    std::memcmp(&reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr,
                                &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr,
                                sizeof(in6_addr)) == 0;
      if (same) {
        device = i->ifa_name;
        break;
      }
    }
  }
  freeifaddrs(ifs);
  freeaddrinfo(found);
  if (device.empty()) {
    return invalid_argument("no network interface of this host has the address " + host);
  }
  return device;
}

}  // namespace

Expected<UcxContext> create_ucx_context(const EngineConfig& config) {
  ucp_config_t* read = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &read);
  if (st != UCS_OK) return ucs_error("ucp_config_read", st);
  const UcxConfig cfg(read);
  const char* tls = nullptr;
  if (config.transport == Transport::kShm) tls = "sm";
  if (config.transport == Transport::kTcp) tls = "tcp";
  if (tls != nullptr) {
    st = ucp_config_modify(cfg.get(), "TLS", tls);
    if (st != UCS_OK) return ucs_error("setting UCX transports", st);
  }
  // A wildcard listen address names no device: UCX chooses among them all.
  const std::string& h = config.listen_host;
  const bool wildcard = h.empty() || h == "0.0.0.0" || h == "::" || h == "[::]";
  if (!wildcard && std::getenv("UCX_NET_DEVICES") == nullptr) {
    RD2H_TRY(device, interface_of(config.listen_host));
    st = ucp_config_modify(cfg.get(), "NET_DEVICES", device.c_str());
    if (st != UCS_OK) return ucs_error("setting UCX's network device to " + device, st);
  }
  // Reads over TCP are active messages of at most one TX segment each (8 KiB by default);
  // larger segments cut per-message overhead several-fold. Zero-copy sends are off: UCX
  // 1.13 aborts a process whose TCP zero-copy sends are purged when a reader vanishes.
  // Without RDMA, "auto" reaches other hosts over TCP and gets the same settings.
  const bool over_tcp = config.transport == Transport::kTcp ||
                        (config.transport == Transport::kAuto && !host_has_rdma());
  if (over_tcp) {
    for (const auto& setting : kTcpTuning) {
      if (std::getenv(setting.env) != nullptr) continue;
      st = ucp_config_modify(cfg.get(), setting.name, setting.value);
      if (st != UCS_OK) return ucs_error(std::string("setting ") + setting.env, st);
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 1;
  ucp_context_h context = nullptr;
  st = ucp_init(&params, cfg.get(), &context);
  if (st != UCS_OK) {
    return ucs_error("ucp_init (transport " + std::string(to_string(config.transport)) + ")", st);
  }
  return UcxContext(context);
}

}  // namespace rd2h::transfer
