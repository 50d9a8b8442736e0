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
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "pd_read.h"
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

// Runs `batch` until at least `seconds` and `min_batches` have passed; returns GB/s.
template <typename F>
Expected<double> measure(double seconds, uint32_t min_batches, uint64_t bytes_per_batch,
                         F&& batch) {
  uint64_t bytes = 0;
  uint32_t n = 0;
  auto start = Clock::now();
  double elapsed = 0;
  while (n < min_batches || elapsed < seconds) {
    RD2H_RETURN_IF_ERROR(batch(n));
    bytes += bytes_per_batch;
    ++n;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  }
  return static_cast<double>(bytes) / elapsed / 1e9;
}

// Measures `a` and `b` in alternating rounds and returns the median GB/s of each, so a
// burst of load from a neighbour on a shared machine skews neither side alone.
template <typename A, typename B>
Expected<std::pair<double, double>> measure_pair(const BenchEngineOptions& o,
                                                 uint64_t bytes_per_batch, A&& a, B&& b) {
  constexpr int kRounds = 5;
  const double slice = o.min_seconds / kRounds;
  const uint32_t batches = std::max<uint32_t>(1, o.min_batches / kRounds);
  std::vector<double> ra, rb;
  for (int r = 0; r < kRounds; ++r) {
    RD2H_TRY(x, measure(slice, batches, bytes_per_batch, a));
    ra.push_back(x);
    RD2H_TRY(y, measure(slice, batches, bytes_per_batch, b));
    rb.push_back(y);
  }
  return std::pair{metrics::quantile(ra, 0.5), metrics::quantile(rb, 0.5)};
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
  double engine = 0, memcpy = 0;
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

// One batch_read_sync: the source blocks it reads, and where from and to.
struct Batch {
  std::vector<uint32_t> src;
  std::vector<uintptr_t> local, remote;
  std::vector<size_t> len;
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
      b.local.push_back(reinterpret_cast<uintptr_t>(dest) + i * block);
      b.remote.push_back(remote_base + static_cast<uint64_t>(order[i]) * block);
      b.len.push_back(block);
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
// against memcpy of the same blocks from a local copy of the source's pool: their GB/s.
Expected<std::pair<double, double>> measure_engine_and_memcpy(const BenchEngineOptions& o,
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
  auto read = [&](uint32_t n) {
    const Batch& b = batches[n % batches.size()];
    return engine.batch_read_sync(conn.session, b.local, b.remote, b.len);
  };
  // Warm up, then check the bytes once: a benchmark of wrong data measures nothing.
  RD2H_RETURN_IF_ERROR(read(0));
  RD2H_RETURN_IF_ERROR(check_blocks(dest.data(), batches[0], block, conn.handshake.seed));
  auto copy = [&](uint32_t n) {
    const Batch& b = batches[n % batches.size()];
    for (uint64_t i = 0; i < per_batch; ++i) {
      std::memcpy(dest.data() + i * block,
                  local_pool.data() + static_cast<uint64_t>(b.src[i]) * block, block);
    }
    return Status::ok();
  };
  RD2H_RETURN_IF_ERROR(copy(0));
  const bool stop = o.source_load == "stopped";
  if (stop) ::kill(source_pid, SIGSTOP);
  auto gbs = measure_pair(o, dest_bytes, read, copy);
  if (stop) ::kill(source_pid, SIGCONT);
  if (!gbs) return gbs.status();
  RD2H_RETURN_IF_ERROR(engine.unregister_memory(dest.data()));
  return *gbs;
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

  RD2H_TRY(gbs, measure_engine_and_memcpy(o, conn, source.process.pid(), per_batch, block));
  row.engine = gbs.first;
  row.memcpy = gbs.second;

  release_source(conn, true);
  (void)source.process.wait(10s);
  if (perftest && transport_name == "tcp") add_perftest(*perftest, block, row);
  return row;
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
      "ucp_get\n\n",
      size_text(o.batch_bytes).c_str(), o.memory == "alloc" ? "engine-allocated" : "registered",
      o.memory == "alloc" ? "" : (o.share ? ", moved into shared memory" : ", kept private"),
      o.source_load == "busy"      ? "keeps every core busy"
      : o.source_load == "stopped" ? "is stopped (SIGSTOP) while read"
                                   : "is idle");
  std::printf("%-9s %-8s %-18s %11s %11s %9s %13s %11s %13s %11s\n", "transport", "block", "lanes",
              "engine GB/s", "memcpy GB/s", "vs memcpy", "perftest GB/s", "vs perftest",
              "perftest tuned", "vs tuned");
  int rc = 0;
  for (const auto& t : o.transports) {
    for (uint64_t block : o.block_bytes) {
      auto row = bench_one(o, t, block, perftest);
      if (!row) {
        std::printf("%-9s %-8s error: %s\n", t.c_str(), size_text(block).c_str(),
                    row.status().to_string().c_str());
        rc = 1;
        continue;
      }
      auto cell = [&](const std::optional<double>& v, bool ratio) {
        char buf[32] = "-";
        if (v && ratio) std::snprintf(buf, sizeof(buf), "%.2fx", row->engine / *v);
        if (v && !ratio) std::snprintf(buf, sizeof(buf), "%.2f", *v);
        return std::string(buf);
      };
      std::printf("%-9s %-8s %-18s %11.2f %11.2f %8.2fx %13s %11s %13s %11s\n", t.c_str(),
                  size_text(block).c_str(), row->lanes.c_str(), row->engine, row->memcpy,
                  row->engine / row->memcpy, cell(row->perftest, false).c_str(),
                  cell(row->perftest, true).c_str(), cell(row->perftest_tuned, false).c_str(),
                  cell(row->perftest_tuned, true).c_str());
      std::fflush(stdout);
    }
  }
  std::printf(
      "\nperftest: ucx_perftest -t ucp_get of one block size between two processes over "
      "tcp; tuned: with the engine's TCP settings (UCX_TCP_TX_SEG_SIZE=1M, UCX_TCP_RX_SEG_SIZE=2M, "
      "UCX_ZCOPY_THRESH=inf).\n");
  return rc;
}

}  // namespace rd2h::tools
