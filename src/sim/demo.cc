#include "sim/demo.h"

#include <fcntl.h>
#include <httplib.h>
#include <sys/random.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>

#include "common/subprocess.h"
#include "control/curve.h"
#include "rd2h/common/deadline.h"
#include "rd2h/metaserver/proxy.h"
#include "sim/engine.h"
#include "sim/stop_on_signal.h"

namespace rd2h::sim {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

constexpr auto kStartTimeout = 180s;  // a large Decode pool takes a while to lock
constexpr auto kStopTimeout = 60s;

std::vector<std::string> words(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : sep) + s;
  return out;
}

// The secrets of one run, in a private 0700 directory the children are pointed at, removed
// at the end: a random bearer token, and a CURVE key pair for every engine instance, each
// side trusting the public keys of the other side's instances.
struct RunSecrets {
  std::string dir, file, token;
  RunSecrets() = default;
  RunSecrets(const RunSecrets&) = delete;
  RunSecrets& operator=(const RunSecrets&) = delete;
  ~RunSecrets() {
    std::error_code ignored;
    if (!dir.empty()) std::filesystem::remove_all(dir, ignored);
  }
  Status create(int instances) {
    unsigned char bytes[32];
    if (::getrandom(bytes, sizeof(bytes), 0) != static_cast<ssize_t>(sizeof(bytes))) {
      return internal_error("no random bytes for the run's token");
    }
    static const char* hex = "0123456789abcdef";
    for (unsigned char b : bytes) {
      token.push_back(hex[b >> 4]);
      token.push_back(hex[b & 15]);
    }
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") +
                       "/rd2h-demo-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) {
      return internal_error("cannot create a private directory for the run's secrets");
    }
    dir = tmpl;
    file = dir + "/token";
    RD2H_RETURN_IF_ERROR(write_new(file, token + "\n", 0600));
    for (const char* role : {"prefill", "decode"}) {
      std::string publics;
      for (int i = 0; i < instances; ++i) {
        auto keys = control::generate_key_pair();
        if (!keys) return keys.status().with_context("the run's CURVE keys");
        RD2H_RETURN_IF_ERROR(control::write_key_pair(stem(role, i), *keys));
        publics += keys->public_key + "\n";
      }
      RD2H_RETURN_IF_ERROR(write_new(trusted_by(role == std::string("prefill") ? "decode"
                                                                               : "prefill"),
                                     publics, 0644));
    }
    return Status::ok();
  }
  std::string secret_key_file(const char* role, int instance) const {
    return stem(role, instance) + ".key_secret";
  }
  // The public keys `role`'s instances trust: those of every instance of the other side.
  std::string trusted_by(const char* role) const {
    return dir + "/trusted-by-" + role;
  }

 private:
  std::string stem(const char* role, int instance) const {
    return dir + "/" + role + "-" + std::to_string(instance);
  }
  static Status write_new(const std::string& path, const std::string& text, mode_t mode) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
    if (fd < 0) return internal_error("cannot write the run's file " + path);
    const bool written = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
    ::close(fd);
    if (!written) return internal_error("cannot write the run's file " + path);
    return Status::ok();
  }
};

struct Server {
  std::string name;
  Subprocess process;
  std::string origin;  // http://host:port
  std::string extra;   // the rest of its "serving" line
};

// Starts `rd2h <args>` (behind `wrapper`) and waits for its "serving http://..." line.
Expected<Server> launch(const std::string& name, const std::string& wrapper,
                        const std::vector<std::string>& args) {
  std::vector<std::string> argv = words(wrapper);
  argv.push_back(self_executable());
  argv.insert(argv.end(), args.begin(), args.end());
  if (!wrapper.empty()) {
    // A wrapper is looked up on PATH like a shell would.
    argv.insert(argv.begin(), {"/usr/bin/env"});
  }
  Subprocess::Options options;
  options.die_with_parent = true;  // launched from the thread that runs the demo
  auto p = Subprocess::spawn(argv, options);
  if (!p) return p.status().with_context("starting " + name);
  const Deadline deadline(kStartTimeout);
  for (;;) {
    auto line = p->read_line(std::chrono::milliseconds(deadline.remaining_ms()));
    if (!line) {
      return unreachable(name + " did not start (" + line.status().message() +
                         "); its errors are above");
    }
    const size_t at = line->find("serving http://");
    if (at == std::string::npos) continue;
    Server s{name, std::move(*p), {}, {}};
    const size_t begin = at + 8;
    const size_t end = line->find(' ', begin);
    s.origin = line->substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    s.extra = end == std::string::npos ? "" : line->substr(end + 1);
    return s;
  }
}

