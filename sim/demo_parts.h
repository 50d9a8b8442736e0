// The parts of `rd2h demo`, a file each: the processes of a run and their secrets
// (demo_launch.cc), the workload and its client (demo_workload.cc), the settings
// (demo_config.cc). demo.cc runs them in order.
#pragma once

#include <httplib.h>
#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "rd2h/common/status.h"
#include "sim/demo.h"
#include "sim/demo_report.h"
#include "util/subprocess.h"

namespace rd2h::sim::demo {

using namespace std::chrono_literals;

inline constexpr auto kStartTimeout = 180s;  // a large Decode pool takes a while to lock
inline constexpr auto kStopTimeout = 60s;

std::string join(const std::vector<std::string>& v, const char* sep);

// The secrets of one run, in a private 0700 directory the children are pointed at, removed
// at the end: a random bearer token, and a CURVE key pair for every engine instance, each
// side trusting the public keys of the other side's instances.
struct RunSecrets {
  std::string dir, file, token;
  RunSecrets() = default;
  RunSecrets(const RunSecrets&) = delete;
  RunSecrets& operator=(const RunSecrets&) = delete;
  ~RunSecrets();
  Status create(int instances);
  std::string secret_key_file(const char* role, int instance) const {
    return stem(role, instance) + ".key_secret";
  }
  // The public keys `role`'s instances trust: those of every instance of the other side.
  std::string trusted_by(const char* role) const { return dir + "/trusted-by-" + role; }

 private:
  std::string stem(const char* role, int instance) const {
    return dir + "/" + role + "-" + std::to_string(instance);
  }
};

// A child of the run that serves HTTP.
struct Server {
  std::string name;
  Subprocess process;
  std::string origin;  // http://host:port
  std::string extra;   // the rest of its "serving" line
};

// Starts `rd2h <args>` (behind `wrapper`) and waits for its "serving http://..." line.
Expected<Server> launch(const std::string& name, const std::string& wrapper,
                        const std::vector<std::string>& args);
// SIGTERM, then its exit within kStopTimeout (or SIGKILL); an error unless it exited 0.
Status stop(Server& s);

// An engine instance's kv_transfer_config: its control channels are authenticated with the
// run's keys.
std::string kv_config(const char* role, int instance, int port, const std::string& host,
                      const DemoOptions& o, const RunSecrets& secrets);
// The command line of an engine instance (`rd2h prefill|decode ...`).
std::vector<std::string> engine_args(const char* command, int tp, const std::string& host,
                                     const std::string& kv, const DemoOptions& o,
                                     const RunSecrets& secrets);
// An engine's report (GET /rd2h/report) as the run's figures take it.
Expected<EngineTrace> collect(const Server& s, const std::string& role, int instance, int tp,
                              bool quiet, const RunSecrets& secrets);

// Watches the demo's children while it runs: the first that ends fails the run at once,
// named, and the requests in flight are cut instead of waiting out their timeouts.
class Watch {
 public:
  // `servers` are touched by nothing else until stop().
  explicit Watch(std::vector<Server*> servers)
      : servers_(std::move(servers)), thread_([this] { run(); }) {}
  ~Watch() { stop(); }
  Watch(const Watch&) = delete;
  Watch& operator=(const Watch&) = delete;

  // A request's client, cut if a child dies; false once one has (the request must not
  // leave).
  bool add(httplib::Client* c);
  void remove(httplib::Client* c);
  // Which child died and how; empty while all live.
  std::string death() const;
  void stop();

 private:
  void run();
  // Whether a child ended; if so it is named and the requests in flight are cut. Holds mu_.
  bool sweep();

  std::vector<Server*> servers_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::string death_;
  std::set<httplib::Client*> clients_;
  std::thread thread_;  // last: it starts once the rest is set up
};

// Each child's private memory over the run: at the start of the workload, half-way, at the
// end, and its peak. Flat memory grows little from half-way to the end.
class MemoryWatch {
 public:
  explicit MemoryWatch(const std::vector<Server*>& servers);
  // `half_way`: half of the workload is done.
  void sample(bool half_way);
  std::string report() const;

 private:
  struct Row {
    std::string name;
    pid_t pid;
    uint64_t first, half, peak, last;
  };
  std::vector<Row> rows_;
};

// One client request of the workload.
struct Request {
  std::string id;
  std::vector<std::vector<int64_t>> prompts;
  bool list = false;
};

// Blocks a prompt of `tokens` holds on Decode.
uint64_t demo_blocks(uint64_t tokens, const DemoOptions& o);
// The run's requests, from its seed.
std::vector<Request> workload(const DemoOptions& o);
// Sends one request through the proxy, streaming, and checks that Decode verified every
// block of every layer of every prompt.
ClientRecord send(const std::string& proxy, const Request& r, const DemoOptions& o, Watch& watch);

// Whether the settings make a run that can work, or why not.
Status check_options(const DemoOptions& o);

}  // namespace rd2h::sim::demo
