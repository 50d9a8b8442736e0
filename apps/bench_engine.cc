#include "bench_engine.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <thread>
#include <tuple>

#include "pd_read.h"
#include "peers.h"
#include "rd2h/common/deadline.h"
#include "util/metrics.h"
#include "util/pattern.h"

namespace rd2h::tools {

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::string size_text(uint64_t b) {
  if (b % (1 << 20) == 0) return std::to_string(b >> 20) + " MiB";
  if (b % (1 << 10) == 0) return std::to_string(b >> 10) + " KiB";
  return std::to_string(b) + " B";
}

// What one side of a measurement gave: GB/s over its timed batches, and each batch's time.
struct Sample {
  double gbs = 0;
  std::vector<double> batch_seconds;
};

// Runs `batch` (which returns the time of its timed part) until at least `seconds` of it and
// `min_batches` have passed.
template <typename F>
Expected<Sample> measure(double seconds, uint32_t min_batches, uint64_t bytes_per_batch,
                         F&& batch) {
  Sample out;
  double timed = 0;
  for (uint32_t n = 0; n < min_batches || timed < seconds; ++n) {
    RD2H_TRY(t, batch(n));
    out.batch_seconds.push_back(t);
    timed += t;
  }
  out.gbs = static_cast<double>(bytes_per_batch * out.batch_seconds.size()) / timed / 1e9;
  return out;
}

// Measures `a` and `b` in alternating rounds: the median GB/s of each, and every batch's
// time, so a burst of load from a neighbour on a shared machine skews neither side alone.
template <typename A, typename B>
Expected<std::pair<Sample, Sample>> measure_pair(const BenchEngineOptions& o,
                                                 uint64_t bytes_per_batch, A&& a, B&& b) {
  constexpr int kRounds = 5;
  const double slice = o.min_seconds / kRounds;
  const uint32_t batches = std::max<uint32_t>(1, o.min_batches / kRounds);
  std::vector<double> ra, rb;
  std::pair<Sample, Sample> out;
  for (int r = 0; r < kRounds; ++r) {
    RD2H_TRY(x, measure(slice, batches, bytes_per_batch, a));
    ra.push_back(x.gbs);
    out.first.batch_seconds.insert(out.first.batch_seconds.end(), x.batch_seconds.begin(),
                                   x.batch_seconds.end());
    RD2H_TRY(y, measure(slice, batches, bytes_per_batch, b));
    rb.push_back(y.gbs);
    out.second.batch_seconds.insert(out.second.batch_seconds.end(), y.batch_seconds.begin(),
                                    y.batch_seconds.end());
  }
  out.first.gbs = metrics::quantile(ra, 0.5);
  out.second.gbs = metrics::quantile(rb, 0.5);
  return out;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

bool port_listening(int port) {
  for (const char* path : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(path);
    std::string line;
    std::getline(in, line);
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string slot, local, remote, state;
      f >> slot >> local >> remote >> state;
      auto colon = local.rfind(':');
      if (colon == std::string::npos) continue;
      if (std::stoi(local.substr(colon + 1), nullptr, 16) == port && state == "0A") return true;
    }
  }
  return false;
}

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  ::close(fd);
  return port;
}

std::optional<std::string> find_perftest() {
  for (const char* p : {"/usr/bin/ucx_perftest", "/usr/local/bin/ucx_perftest"}) {
    if (::access(p, X_OK) == 0) return std::string(p);
  }
  return std::nullopt;
}

// ucx_perftest -t ucp_get between two processes on loopback; its overall bandwidth in GB/s.
Expected<double> perftest_get(const std::string& exe, const std::vector<std::string>& env,
                              uint64_t block, uint64_t total_bytes) {
  Subprocess::Options options;
  options.extra_env = env;
  const int port = free_port();
  RD2H_TRY(server, Subprocess::spawn({exe, "-p", std::to_string(port)}, options));
  // The client must not start before the server listens: wait for the socket to appear.
  Deadline ready(20s);
  while (!port_listening(port)) {
    if (ready.expired()) return timeout_error("ucx_perftest server did not listen");
    std::this_thread::sleep_for(2ms);
  }
  const uint64_t iters = std::max<uint64_t>(50, total_bytes / block);
  RD2H_TRY(client, Subprocess::spawn({exe, "127.0.0.1", "-p", std::to_string(port), "-t", "ucp_get",
                                      "-s", std::to_string(block), "-n", std::to_string(iters),
                                      "-w", std::to_string(std::max<uint64_t>(5, iters / 10))},
                                     options));
  RD2H_TRY(out, client.read_all(300s));
  (void)client.wait(10s);
  (void)server.wait(10s);
  // "Final:  iters  lat50  lat_avg  lat_overall  bw_avg  bw_overall  rate_avg  rate_overall"
  auto pos = out.find("Final:");
  if (pos == std::string::npos) return internal_error("ucx_perftest printed no result");
  std::istringstream f(out.substr(pos + 6));
  double v[6];
  for (double& x : v) f >> x;
  if (!f) return internal_error("cannot parse ucx_perftest's result");
  return v[5] * 1048576.0 / 1e9;  // ucx_perftest reports MiB/s
}