// How a process ended, from its wait status.
std::string ended(int status) {
  return WIFSIGNALED(status) ? "signal " + std::to_string(WTERMSIG(status))
                             : "status " + std::to_string(WEXITSTATUS(status));
}

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
  bool add(httplib::Client* c) {
    std::lock_guard lock(mu_);
    if (!death_.empty()) return false;
    clients_.insert(c);
    return true;
  }
  void remove(httplib::Client* c) {
    std::lock_guard lock(mu_);
    clients_.erase(c);
  }
  // Which child died and how; empty while all live.
  std::string death() const {
    std::lock_guard lock(mu_);
    return death_;
  }
  void stop() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (!thread_.joinable()) return;
    thread_.join();
    // A death the requests saw first (they fail at once through the proxy) is still named.
    std::lock_guard lock(mu_);
    if (death_.empty()) (void)sweep();
  }

 private:
  void run() {
    std::unique_lock lock(mu_);
    while (!cv_.wait_for(lock, 100ms, [&] { return stopping_; })) {
      if (sweep()) return;
    }
  }
  // Whether a child ended; if so it is named and the requests in flight are cut. Holds mu_.
  bool sweep() {
    for (Server* s : servers_) {
      auto status = s->process.wait(0ms);
      if (!status) continue;
      death_ = s->name + " (pid " + std::to_string(s->process.pid()) + ") ended with " +
               ended(*status) + " while the demo ran";
      std::fprintf(stderr, "rd2h demo: %s\n", death_.c_str());
      for (auto* c : clients_) c->stop();
      return true;
    }
    return false;
  }

  std::vector<Server*> servers_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::string death_;
  std::set<httplib::Client*> clients_;
  std::thread thread_;  // last: it starts once the rest is set up
};

// The private memory (RssAnon) of a process and of its children (an engine's TP ranks), in
// KiB, from /proc; 0 once it is gone. Shared pages (the Decode pool, mapped libraries) are
// left out: they fill up as the pool is touched and are no sign of a leak.
uint64_t private_kib(pid_t pid) {
  auto of = [](const std::string& proc) -> uint64_t {
    std::ifstream in(proc + "/status");
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("RssAnon:", 0) == 0) return std::strtoull(line.c_str() + 8, nullptr, 10);
    }
    return 0;
  };
  uint64_t total = of("/proc/" + std::to_string(pid));
  for (pid_t child : children_of(pid)) total += of("/proc/" + std::to_string(child));
  return total;
}

// Each child's private memory over the run: at the start of the workload, half-way, at the
// end, and its peak. Flat memory grows little from half-way to the end.
class MemoryWatch {
 public:
  explicit MemoryWatch(const std::vector<Server*>& servers) {
    for (const Server* s : servers) rows_.push_back({s->name, s->process.pid(), 0, 0, 0, 0});
  }
  // `half_way`: half of the workload is done.
  void sample(bool half_way) {
    for (auto& r : rows_) {
      const uint64_t kib = private_kib(r.pid);
      if (kib == 0) continue;
      if (r.first == 0) r.first = kib;
      if (half_way && r.half == 0) r.half = kib;
      r.peak = std::max(r.peak, kib);
      r.last = kib;
    }
  }
  std::string report() const {
    std::string out =
        "rd2h demo: private memory (RSS without shared pages) of each process with its TP "
        "ranks, at the start, half-way and the end of the workload (peak):";
    char line[256];
    for (const auto& r : rows_) {
      std::snprintf(line, sizeof(line), "\n  %-10s %8.1f MB -> %8.1f MB -> %8.1f MB (%.1f MB)",
                    r.name.c_str(), r.first / 1024.0, (r.half ? r.half : r.last) / 1024.0,
                    r.last / 1024.0, r.peak / 1024.0);
      out += line;
    }
    return out;
  }

 private:
  struct Row {
    std::string name;
    pid_t pid;
    uint64_t first, half, peak, last;
  };
  std::vector<Row> rows_;
};

Status stop(Server& s) {
  s.process.kill(SIGTERM);
  auto status = s.process.wait(kStopTimeout);
  if (!status) {
    s.process.kill(SIGKILL);
    (void)s.process.wait(10s);
    return timeout_error(s.name + " did not stop within " + std::to_string(kStopTimeout.count()) +
                         " s of SIGTERM");
  }
  if (!WIFEXITED(*status) || WEXITSTATUS(*status) != 0) {
    return internal_error(s.name + " stopped with " + ended(*status));
  }
  return Status::ok();
}

struct Request {
  std::string id;
  std::vector<std::vector<int64_t>> prompts;
  bool list = false;
};

// Blocks a prompt of `tokens` holds on Decode.
uint64_t demo_blocks(uint64_t tokens, const DemoOptions& o) {
  return (tokens + o.output_tokens + o.block_size - 1) / o.block_size;
}

