// The UCX engine listens only on the interface it was given.
#include <dirent.h>
#include <gtest/gtest.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>

#include "rd2h/transfer/transfer_engine.h"

namespace rd2h::transfer {
namespace {

using namespace std::chrono_literals;

// The socket inodes of this process's open descriptors.
std::set<std::string> socket_inodes() {
  std::set<std::string> out;
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return out;
  while (dirent* e = ::readdir(d)) {
    char target[256] = {};
    const std::string link = std::string("/proc/self/fd/") + e->d_name;
    const ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    std::string t(target, static_cast<size_t>(n));
    if (t.rfind("socket:[", 0) == 0) out.insert(t.substr(8, t.size() - 9));
  }
  ::closedir(d);
  return out;
}

// The local addresses (hex, as /proc/net/tcp* prints them) of this process's listening TCP
// sockets.
std::vector<std::string> listening_addresses() {
  const auto mine = socket_inodes();
  std::vector<std::string> out;
  for (const char* table : {"/proc/self/net/tcp", "/proc/self/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      f >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >>
          inode;
      if (state == "0A" && mine.count(inode) > 0) out.push_back(local.substr(0, local.find(':')));
    }
  }
  return out;
}

bool is_loopback_hex(const std::string& hex) {
  if (hex.size() == 8) return hex.substr(6) == "7F";  // 127.x.x.x, little-endian
  return hex == "00000000000000000000000001000000";   // ::1
}

bool host_has_other_interface() {
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) != 0) return false;
  bool other = false;
  for (ifaddrs* i = ifs; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr != nullptr && i->ifa_addr->sa_family == AF_INET &&
        std::string(i->ifa_name) != "lo") {
      other = true;
    }
  }
  freeifaddrs(ifs);
  return other;
}

std::unique_ptr<TransferEngine> tcp_engine(const std::string& listen_host) {
  EngineConfig cfg;
  cfg.role = Role::kPrefill;
  cfg.transport = Transport::kTcp;
  cfg.listen_host = listen_host;
  auto e = create_ucx_engine(cfg);
  EXPECT_TRUE(e) << e.status().to_string();
  return e ? std::move(*e) : nullptr;
}

TEST(UcxListen, AnEngineGivenLoopbackListensOnLoopbackOnly) {
  if (std::getenv("UCX_NET_DEVICES") != nullptr) GTEST_SKIP() << "UCX_NET_DEVICES is set";
  auto engine = tcp_engine("127.0.0.1");
  ASSERT_TRUE(engine);
  const auto listening = listening_addresses();
  EXPECT_FALSE(listening.empty()) << "the TCP transport opened no listener at all";
  for (const auto& a : listening) EXPECT_TRUE(is_loopback_hex(a)) << "listening on " << a;
  if (host_has_other_interface()) {
    // The same engine without the restriction listens beyond loopback: the check above
    // would have seen it.
    engine.reset();
    auto open = tcp_engine("");
    ASSERT_TRUE(open);
    const auto all = listening_addresses();
    EXPECT_TRUE(std::any_of(all.begin(), all.end(), [](auto& a) { return !is_loopback_hex(a); }));
  }
}

TEST(UcxListen, AnAddressNoInterfaceHoldsIsRefused) {
  EngineConfig cfg;
  cfg.role = Role::kPrefill;
  cfg.transport = Transport::kTcp;
  cfg.listen_host = "203.0.113.77";
  auto e = create_ucx_engine(cfg);
  ASSERT_FALSE(e);
  EXPECT_NE(e.status().message().find("203.0.113.77"), std::string::npos) << e.status().to_string();
}

}  // namespace
}  // namespace rd2h::transfer
