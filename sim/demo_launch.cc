#include <fcntl.h>
#include <sys/random.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "rd2h/common/deadline.h"
#include "sim/demo_parts.h"
#include "sim/engine.h"

namespace rd2h::sim::demo {

using nlohmann::json;

namespace {

std::vector<std::string> words(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

// Writes a new file of `text` with `mode`; an existing one is not overwritten.
Status write_new(const std::string& path, const std::string& text, mode_t mode) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  if (fd < 0) return internal_error("cannot write the run's file " + path);
  const bool written = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  if (!written) return internal_error("cannot write the run's file " + path);
  return Status::ok();
}

// How a process ended, from its wait status.
std::string ended(int status) {
  return WIFSIGNALED(status) ? "signal " + std::to_string(WTERMSIG(status))
                             : "status " + std::to_string(WEXITSTATUS(status));
}

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

// A CURVE key pair written at `stem` by `rd2h keygen`, as an operator makes one; its public
// key.
Expected<std::string> keygen(const std::string& stem) {
  RD2H_TRY(p, Subprocess::spawn({self_executable(), "keygen", stem}));
  RD2H_TRY(out, p.read_all(kStartTimeout));
  RD2H_TRY(status, p.wait(kStopTimeout));
  constexpr std::string_view kSays = "public key ";
  const size_t at = out.rfind(kSays);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || at == std::string::npos) {
    return internal_error("rd2h keygen " + stem + " failed: " + out);
  }
  std::string key = out.substr(at + kSays.size());
  while (!key.empty() && std::isspace(static_cast<unsigned char>(key.back()))) key.pop_back();
  return key;
}

}  // namespace

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : sep) + s;
  return out;
}

RunSecrets::~RunSecrets() {
  std::error_code ignored;
  if (!dir.empty()) std::filesystem::remove_all(dir, ignored);
}

Status RunSecrets::create(int instances) {
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
  std::string tmpl =
      std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/rd2h-demo-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) {
    return internal_error("cannot create a private directory for the run's secrets");
  }
  dir = tmpl;
  file = dir + "/token";
  RD2H_RETURN_IF_ERROR(write_new(file, token + "\n", 0600));
  for (const char* role : {"prefill", "decode"}) {
    std::string publics;
    for (int i = 0; i < instances; ++i) {
      RD2H_TRY(public_key, keygen(stem(role, i)));
      publics += public_key + "\n";
    }
    RD2H_RETURN_IF_ERROR(write_new(
        trusted_by(role == std::string("prefill") ? "decode" : "prefill"), publics, 0644));
  }
  return Status::ok();
}

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
    a.insert(a.end(),
             {"--slots", s(o.slots), "--token-budget", s(o.token_budget), "--compute-ns-per-token",
              s(o.compute_ns_per_token), "--compute-min-layer-us", s(o.compute_min_layer_us)});
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

bool Watch::add(httplib::Client* c) {
  std::lock_guard lock(mu_);
  if (!death_.empty()) return false;
  clients_.insert(c);
  return true;
}

void Watch::remove(httplib::Client* c) {
  std::lock_guard lock(mu_);
  clients_.erase(c);
}

std::string Watch::death() const {
  std::lock_guard lock(mu_);
  return death_;
}

void Watch::stop() {
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

void Watch::run() {
  std::unique_lock lock(mu_);
  while (!cv_.wait_for(lock, 100ms, [&] { return stopping_; })) {
    if (sweep()) return;
  }
}

bool Watch::sweep() {
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

MemoryWatch::MemoryWatch(const std::vector<Server*>& servers) {
  for (const Server* s : servers) rows_.push_back({s->name, s->process.pid(), 0, 0, 0, 0});
}

void MemoryWatch::sample(bool half_way) {
  for (auto& r : rows_) {
    const uint64_t kib = private_kib(r.pid);
    if (kib == 0) continue;
    if (r.first == 0) r.first = kib;
    if (half_way && r.half == 0) r.half = kib;
    r.peak = std::max(r.peak, kib);
    r.last = kib;
  }
}

std::string MemoryWatch::report() const {
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

}  // namespace rd2h::sim::demo