std::vector<Request> workload(const DemoOptions& o) {
  std::mt19937_64 rng(o.seed);
  std::uniform_real_distribution<double> unit(0, 1);
  std::uniform_int_distribution<int64_t> token(1, 50000);
  auto length = [&](uint32_t i, uint32_t k) -> uint64_t {
    // The longest and the shortest prompt always occur; the rest are log-uniform between.
    if (i == 0 && k == 0) return o.max_tokens;
    if (i == 1 && k == 0) return o.min_tokens;
    const double lo = std::log(static_cast<double>(o.min_tokens));
    const double hi = std::log(static_cast<double>(o.max_tokens));
    return static_cast<uint64_t>(std::exp(lo + (hi - lo) * unit(rng)));
  };
  std::vector<Request> out;
  for (uint32_t i = 0; i < o.requests; ++i) {
    Request r;
    r.id = "demo-" + std::to_string(o.seed) + "-" + std::to_string(i);
    r.list = i > 1 && unit(rng) < o.prompt_list_share;
    const uint32_t n = r.list ? std::max(2u, o.prompt_list_size) : 1;
    // Decode holds a list's prompts at once: together they fit its pool (it refuses a list
    // that never could), so a later prompt is cut short where the earlier ones took room.
    uint64_t room = o.num_blocks;
    for (uint32_t k = 0; k < n; ++k) {
      uint64_t tokens = std::max<uint64_t>(1, length(i, k));
      if (r.list) {
        const uint64_t kept = (n - 1 - k) * demo_blocks(o.min_tokens, o);  // for the rest
        tokens = std::min(tokens, (room - kept) * o.block_size - o.output_tokens);
        room -= demo_blocks(tokens, o);
      }
      std::vector<int64_t> p(tokens);
      for (auto& t : p) t = token(rng);
      r.prompts.push_back(std::move(p));
    }
    out.push_back(std::move(r));
  }
  return out;
}

// Sends one request through the proxy, streaming, and checks that Decode verified every
// block of every layer of every prompt.
ClientRecord send(const std::string& proxy, const Request& r, const DemoOptions& o, Watch& watch) {
  ClientRecord rec;
  rec.id = r.id;
  rec.prompts = r.prompts.size();
  uint64_t blocks = 0;
  for (const auto& p : r.prompts) {
    rec.tokens += p.size();
    blocks += (p.size() + o.block_size - 1) / o.block_size;
  }
  const uint64_t expected = blocks * static_cast<uint64_t>(o.layers);
  json body = {{"model", "rd2h-sim"}, {"max_tokens", o.output_tokens}, {"stream", true}};
  body["prompt"] = r.list ? json(r.prompts) : json(r.prompts.front());
  httplib::Client client(proxy);
  client.set_connection_timeout(10);
  client.set_read_timeout(static_cast<time_t>(o.timeout_s));
  if (!watch.add(&client)) {
    rec.error = watch.death();
    return rec;
  }
  std::string received;
  rec.start_us = trace::now_us();
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.headers = {{"X-Request-Id", r.id}};
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    if (rec.first_byte_us == 0) rec.first_byte_us = trace::now_us();
    received.append(data, n);
    return true;
  };
  auto res = client.send(req);
  rec.end_us = trace::now_us();
  watch.remove(&client);
  if (const std::string death = watch.death(); !death.empty() && (!res || res->status != 200)) {
    rec.error = death;
    return rec;
  }
  if (!res) {
    rec.error = "no answer from the proxy: " + httplib::to_string(res.error());
    return rec;
  }
  if (res->status != 200) {
    rec.error = "HTTP " + std::to_string(res->status) + ": " + received.substr(0, 500);
    return rec;
  }
  if (const json whole = json::parse(received, nullptr, false);
      whole.is_object() && whole.contains("error")) {
    rec.error = whole["error"].value("message", whole["error"].dump());
    return rec;
  }
  std::optional<uint64_t> verified;
  size_t pos = 0;
  while ((pos = received.find("data: ", pos)) != std::string::npos) {
    const size_t end = received.find("\n\n", pos);
    const std::string data =
        received.substr(pos + 6, end == std::string::npos ? end : end - pos - 6);
    pos = end == std::string::npos ? received.size() : end;
    if (data == "[DONE]") continue;
    const json event = json::parse(data, nullptr, false);
    if (event.is_discarded()) continue;
    if (event.contains("error")) {
      rec.error = event["error"].value("message", event["error"].dump());
      return rec;
    }
    if (event.contains("rd2h")) verified = event["rd2h"].value("verified_blocks", uint64_t{0});
  }
  if (!verified) {
    rec.error = "the stream ended without Decode's verification: " + received.substr(0, 200);
  } else if (*verified != expected) {
    rec.error = "Decode verified " + std::to_string(*verified) + " of " + std::to_string(expected) +
                " block-layers";
  } else {
    rec.ok = true;
  }
  return rec;
}

