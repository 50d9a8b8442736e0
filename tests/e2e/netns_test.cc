// Prefill and Decode on two "hosts": two network namespaces joined by a veth pair, created
// here. The demo (its client, the proxy and Decode) runs in one namespace and starts
// Prefill in the other; KV and control cross the veth link over UCX TCP and ZeroMQ. Skipped where
// the machine does not allow network namespaces.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <regex>

#include "support/rd2h_run.h"

namespace rd2h {
namespace {

int sh(const std::string& command) {
  return std::system((command + " >/dev/null 2>&1").c_str());
}

// Two namespaces and the veth pair between them; deleting the namespaces deletes the pair.
class TwoHosts {
 public:
  TwoHosts() {
    const std::string id = std::to_string(getpid());
    prefill_ = "rd2hP" + id;
    decode_ = "rd2hD" + id;
    veth_prefill_ = "r2p" + id;
    veth_decode_ = "r2d" + id;
    if (geteuid() != 0) {
      why_ = "network namespaces need root";
      return;
    }
    if (sh("ip netns add " + prefill_) != 0) {
      why_ = "this machine does not allow creating network namespaces (ip netns add failed)";
      return;
    }
    created_ = true;
    const std::vector<std::string> steps = {
        "ip netns add " + decode_,
        "ip link add " + veth_prefill_ + " type veth peer name " + veth_decode_,
        "ip link set " + veth_prefill_ + " netns " + prefill_,
        "ip link set " + veth_decode_ + " netns " + decode_,
        "ip -n " + prefill_ + " addr add " + kPrefillIp + "/24 dev " + veth_prefill_,
        "ip -n " + decode_ + " addr add " + kDecodeIp + "/24 dev " + veth_decode_,
        "ip -n " + prefill_ + " link set " + veth_prefill_ + " up",
        "ip -n " + decode_ + " link set " + veth_decode_ + " up",
        "ip -n " + prefill_ + " link set lo up",
        "ip -n " + decode_ + " link set lo up"};
    for (const auto& step : steps) {
      if (sh(step) != 0) {
        why_ = "cannot set up the veth pair (" + step + " failed)";
        return;
      }
    }
  }
  ~TwoHosts() {
    if (created_) {
      sh("ip netns del " + prefill_);
      sh("ip netns del " + decode_);
    }
  }
  const std::string& unavailable() const { return why_; }
  uint64_t decode_rx_bytes() const {
    const std::string command =
        "ip netns exec " + decode_ + " cat /sys/class/net/" + veth_decode_ + "/statistics/rx_bytes";
    FILE* out = popen(command.c_str(), "r");
    if (out == nullptr) return 0;
    unsigned long long n = 0;
    if (std::fscanf(out, "%llu", &n) != 1) n = 0;
    pclose(out);
    return n;
  }

  static constexpr const char* kPrefillIp = "10.199.7.1";
  static constexpr const char* kDecodeIp = "10.199.7.2";
  std::string prefill_, decode_, veth_prefill_, veth_decode_;

 private:
  bool created_ = false;
  std::string why_;
};

TEST(TwoHosts, TheDemoWorkloadRunsAcrossAVethLinkVerifiedByteForByte) {
  TwoHosts hosts;
  if (!hosts.unavailable().empty()) GTEST_SKIP() << hosts.unavailable();
  const uint64_t rx_before = hosts.decode_rx_bytes();
  const ToolRun run =
      run_rd2h({"demo", "--config", std::string(RD2H_SOURCE_DIR) + "/examples/demo-small.json",
                "--transport", "tcp", "--host", TwoHosts::kDecodeIp, "--prefill-host",
                TwoHosts::kPrefillIp, "--prefill-wrapper", "ip netns exec " + hosts.prefill_},
               std::chrono::seconds(120), {"ip", "netns", "exec", hosts.decode_});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("OK: every byte of every prompt's KV was verified"), std::string::npos)
      << run.output;
  // Off loopback the connector refuses to run without keys: the demo's own authenticate it.
  EXPECT_NE(run.output.find("control channels CURVE"), std::string::npos) << run.output;
  std::smatch m;
  const std::regex moved(R"(KV moved +[0-9.]+ GB \(([0-9]+) bytes\))");
  ASSERT_TRUE(std::regex_search(run.output, m, moved)) << run.output;
  const uint64_t kv_bytes = std::stoull(m[1]);
  EXPECT_GT(kv_bytes, 0u);
  EXPECT_GE(hosts.decode_rx_bytes() - rx_before, kv_bytes)
      << "the KV Decode read came in over the veth link";
}

}  // namespace
}  // namespace rd2h