class AlignedBuffer {
 public:
  explicit AlignedBuffer(uint64_t size)
      : size_(size),
        data_(static_cast<std::byte*>(std::aligned_alloc(4096, (size + 4095) / 4096 * 4096))) {}
  ~AlignedBuffer() { std::free(data_); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  uint64_t size_;
  std::byte* data_;
};

struct Row {
  std::string transport;
  uint64_t block = 0;
  Sample engine, memcpy;
  std::optional<double> perftest;        // ucx_perftest with UCX's defaults
  std::optional<double> perftest_tuned;  // ucx_perftest with the engine's TCP settings
  std::string lanes;
};

// The source's options: one layer of `blocks` blocks of `block` bytes.
PdReadOptions source_options(const BenchEngineOptions& o, const std::string& transport_name,
                             uint64_t block, uint64_t blocks) {
  PdReadOptions so;
  so.transport = transport_name;
  so.memory = o.memory;
  so.layers = 1;
  so.blocks = static_cast<uint32_t>(blocks);
  so.main_bytes = {block};
  so.indexer_bytes = 0;
  so.serve_timeout_s = 600;
  so.share = o.share;
  if (o.source_load == "busy") so.busy_threads = std::max(1u, std::thread::hardware_concurrency());
  return so;
}

// One batch_read_sync: the source blocks it reads, and its reads.
struct Batch {
  std::vector<uint32_t> src;
  std::vector<transfer::ReadOp> ops;
};

// A few batches of `per_batch` random, distinct blocks of the source's `pool_blocks` (at
// `remote_base`), each read into `dest`.
std::vector<Batch> random_batches(uint64_t per_batch, uint64_t pool_blocks, uint64_t block,
                                  std::byte* dest, uint64_t remote_base) {
  std::mt19937_64 rng(block);
  std::vector<uint32_t> order(pool_blocks);
  std::iota(order.begin(), order.end(), 0);
  std::vector<Batch> batches(4);
  for (auto& b : batches) {
    std::shuffle(order.begin(), order.end(), rng);
    for (uint64_t i = 0; i < per_batch; ++i) {
      b.src.push_back(order[i]);
      b.ops.push_back({reinterpret_cast<uintptr_t>(dest) + i * block,
                       remote_base + static_cast<uint64_t>(order[i]) * block, block});
    }
  }
  return batches;
}

// Whether `dest` holds the blocks of `batch` as the source with `seed` wrote them.
Status check_blocks(const std::byte* dest, const Batch& batch, uint64_t block, uint64_t seed) {
  for (uint64_t i = 0; i < batch.src.size(); ++i) {
    if (find_pattern_mismatch(dest + i * block, block,
                              block_pattern_key(seed, 0, 0, batch.src[i]))) {
      return internal_error("block " + std::to_string(batch.src[i]) + " arrived corrupted");
    }
  }
  return Status::ok();
}

// Batches of `per_batch` random source blocks read by the engine into registered memory,
// against memcpy of the same blocks from a local copy of the source's pool. Every batch the
// engine reads is checked, byte for byte, outside its timed part.
Expected<std::pair<Sample, Sample>> measure_engine_and_memcpy(const BenchEngineOptions& o,
                                                              SourceConnection& conn,
                                                              pid_t source_pid, uint64_t per_batch,
                                                              uint64_t block) {
  auto& engine = *conn.engine;
  const uint64_t pool_blocks = per_batch * 2;
  // Destination: one batch worth of caller memory, registered; a local copy of the source
  // pool for the memcpy baseline.
  // Both page-aligned, as a KV pool is: memcpy's speed depends on the alignment of its
  // arguments, and the comparison must not hinge on it.
  const uint64_t dest_bytes = per_batch * block;
  AlignedBuffer dest(dest_bytes), local_pool(pool_blocks * block);
  std::memset(dest.data(), 0, dest.size());
  fill_pool(local_pool.data(), conn.handshake.layout, conn.handshake.seed);
  RD2H_RETURN_IF_ERROR(engine.register_memory(dest.data(), dest.size()));

  const std::vector<Batch> batches =
      random_batches(per_batch, pool_blocks, block, dest.data(), conn.handshake.base);
  auto read = [&](uint32_t n) -> Expected<double> {
    const Batch& b = batches[n % batches.size()];
    const auto start = Clock::now();
    RD2H_RETURN_IF_ERROR(engine.batch_read_sync(conn.session, b.ops));
    const double took = seconds_since(start);
    // A benchmark of wrong data measures nothing.
    RD2H_RETURN_IF_ERROR(check_blocks(dest.data(), b, block, conn.handshake.seed));
    return took;
  };
  auto copy = [&](uint32_t n) -> Expected<double> {
    const Batch& b = batches[n % batches.size()];
    const auto start = Clock::now();
    for (uint64_t i = 0; i < per_batch; ++i) {
      std::memcpy(dest.data() + i * block,
                  local_pool.data() + static_cast<uint64_t>(b.src[i]) * block, block);
    }
    return seconds_since(start);
  };
  // Warm up.
  RD2H_RETURN_IF_ERROR(read(0).status());
  RD2H_RETURN_IF_ERROR(copy(0).status());
  const bool stop = o.source_load == "stopped";
  if (stop) ::kill(source_pid, SIGSTOP);
  auto samples = measure_pair(o, dest_bytes, read, copy);
  if (stop) ::kill(source_pid, SIGCONT);
  if (!samples) return samples.status();
  RD2H_RETURN_IF_ERROR(engine.unregister_memory(dest.data()));
  return std::move(*samples);
}

// Over shm ucx_perftest re-reads one cache-resident buffer, so it is run only over tcp,
// once with UCX's defaults and once with the TCP settings the engine applies. A run that
// fails is reported and leaves its column empty.
void add_perftest(const std::string& exe, uint64_t block, Row& row) {
  auto run = [&](const std::vector<std::string>& env) -> std::optional<double> {
    auto p = perftest_get(exe, env, block, 256ull << 20);
    if (p) return *p;
    std::fprintf(stderr, "bench: ucx_perftest tcp %s: %s\n", size_text(block).c_str(),
                 p.status().to_string().c_str());
    return std::nullopt;
  };
  row.perftest = run({"UCX_TLS=tcp"});
  row.perftest_tuned = run(
      {"UCX_TLS=tcp", "UCX_TCP_TX_SEG_SIZE=1M", "UCX_TCP_RX_SEG_SIZE=2M", "UCX_ZCOPY_THRESH=inf"});
}

Expected<Row> bench_one(const BenchEngineOptions& o, const std::string& transport_name,
                        uint64_t block, const std::optional<std::string>& perftest) {
  RD2H_TRY(transport, transfer::parse_transport(transport_name));
  const uint64_t per_batch = std::max<uint64_t>(1, o.batch_bytes / block);
  const uint64_t pool_blocks = per_batch * 2;
  if (pool_blocks > UINT32_MAX) return invalid_argument("too many blocks per batch");

  RD2H_TRY(source, spawn_source(source_options(o, transport_name, block, pool_blocks)));
  RD2H_TRY(read_path, transfer::parse_read_path(o.read_path));
  transfer::EngineConfig cfg;
  cfg.transport = transport;
  cfg.read_path = read_path;
  cfg.read_timeout = cfg.connect_timeout = std::chrono::milliseconds(o.timeout_ms);
  RD2H_TRY(conn, connect_to_source(source.address, cfg));
  Row row;
  row.transport = transport_name;
  row.block = block;
  if (auto info = conn.engine->session_info(conn.session)) row.lanes = info->transport;

  RD2H_TRY(samples, measure_engine_and_memcpy(o, conn, source.process.pid(), per_batch, block));
  row.engine = std::move(samples.first);
  row.memcpy = std::move(samples.second);

  release_source(conn, true);
  (void)source.process.wait(10s);
  if (perftest && transport_name == "tcp") add_perftest(*perftest, block, row);
  return row;
}

// One peer engine's figures at one transport and block size, or why there are none.
struct PeerRow {
  std::string engine;  // its name and version, as the harness reports them
  std::optional<double> gbs, p50, p99;
  std::string note;  // why no figures (not installed, not offered, an error)
};
using PeerKey = std::tuple<std::string, std::string, uint64_t>;  // peer, transport, block

std::string peer_name(const std::string& peer) {
  return peer == "nixl" ? "NIXL" : peer == "mooncake" ? "Mooncake" : peer;
}

// Runs the harness of `peer` over `transport` for every block size; what it reported, by
// block size (every block size gets a row, with a note if it has no figures).
std::map<uint64_t, PeerRow> run_peer(const BenchEngineOptions& o, const std::string& python,
                                     const std::string& peer, const std::string& transport) {
  std::map<uint64_t, PeerRow> rows;
  auto fail_all = [&](const std::string& why) {
    for (uint64_t block : o.block_bytes) {
      rows[block].engine = peer_name(peer);
      rows[block].note = why;
    }
    return rows;
  };
  std::string blocks;
  for (uint64_t block : o.block_bytes) {
    if (!blocks.empty()) blocks += ',';
    blocks += std::to_string(block);
  }
  auto out = run_peers_harness(
      python,
      {"engine", "--peer", peer, "--transport", transport, "--blocks", blocks, "--batch-bytes",
       std::to_string(o.batch_bytes), "--seconds", std::to_string(o.min_seconds), "--min-batches",
       std::to_string(o.min_batches)},
      std::chrono::seconds(120 + static_cast<int>(o.min_seconds * 4) *
                                     static_cast<int>(o.block_bytes.size())));
  if (!out) return fail_all("its harness did not finish: " + out.status().to_string());
  for (const auto& j : out->results) {
    if (j.contains("skip")) return fail_all(j.value("skip", std::string()));
    if (!j.contains("block")) continue;
    const uint64_t block = j.value("block", uint64_t{0});
    PeerRow& row = rows[block];
    row.engine = j.value("engine", peer_name(peer));
    if (j.contains("error")) {
      row.note = "error: " + j.value("error", std::string());
      continue;
    }
    row.gbs = j.value("gbs", 0.0);
    row.p50 = j.value("p50_s", 0.0);
    row.p99 = j.value("p99_s", 0.0);
    row.note = j.value("settings", std::string());
  }
  for (uint64_t block : o.block_bytes) {
    if (rows.count(block) == 0) {
      rows[block].engine = peer_name(peer);
      rows[block].note = "no result (its harness exited with status " +
                         std::to_string(out->exit_status) +
                         (out->last_words.empty() ? "" : ": " + out->last_words) + ")";
    }
  }
  return rows;
}
std::string ms(double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f ms", seconds * 1e3);
  return buf;
}

// The table of every engine at every transport and block size, in Markdown.
void print_markdown(const BenchEngineOptions& o, const std::vector<Row>& rows,
                    const std::map<PeerKey, PeerRow>& peers) {
  std::printf(
      "\n| transport | block | engine | GB/s | batch p50 | batch p99 | vs memcpy | vs the faster "
      "peer |\n|---|---|---|---|---|---|---|---|\n");
  for (const Row& row : rows) {
    const std::string t = row.transport, b = size_text(row.block);
    std::optional<double> fastest;
    std::string fastest_name;
    for (const auto& peer : o.peers) {
      auto it = peers.find({peer, row.transport, row.block});
      if (it != peers.end() && it->second.gbs && (!fastest || *it->second.gbs > *fastest)) {
        fastest = it->second.gbs;
        fastest_name = it->second.engine;
      }
    }
    auto vs_peer = [&](double gbs, bool named) {
      if (!fastest) return std::string("-");
      char buf[64];
      std::snprintf(buf, sizeof(buf), named ? "%.2fx the faster peer" : "%.2fx", gbs / *fastest);
      return std::string(buf);
    };
    auto line = [&](const std::string& engine, double gbs, double p50, double p99,
                    const std::string& ratio) {
      std::printf("| %s | %s | %s | %.2f | %s | %s | %.2fx | %s |\n", t.c_str(), b.c_str(),
                  engine.c_str(), gbs, ms(p50).c_str(), ms(p99).c_str(), gbs / row.memcpy.gbs,
                  ratio.c_str());
    };
    auto q = [](const Sample& s, double p) { return metrics::quantile(s.batch_seconds, p); };
    line("rd2h", row.engine.gbs, q(row.engine, 0.5), q(row.engine, 0.99),
         vs_peer(row.engine.gbs, true));
    for (const auto& peer : o.peers) {
      auto it = peers.find({peer, row.transport, row.block});
      if (it == peers.end()) continue;
      const PeerRow& p = it->second;
      if (!p.gbs) {
        std::printf("| %s | %s | %s | - | - | - | - | %s |\n", t.c_str(), b.c_str(),
                    p.engine.c_str(), p.note.c_str());
        continue;
      }
      line(p.engine, *p.gbs, *p.p50, *p.p99, vs_peer(*p.gbs, false));
    }
    line("memcpy (1 thread)", row.memcpy.gbs, q(row.memcpy, 0.5), q(row.memcpy, 0.99),
         vs_peer(row.memcpy.gbs, false));
  }
  std::map<std::string, std::string> settings;
  for (const auto& [key, p] : peers) {
    if (p.gbs && !p.note.empty()) settings[p.engine + " over " + std::get<1>(key)] = p.note;
  }
  if (!settings.empty()) std::printf("\nPeer settings:\n");
  for (const auto& [what, how] : settings) std::printf("- %s: %s\n", what.c_str(), how.c_str());
}

}  // namespace