Expected<EngineTrace> collect(const Server& s, const std::string& role, int instance, int tp,
                              bool quiet, const RunSecrets& token) {
  httplib::Client c(s.origin);
  c.set_read_timeout(60);
  auto r = c.Get("/rd2h/report", {{"Authorization", "Bearer " + token.token}});
  if (!r || r->status != 200) return unreachable("no report from " + s.name);
  auto report = parse_report(r->body);
  if (!report) return report.status().with_context(s.name);
  if (report->events_dropped > 0) {
    std::fprintf(stderr, "rd2h demo: %s dropped %llu timeline events\n", s.name.c_str(),
                 static_cast<unsigned long long>(report->events_dropped));
  }
  if (role == "decode" && !quiet) {
    std::printf("rd2h demo: %s verified %llu block-layers; its main pool was %s\n", s.name.c_str(),
                static_cast<unsigned long long>(report->stats.verified_blocks),
                report->stats.main_pool_locked ? "locked in memory"
                                               : "not locked in memory (not permitted here)");
  }
  return EngineTrace{role, instance, tp, std::move(report->events)};
}

// An engine instance's kv_transfer_config: its control channels are authenticated with the
// run's keys.
std::string kv_config(const char* role, int instance, int port, const std::string& host,
                      const DemoOptions& o, const RunSecrets& secrets) {
  const bool prefill = role == std::string("prefill");
  return json{{"kv_connector", "rd2h"},
              {"kv_role", prefill ? "kv_producer" : "kv_consumer"},
              {"kv_port", port},
              {"kv_ip", host},
              {"engine_id", std::string(role) + "-" + std::to_string(instance)},
              {"kv_connector_extra_config",
               {{"transport", o.transport},
                {"prefill_tp_size", o.prefill_tp},
                {"curve_secret_key_file", secrets.secret_key_file(role, instance)},
                {"curve_trusted_keys_file", secrets.trusted_by(role)}}}}
      .dump();
}

std::vector<std::string> engine_args(const char* command, int tp, const std::string& host,
                                     const std::string& kv, const DemoOptions& o,
                                     const RunSecrets& token) {
  auto s = [](auto v) { return std::to_string(v); };
  std::vector<std::string> bpt;
  for (auto b : o.bytes_per_token) bpt.push_back(s(b));
  std::vector<std::string> a = {command,
                                "--host",
                                host,
                                "--tp",
                                s(tp),
                                "--layers",
                                s(o.layers),
                                "--block-size",
                                s(o.block_size),
                                "--num-blocks",
                                s(o.num_blocks),
                                "--bytes-per-token",
                                join(bpt, ","),
                                "--kv-transfer-config",
                                kv};
  if (command == std::string("prefill")) {  // how Prefill computes
    a.insert(a.end(), {"--slots", s(o.slots), "--token-budget", s(o.token_budget),
                       "--compute-ns-per-token", s(o.compute_ns_per_token),
                       "--compute-min-layer-us", s(o.compute_min_layer_us)});
    if (o.test_corrupt_layer >= 0) {
      a.insert(a.end(), {"--test-corrupt-layer", s(o.test_corrupt_layer)});
    }
  }
  if (o.timeline) a.push_back("--trace");
  // The workload's lists and prompts fit the engines' limits.
  a.insert(a.end(), {"--token-file", token.file, "--max-prompts",
                     s(std::max<uint64_t>(1024, o.prompt_list_size)), "--max-prompt-tokens",
                     s(std::max<uint64_t>(262144, o.max_tokens))});
  return a;
}

Status check_options(const DemoOptions& o) {
  if (o.layers < 1 || o.block_size == 0 || o.num_blocks == 0 || o.bytes_per_token.size() < 2) {
    return invalid_argument(
        "model: layers, block size, blocks and K, V bytes per token are needed");
  }
  if (o.min_tokens == 0 || o.min_tokens > o.max_tokens) {
    return invalid_argument("workload: need 1 <= --min-tokens (" + std::to_string(o.min_tokens) +
                            ") <= --max-tokens (" + std::to_string(o.max_tokens) + ")");
  }
  const uint64_t need = demo_blocks(o.max_tokens, o);
  if (need > o.num_blocks) {
    return invalid_argument("a " + std::to_string(o.max_tokens) + "-token prompt needs " +
                            std::to_string(need) + " blocks, and --num-blocks is " +
                            std::to_string(o.num_blocks));
  }
  const uint64_t list = std::max(2u, o.prompt_list_size);
  if (o.prompt_list_share > 0 && list * demo_blocks(o.min_tokens, o) > o.num_blocks) {
    return invalid_argument(
        "a list of " + std::to_string(list) + " prompts of " + std::to_string(o.min_tokens) +
        " tokens needs " + std::to_string(list * demo_blocks(o.min_tokens, o)) +
        " blocks at once on Decode, and --num-blocks is " + std::to_string(o.num_blocks));
  }
  if (!o.timeline && !o.trace_file.empty()) {
    return invalid_argument("--trace needs the timeline: drop --no-timeline or --trace");
  }
  if (o.requests == 0 || o.concurrency == 0) {
    return invalid_argument("workload: --requests and --concurrency must be at least 1");
  }
  if (o.dp < 1) return invalid_argument("--dp must be at least 1");
  if (o.token_budget == 0) return invalid_argument("--token-budget must be at least 1");
  return Status::ok();
}