int run_bench_engine(const BenchEngineOptions& o) {
  std::optional<std::string> perftest;
  if (o.perftest) {
    perftest = find_perftest();
    if (!perftest) std::fprintf(stderr, "bench: ucx_perftest not found; that column stays empty\n");
  }
  std::printf(
      "rd2h bench engine: batches of %s of random blocks from a source process "
      "(%s memory%s; the source %s), single-thread memcpy of the same blocks, ucx_perftest "
      "ucp_get%s\n\n",
      size_text(o.batch_bytes).c_str(), o.memory == "alloc" ? "engine-allocated" : "registered",
      o.memory == "alloc" ? "" : (o.share ? ", moved into shared memory" : ", kept private"),
      o.source_load == "busy"      ? "keeps every core busy"
      : o.source_load == "stopped" ? "is stopped (SIGSTOP) while read"
                                   : "is idle",
      o.peers.empty() ? "" : ", and the peer engines on the same blocks");
  std::printf("%-9s %-8s %-18s %11s %11s %9s %13s %11s %13s %11s\n", "transport", "block", "lanes",
              "engine GB/s", "memcpy GB/s", "vs memcpy", "perftest GB/s", "vs perftest",
              "perftest tuned", "vs tuned");
  int rc = 0;
  std::vector<Row> rows;
  for (const auto& t : o.transports) {
    for (uint64_t block : o.block_bytes) {
      auto row = bench_one(o, t, block, perftest);
      if (!row) {
        std::printf("%-9s %-8s error: %s\n", t.c_str(), size_text(block).c_str(),
                    row.status().to_string().c_str());
        rc = 1;
        continue;
      }
      const double engine = row->engine.gbs;
      auto cell = [&](const std::optional<double>& v, bool ratio) {
        char buf[32] = "-";
        if (v && ratio) std::snprintf(buf, sizeof(buf), "%.2fx", engine / *v);
        if (v && !ratio) std::snprintf(buf, sizeof(buf), "%.2f", *v);
        return std::string(buf);
      };
      std::printf("%-9s %-8s %-18s %11.2f %11.2f %8.2fx %13s %11s %13s %11s\n", t.c_str(),
                  size_text(block).c_str(), row->lanes.c_str(), engine, row->memcpy.gbs,
                  engine / row->memcpy.gbs, cell(row->perftest, false).c_str(),
                  cell(row->perftest, true).c_str(), cell(row->perftest_tuned, false).c_str(),
                  cell(row->perftest_tuned, true).c_str());
      std::fflush(stdout);
      rows.push_back(std::move(*row));
    }
  }
  std::printf(
      "\nperftest: ucx_perftest -t ucp_get of one block size between two processes over "
      "tcp; tuned: with the engine's TCP settings (UCX_TCP_TX_SEG_SIZE=1M, UCX_TCP_RX_SEG_SIZE=2M, "
      "UCX_ZCOPY_THRESH=inf).\n");
  std::map<PeerKey, PeerRow> peers;
  if (!o.peers.empty()) {
    auto python = peers_python(o.peers_python);
    for (const auto& peer : o.peers) {
      for (const auto& t : o.transports) {
        std::map<uint64_t, PeerRow> got;
        if (python) {
          got = run_peer(o, *python, peer, t);
        } else {
          for (uint64_t block : o.block_bytes)
            got[block] = {peer_name(peer), {}, {}, {}, python.status().message()};
        }
        for (auto& [block, row] : got) {
          if (!row.gbs)
            std::fprintf(stderr, "bench: %s over %s, %s: %s\n", peer.c_str(), t.c_str(),
                         size_text(block).c_str(), row.note.c_str());
          peers[{peer, t, block}] = std::move(row);
        }
      }
    }
  }
  print_markdown(o, rows, peers);
  return rc;
}

}  // namespace rd2h::tools