// A whole number from `lo` to `hi` (JSON integers only: 1.5, 1e59, "7" and -1 for an
// unsigned setting are refused), or why not, naming the key.
template <typename T>
Status whole(const json& v, const std::string& key, uint64_t lo, uint64_t hi, T& out) {
  auto refuse = [&] {
    return invalid_argument("'" + key + "' must be a whole number from " + std::to_string(lo) +
                            " to " + std::to_string(hi) + ", not " + v.dump());
  };
  if (!v.is_number_integer()) return refuse();
  if (!v.is_number_unsigned() && v.get<int64_t>() < 0) return refuse();
  const uint64_t n = v.get<uint64_t>();
  if (n < lo || n > hi) return refuse();
  out = static_cast<T>(n);
  return Status::ok();
}

Status string_value(const json& v, const std::string& key, std::string& out) {
  if (!v.is_string()) return invalid_argument("'" + key + "' must be a string, not " + v.dump());
  out = v.get<std::string>();
  return Status::ok();
}

}  // namespace

Status apply_demo_config_text(const std::string& text, const std::string& source,
                              DemoOptions& o,
                              const std::function<bool(const std::string&)>& given) {
  const json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return invalid_argument("demo config " + source + " is not a JSON object");
  }
  constexpr uint64_t kU32 = UINT32_MAX;
  using Setter = std::function<Status(const json&, const std::string&)>;
  auto number = [](auto& field, uint64_t lo, uint64_t hi) -> Setter {
    return [&field, lo, hi](const json& v, const std::string& key) {
      return whole(v, key, lo, hi, field);
    };
  };
  auto str = [](std::string& field) -> Setter {
    return [&field](const json& v, const std::string& key) { return string_value(v, key, field); };
  };
  const std::map<std::string, Setter> setters = {
      {"prefill-tp", number(o.prefill_tp, 1, 64)},
      {"decode-tp", number(o.decode_tp, 1, 64)},
      {"dp", number(o.dp, 1, 16)},
      {"host", str(o.host)},
      {"prefill-host", str(o.prefill_host)},
      {"decode-host", str(o.decode_host)},
      {"proxy-port", number(o.proxy_port, 0, 65535)},
      {"metaserver-port", number(o.metaserver_port, 0, 65535)},
      {"kv-port", number(o.kv_port, 0, 65535)},
      {"transport",
       [&](const json& v, const std::string& key) {
         if (!v.is_string() || (v != "shm" && v != "tcp" && v != "auto")) {
           return invalid_argument("'" + key + "' must be \"shm\", \"tcp\" or \"auto\", not " +
                                   v.dump());
         }
         o.transport = v.get<std::string>();
         return Status::ok();
       }},
      {"layers", number(o.layers, 1, 1024)},
      {"block-size", number(o.block_size, 1, 1u << 20)},
      {"bytes-per-token",
       [&](const json& v, const std::string& key) {
         if (!v.is_array() || v.size() < 2 || v.size() > 4) {
           return invalid_argument("'" + key +
                                   "' must be a list of 2 to 4 whole numbers (K, V, indexer[, "
                                   "scale]), not " +
                                   v.dump());
         }
         std::vector<uint64_t> sizes(v.size());
         for (size_t i = 0; i < v.size(); ++i) {
           if (Status st = whole(v[i], key + "[" + std::to_string(i) + "]", 1, 1u << 24, sizes[i]);
               !st) {
             return st;
           }
         }
         o.bytes_per_token = std::move(sizes);
         return Status::ok();
       }},
      {"num-blocks", number(o.num_blocks, 1, 1u << 24)},
      {"slots", number(o.slots, 0, 1024)},
      {"token-budget", number(o.token_budget, 1, kU32)},
      {"compute-ns-per-token", number(o.compute_ns_per_token, 0, 1'000'000'000)},
      {"compute-min-layer-us", number(o.compute_min_layer_us, 0, 60'000'000)},
      {"requests", number(o.requests, 1, 100'000'000)},
      {"min-tokens", number(o.min_tokens, 1, 1u << 30)},
      {"max-tokens", number(o.max_tokens, 1, 1u << 30)},
      {"concurrency", number(o.concurrency, 1, 65536)},
      {"prompt-list-share",
       [&](const json& v, const std::string& key) {
         if (!v.is_number() || !(v.get<double>() >= 0.0 && v.get<double>() <= 1.0)) {
           return invalid_argument("'" + key + "' must be a number from 0 to 1, not " +
                                   v.dump());
         }
         o.prompt_list_share = v.get<double>();
         return Status::ok();
       }},
      {"prompt-list-size", number(o.prompt_list_size, 1, 65536)},
      {"output-tokens", number(o.output_tokens, 0, 1u << 20)},
      {"seed", number(o.seed, 0, UINT64_MAX)},
      {"timeout", number(o.timeout_s, 1, 7 * 86400)},
      {"trace", str(o.trace_file)},
      {"timeline",
       [&](const json& v, const std::string& key) {
         if (!v.is_boolean()) return invalid_argument("'" + key + "' must be true or false");
         o.timeline = v.get<bool>();
         return Status::ok();
       }},
  };
  for (const auto& [raw, value] : j.items()) {
    std::string key = raw;
    std::replace(key.begin(), key.end(), '_', '-');
    auto it = setters.find(key);
    if (it == setters.end()) {
      return invalid_argument("demo config " + source + ": '" + raw + "' is not a demo setting");
    }
    if (given(key)) continue;  // the command line wins
    if (Status st = it->second(value, raw); !st) {
      return invalid_argument("demo config " + source + ": " + st.message());
    }
  }
  return Status::ok();
}

Status apply_demo_config(const std::string& path, DemoOptions& o,
                         const std::function<bool(const std::string&)>& given) {
  std::ifstream in(path);
  if (!in) return not_found("demo config " + path + " cannot be read");
  std::stringstream text;
  text << in.rdbuf();
  return apply_demo_config_text(text.str(), path, o, given);
}

Expected<DemoSummary> run_demo_once(const DemoOptions& options) {
  DemoOptions o = options;
  if (o.prefill_host.empty()) o.prefill_host = o.host;
  if (o.decode_host.empty()) o.decode_host = o.host;
  auto say = [&](const std::string& line) {
    if (!o.quiet) std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  };
  auto fail = [](const std::string& why) -> Expected<DemoSummary> { return internal_error(why); };
  if (Status st = check_options(o); !st) return st;

  RunSecrets token;
  if (Status st = token.create(o.dp); !st) return st;
  const std::vector<Request> requests = workload(o);
  uint64_t total_tokens = 0, prompts = 0;
  for (const auto& r : requests) {
    prompts += r.prompts.size();
    for (const auto& p : r.prompts) total_tokens += p.size();
  }
  uint64_t per_token = 0;
  for (auto b : o.bytes_per_token) per_token += b;
  const double pool_gb = static_cast<double>(o.layers) *
                         static_cast<double>(o.bytes_per_token[0] + o.bytes_per_token[1]) *
                         static_cast<double>(o.block_size * o.num_blocks) / 1e9;
  char head[512];
  std::snprintf(head, sizeof(head),
                "rd2h demo: Prefill TP %d x %d, Decode TP %d x %d, %d layers, %llu bytes of KV "
                "per token per layer, Decode main pool %.2f GB per instance, transport %s",
                o.prefill_tp, o.dp, o.decode_tp, o.dp, o.layers,
                static_cast<unsigned long long>(per_token), pool_gb, o.transport.c_str());
  say(head);
  std::snprintf(head, sizeof(head),
                "rd2h demo: workload %u requests (%llu prompts, %llu tokens, %llu..%llu per "
                "prompt), %u at a time",
                o.requests, static_cast<unsigned long long>(prompts),
                static_cast<unsigned long long>(total_tokens),
                static_cast<unsigned long long>(o.min_tokens),
                static_cast<unsigned long long>(o.max_tokens), o.concurrency);
  say(head);

  // Decode first (the proxy needs every origin), each on a free range of kv ports.
  std::vector<Server> decode, prefill;
  std::mt19937 port_rng(std::random_device{}());
  for (int i = 0; i < o.dp; ++i) {
    Expected<Server> s = internal_error("not started");
    for (int attempt = 0; attempt < (o.kv_port == 0 ? 8 : 1) && !s; ++attempt) {
      const int base =
          o.kv_port != 0 ? o.kv_port + i * o.decode_tp
                         : std::uniform_int_distribution<int>(20000, 60000 - o.decode_tp)(port_rng);
      s = launch(
          "Decode " + std::to_string(i), o.decode_wrapper,
          engine_args(
              "decode", o.decode_tp, o.decode_host,
              kv_config("decode", i, base, o.decode_host, o, token), o, token));
    }
    if (!s) return fail(s.status().message());
    say("rd2h demo: Decode " + std::to_string(i) + " at " + s->origin + " " + s->extra);
    decode.push_back(std::move(*s));
  }
  for (int i = 0; i < o.dp; ++i) {
    auto s = launch(
        "Prefill " + std::to_string(i), o.prefill_wrapper,
        engine_args("prefill", o.prefill_tp, o.prefill_host,
                    kv_config("prefill", i, 1, o.prefill_host, o, token), o, token));
    if (!s) return fail(s.status().message());
    say("rd2h demo: Prefill " + std::to_string(i) + " at " + s->origin + " " + s->extra);
    prefill.push_back(std::move(*s));
  }
  std::vector<std::string> proxy_args = {"proxy",
                                         "--host",
                                         o.host,
                                         "--port",
                                         std::to_string(o.proxy_port),
                                         "--metaserver-port",
                                         std::to_string(o.metaserver_port)};
  std::vector<std::string> origins;
  for (auto& s : prefill) origins.push_back(s.origin);
  proxy_args.insert(proxy_args.end(), {"--prefill", join(origins, ",")});
  origins.clear();
  for (auto& s : decode) origins.push_back(s.origin);
  proxy_args.insert(proxy_args.end(),
                    {"--decode", join(origins, ","), "--max-body-bytes", std::to_string(64u << 20),
                     "--token-file", token.file, "--max-prompts",
                     std::to_string(std::max<uint64_t>(1024, o.prompt_list_size)),
                     "--max-prompt-tokens", std::to_string(std::max<uint64_t>(262144, o.max_tokens)),
         "--drain-timeout", "5"});
  auto proxy = launch("the proxy", "", proxy_args);
  if (!proxy) return fail(proxy.status().message());
  say("rd2h demo: proxy at " + proxy->origin + " " + proxy->extra);
  std::vector<Server*> children = {&*proxy};
  for (auto* servers : {&prefill, &decode}) {
    for (auto& s : *servers) children.push_back(&s);
  }
  Watch watch(children);

  // Warm-up: the first request between a Prefill and a Decode instance connects their
  // engines (and maps Prefill's KV into Decode); that one-time cost is kept out of the
  // figures, whose timelines start after it. With several instances every pair gets its
  // request through a proxy of its own, since the main one picks pairs by load.
  for (size_t i = 0; i < prefill.size(); ++i) {
    for (size_t j = 0; j < decode.size(); ++j) {
      std::unique_ptr<metaserver::Proxy> pair;
      if (o.dp > 1) {
        metaserver::ProxyConfig pc;
        pc.host = o.host;
        pc.prefill = {prefill[i].origin};
        pc.decode = {decode[j].origin};
        pc.token = token.token;
        auto started = metaserver::Proxy::start(pc);
        if (!started) return fail(started.status().message());
        pair = std::move(*started);
      }
      const int n = static_cast<int>(i * decode.size() + j);
      Request warm{
          "warmup-" + std::to_string(n), {std::vector<int64_t>(o.block_size, 7 + n)}, false};
      const ClientRecord r = send(pair ? pair->url() : proxy->origin, warm, o, watch);
      if (!r.ok) return fail("warm-up request failed: " + r.error);
    }
  }
  for (const auto* servers : {&prefill, &decode}) {
    for (const auto& s : *servers) {
      if (auto t = collect(s, "", 0, 0, /*quiet=*/true, token); !t) {
        return fail(t.status().message());
      }
    }
  }

  // The workload, `concurrency` requests at a time, with progress once a second.
  std::vector<ClientRecord> records(requests.size());
  std::atomic<size_t> next{0}, done{0}, failed{0};
  std::atomic<uint64_t> tokens_done{0};
  std::vector<std::thread> clients;
  const auto started = std::chrono::steady_clock::now();
  for (uint32_t c = 0; c < std::min<uint32_t>(o.concurrency, o.requests); ++c) {
    clients.emplace_back([&] {
      // After the first failure no new request leaves: the run has failed already.
      for (size_t i; failed == 0 && (i = next++) < requests.size();) {
        records[i] = send(proxy->origin, requests[i], o, watch);
        if (!records[i].ok) {
          ++failed;
          std::fprintf(stderr, "rd2h demo: request %s failed: %s\n", records[i].id.c_str(),
                       records[i].error.c_str());
        }
        tokens_done += records[i].tokens;
        ++done;
      }
    });
  }
  std::mutex progress_mu;
  std::condition_variable progress_cv;
  bool finished = false;
  MemoryWatch memory(children);
  memory.sample(false);
  std::thread progress([&] {
    std::unique_lock lock(progress_mu);
    while (!progress_cv.wait_for(lock, 1s, [&] { return finished; })) {
      memory.sample(2 * done.load() >= requests.size());
      if (o.quiet) continue;
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      std::printf("rd2h demo: %5.1f s  %zu/%zu requests  %llu/%llu prompt tokens  %zu failed\n", s,
                  done.load(), requests.size(), static_cast<unsigned long long>(tokens_done.load()),
                  static_cast<unsigned long long>(total_tokens), failed.load());
      std::fflush(stdout);
    }
  });
  for (auto& t : clients) t.join();
  {
    std::lock_guard lock(progress_mu);
    finished = true;
  }
  progress_cv.notify_all();
  progress.join();
  memory.sample(true);
  watch.stop();  // from here on the processes are this thread's

  std::vector<EngineTrace> traces;
  std::vector<std::string> errors;
  if (const std::string death = watch.death(); !death.empty()) errors.push_back(death);
  // A failed run has no figures worth waiting for: an engine stuck on a dead peer answers
  // its report only once its own deadlines fire.
  for (const auto& [servers, role, tp] : {std::tuple{&prefill, "prefill", o.prefill_tp},
                                          std::tuple{&decode, "decode", o.decode_tp}}) {
    for (size_t i = 0; failed == 0 && i < servers->size(); ++i) {
      auto t = collect((*servers)[i], role, static_cast<int>(i), tp, o.quiet, token);
      if (!t) errors.push_back(t.status().message());
      if (t) traces.push_back(std::move(*t));
    }
  }
  // The proxy first, so that nothing new reaches the engines while they stop.
  std::vector<Server*> order = {&*proxy};
  for (auto* servers : {&prefill, &decode}) {
    for (auto& s : *servers) order.push_back(&s);
  }
  for (auto* s : order) {
    if (Status st = stop(*s); !st) errors.push_back(st.message());
  }

  // Requests never sent (the run stopped at a failure) are not in the figures.
  records.erase(std::remove_if(records.begin(), records.end(),
                               [](const ClientRecord& r) { return r.start_us == 0; }),
                records.end());
  const DemoSummary summary = summarize(traces, records);
  if (failed == 0) {
    say("\nrd2h demo: summary\n" + format_summary(summary));
    say(memory.report());
  }
  if (!o.trace_file.empty()) {
    std::ofstream out(o.trace_file);
    out << chrome_trace(traces, records);
    if (!out) {
      errors.push_back("cannot write the trace to " + o.trace_file);
    } else {
      say("rd2h demo: timeline written to " + o.trace_file + " (open it in ui.perfetto.dev)");
    }
  }
  if (summary.failed > 0) {
    errors.push_back(std::to_string(summary.failed) + " of " + std::to_string(summary.requests) +
                     " requests sent failed" +
                     (summary.requests < requests.size()
                          ? " (the other " + std::to_string(requests.size() - summary.requests) +
                                " were not sent)"
                          : ""));
  }
  if (!errors.empty()) return fail(join(errors, "; "));
  return summary;
}

int run_demo(const DemoOptions& options) {
  StopOnSignal stop(kStopTimeout);
  auto summary = run_demo_once(options);
  if (stop.signal() != 0) {
    std::fprintf(stderr, "rd2h demo: stopped by signal %d\n", stop.signal());
    return 128 + stop.signal();
  }
  if (!summary) {
    std::fprintf(stderr, "rd2h demo: FAILED: %s\n", summary.status().message().c_str());
    return 1;
  }
  if (!options.quiet) {
    std::printf("rd2h demo: OK: every byte of every prompt's KV was verified on Decode\n");
  }
  return 0;
}

int run_bench_demo(const BenchDemoOptions& options) {
  struct Row {
    std::string topology;
    DemoSummary s;
  };
  std::vector<Row> rows;
  StopOnSignal stop(kStopTimeout);
  for (const auto& t : options.topologies) {
    DemoOptions o = options.demo;
    const size_t colon = t.find(':');
    try {
      if (colon == std::string::npos) throw std::invalid_argument(t);
      o.prefill_tp = std::stoi(t.substr(0, colon));
      o.decode_tp = std::stoi(t.substr(colon + 1));
    } catch (const std::exception&) {
      std::fprintf(stderr, "rd2h bench demo: topology '%s' is not P:D (e.g. 4:2)\n", t.c_str());
      return 2;
    }
    o.quiet = true;
    std::printf("rd2h bench demo: Prefill TP %d, Decode TP %d ...\n", o.prefill_tp, o.decode_tp);
    std::fflush(stdout);
    auto s = run_demo_once(o);
    if (stop.signal() != 0) {
      std::fprintf(stderr, "rd2h bench demo: stopped by signal %d\n", stop.signal());
      return 128 + stop.signal();
    }
    if (!s) {
      std::fprintf(stderr, "rd2h bench demo: %s: %s\n", t.c_str(), s.status().message().c_str());
      return 1;
    }
    rows.push_back({t, *s});
  }
  std::printf(
      "\n| P:D | hidden | layer compute p50 | layer read p50 | last-layer read p50 | "
      "Decode-ready p50 (x last-layer read) | p99 | core pickup p50 | GB/s in flight | "
      "GB/s run | TTFT p50 | wall |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& r : rows) {
    const auto& s = r.s;
    std::printf(
        "| %s | %.1f%% | %.0f us | %.0f us | %.0f us | %.0f us (%.1fx) | %.0f us (%.1fx) | %.0f us "
        "| "
        "%.2f | %.2f | %.0f ms | %.1f s |\n",
        r.topology.c_str(), 100 * s.hidden, s.compute_p50_us, s.read_p50_us,
        s.last_layer_read_p50_us, s.ready_delay_p50_us, s.ready_ratio_p50, s.ready_delay_p99_us,
        s.ready_ratio_p99, s.pickup_delay_p50_us, s.link_gbps, s.aggregate_gbps, s.ttft_p50_ms,
        s.wall_s);
  }
  return 0;
}

}  // namespace rd2h::sim
