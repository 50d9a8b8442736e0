#include "pd_read.h"

#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>

#include "util/metrics.h"
#include "util/pattern.h"
#include "rd2h/common/deadline.h"

namespace rd2h::tools {

namespace {

using namespace std::chrono_literals;

constexpr uint64_t kMaxPoolBytes = 64ull << 30;

std::string join(const std::vector<uint64_t>& v) {
  std::string s;
  for (auto x : v) {
    if (!s.empty()) s += ',';
    s += std::to_string(x);
  }
  return s;
}

std::vector<std::string> source_argv(const PdReadOptions& o, const std::string& listen) {
  return {self_executable(),
          "pd-read",
          "--role",
          "source",
          "--listen",
          listen,
          "--transport",
          o.transport,
          "--memory",
          o.memory,
          "--layers",
          std::to_string(o.layers),
          "--blocks",
          std::to_string(o.blocks),
          "--main-bytes",
          join(o.main_bytes),
          "--indexer-bytes",
          std::to_string(o.indexer_bytes),
          "--seed",
          std::to_string(o.seed),
          "--serve-timeout",
          std::to_string(o.serve_timeout_s),
          "--busy-threads",
          std::to_string(o.busy_threads),
          o.share ? "--share" : "--no-share"};
}

// Threads that spin until destroyed, each keeping one core busy.
class BusyThreads {
 public:
  explicit BusyThreads(uint32_t n) {
    for (uint32_t i = 0; i < n; ++i) {
      threads_.emplace_back([this] {
        volatile uint64_t x = 0;
        while (!stop_.load(std::memory_order_relaxed)) x = x + 1;
      });
    }
  }
  ~BusyThreads() {
    stop_.store(true);
    for (auto& t : threads_) t.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

// Owns the source's pool: engine-allocated or caller memory registered with the engine.
struct Pool {
  transfer::TransferEngine* engine = nullptr;
  std::byte* base = nullptr;
  void* owned = nullptr;
  ~Pool() {
    if (base != nullptr) (void)engine->unregister_memory(base);
    std::free(owned);
  }
};

Status make_pool(transfer::TransferEngine& engine, uint64_t bytes, bool allocate, Pool& pool) {
  pool.engine = &engine;
  if (allocate) {
    RD2H_TRY(r, engine.allocate_memory(bytes));
    pool.base = static_cast<std::byte*>(r.addr);
    return Status::ok();
  }
  uint64_t rounded = (bytes + 4095) / 4096 * 4096;
  pool.owned = std::aligned_alloc(4096, rounded);
  if (pool.owned == nullptr)
    return internal_error("cannot allocate " + std::to_string(bytes) + " bytes");
  RD2H_RETURN_IF_ERROR(engine.register_memory(pool.owned, bytes));
  pool.base = static_cast<std::byte*>(pool.owned);
  return Status::ok();
}

int fail(const Status& st, const char* role) {
  std::fprintf(stderr, "pd-read %s: %s\n", role, st.to_string().c_str());
  return 1;
}

// The host of "host:port" when it names one interface ("" for a wildcard address).
std::string interface_host(const std::string& host_port) {
  std::string host = host_port.substr(0, host_port.rfind(':'));
  if (host.size() >= 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  if (host == "0.0.0.0" || host == "::" || host == "*") return "";
  return host;
}

int run_source(const PdReadOptions& o) {
  auto transport = transfer::parse_transport(o.transport);
  if (!transport) return fail(transport.status(), "source");
  KvPoolLayout layout = o.layout();
  if (Status st = layout.validate(kMaxPoolBytes); !st) return fail(st, "source");
  if (o.memory != "alloc" && o.memory != "register") {
    return fail(invalid_argument("--memory must be alloc or register, got " + o.memory), "source");
  }

  transfer::EngineConfig cfg;
  cfg.role = transfer::Role::kPrefill;
  cfg.transport = *transport;
  cfg.read_timeout = std::chrono::milliseconds(o.timeout_ms);
  cfg.connect_timeout = std::chrono::milliseconds(o.timeout_ms);
  cfg.listen_host = interface_host(o.listen);
  cfg.share_registered = o.share;
  auto engine = transfer::create_ucx_engine(cfg);
  if (!engine) return fail(engine.status(), "source");
  Pool pool;
  if (Status st = make_pool(**engine, layout.total_bytes(), o.memory == "alloc", pool); !st) {
    return fail(st, "source");
  }
  fill_pool(pool.base, layout, o.seed);

  auto channel = SourceChannel::bind(o.listen);
  if (!channel) return fail(channel.status(), "source");
  std::printf("LISTENING %s\n", channel->address().c_str());
  std::fflush(stdout);

  Deadline serve(std::chrono::seconds(o.serve_timeout_s));
  BusyThreads busy(o.busy_threads);
  auto meta = (*engine)->export_metadata();
  if (!meta) return fail(meta.status(), "source");
  SourceHandshake h{layout, o.seed, reinterpret_cast<uint64_t>(pool.base), std::move(*meta)};
  if (Status st = channel->serve(encode_handshake(h), serve); !st) {
    return fail(st.with_context("waiting for the destination"), "source");
  }
  // The reader's verdict; meanwhile the engine's progress thread serves its reads.
  auto verdict = channel->await_verdict(serve);
  if (!verdict) return fail(verdict.status().with_context("waiting for the destination"), "source");
  return *verdict ? 0 : 1;
}

// What the destination's batches came to.
struct ReadTally {
  std::vector<double> latency_us;
  uint64_t bytes = 0;
  uint64_t mismatches = 0;
  double seconds = 0;
};

// Reads batch `b`: `o.batch_blocks` random blocks of one layer into other random blocks of
// `dest`, every tensor of each, then checks every byte against the source's pattern.
Status read_one_batch(const PdReadOptions& o, SourceConnection& conn, const Pool& dest, uint32_t b,
                      std::mt19937_64& rng, std::vector<uint32_t>& all, ReadTally& tally) {
  const KvPoolLayout& layout = conn.handshake.layout;
  const size_t tensors = layout.tensor_bytes.size();
  const uint32_t layer = b % layout.layers;
  std::shuffle(all.begin(), all.end(), rng);
  std::vector<uint32_t> src(all.begin(), all.begin() + o.batch_blocks);
  std::shuffle(all.begin(), all.end(), rng);
  std::vector<uint32_t> dst(all.begin(), all.begin() + o.batch_blocks);

  std::vector<transfer::ReadOp> ops;
  for (uint32_t i = 0; i < o.batch_blocks; ++i) {
    for (uint32_t t = 0; t < tensors; ++t) {
      ops.push_back({reinterpret_cast<uintptr_t>(dest.base) + layout.offset(layer, t, dst[i]),
                     conn.handshake.base + layout.offset(layer, t, src[i]),
                     layout.tensor_bytes[t]});
      std::memset(reinterpret_cast<void*>(ops.back().local), 0, ops.back().length);
    }
  }
  auto t0 = std::chrono::steady_clock::now();
  Status st = conn.engine->batch_read_sync(conn.session, ops);
  auto t1 = std::chrono::steady_clock::now();
  if (!st) {
    return st.with_context("batch " + std::to_string(b) + " (layer " + std::to_string(layer) + ")");
  }
  const double s = std::chrono::duration<double>(t1 - t0).count();
  tally.seconds += s;
  tally.latency_us.push_back(s * 1e6);
  for (size_t k = 0; k < ops.size(); ++k) {
    const uint32_t t = static_cast<uint32_t>(k % tensors), i = static_cast<uint32_t>(k / tensors);
    tally.bytes += ops[k].length;
    auto bad = find_pattern_mismatch(reinterpret_cast<const void*>(ops[k].local), ops[k].length,
                                     block_pattern_key(conn.handshake.seed, layer, t, src[i]));
    if (bad && tally.mismatches++ < 10) {
      std::printf(
          "MISMATCH batch %u layer %u tensor %u: source block %u -> dest block %u, "
          "first bad byte %zu\n",
          b, layer, t, src[i], dst[i], *bad);
    }
  }
  return Status::ok();
}

void report_reads(const ReadTally& tally, const Status& error) {
  if (!tally.latency_us.empty()) {
    std::printf(
        "latency per batch: p50 %.1f us, p99 %.1f us; throughput %.2f GB/s "
        "(%.1f MiB in %zu batches)\n",
        metrics::quantile(tally.latency_us, 0.5), metrics::quantile(tally.latency_us, 0.99),
        static_cast<double>(tally.bytes) / tally.seconds / 1e9,
        static_cast<double>(tally.bytes) / (1 << 20), tally.latency_us.size());
  }
  if (!error.is_ok()) {
    std::printf("verification: FAILED: %s\n", error.to_string().c_str());
  } else if (tally.mismatches > 0) {
    std::printf("verification: FAILED: %llu mismatched blocks\n",
                static_cast<unsigned long long>(tally.mismatches));
  } else {
    std::printf("verification: OK (every byte of %zu batches matched)\n", tally.latency_us.size());
  }
  std::fflush(stdout);
}

int run_dest(const PdReadOptions& o) {
  auto transport = transfer::parse_transport(o.transport);
  if (!transport) return fail(transport.status(), "dest");
  if (o.connect.empty()) return fail(invalid_argument("--connect host:port is required"), "dest");
  auto read_path = transfer::parse_read_path(o.read_path);
  if (!read_path) return fail(read_path.status(), "dest");
  transfer::EngineConfig cfg;
  cfg.transport = *transport;
  cfg.read_path = *read_path;
  cfg.read_timeout = cfg.connect_timeout = std::chrono::milliseconds(o.timeout_ms);
  auto conn = connect_to_source(o.connect, cfg);
  if (!conn) return fail(conn.status(), "dest");
  const KvPoolLayout& layout = conn->handshake.layout;
  if (o.batch_blocks == 0 || o.batch_blocks > layout.blocks) {
    release_source(*conn, false);
    return fail(invalid_argument("--batch-blocks must be in 1.." + std::to_string(layout.blocks) +
                                 ", got " + std::to_string(o.batch_blocks)),
                "dest");
  }
  // The destination pool mirrors the source layout, like Decode's own cache.
  Pool dest;
  if (Status st = make_pool(*conn->engine, layout.total_bytes(), false, dest); !st) {
    release_source(*conn, false);
    return fail(st, "dest");
  }
  std::memset(dest.base, 0, layout.total_bytes());

  const uint32_t batches = o.batches == 0 ? layout.layers : o.batches;
  auto info = conn->engine->session_info(conn->session);
  std::printf(
      "pd-read: %u batches of %u random blocks x %zu tensors from %u layers x %u blocks "
      "(%.1f MiB pool), transport %s (%s)\n",
      batches, o.batch_blocks, layout.tensor_bytes.size(), layout.layers, layout.blocks,
      static_cast<double>(layout.total_bytes()) / (1 << 20), o.transport.c_str(),
      info ? info->transport.c_str() : "?");
  std::mt19937_64 rng(o.seed * 7919 + 17);
  std::vector<uint32_t> all(layout.blocks);
  std::iota(all.begin(), all.end(), 0);
  ReadTally tally;
  Status error;
  for (uint32_t b = 0; b < batches && error.is_ok(); ++b) {
    error = read_one_batch(o, *conn, dest, b, rng, all, tally);
  }
  const bool ok = error.is_ok() && tally.mismatches == 0;
  release_source(*conn, ok);
  report_reads(tally, error);
  return ok ? 0 : 1;
}

int run_local(const PdReadOptions& o) {
  auto source = spawn_source(o);
  if (!source) return fail(source.status(), "local");
  Subprocess::Options inherit;
  inherit.inherit_stdout = true;
  auto dest = Subprocess::spawn(
      {self_executable(), "pd-read", "--role", "dest", "--connect", source->address, "--transport",
       o.transport, "--read-path", o.read_path, "--batch-blocks", std::to_string(o.batch_blocks),
       "--batches", std::to_string(o.batches), "--seed", std::to_string(o.seed), "--timeout-ms",
       std::to_string(o.timeout_ms)},
      inherit);
  if (!dest) return fail(dest.status(), "local");
  auto limit = std::chrono::seconds(o.serve_timeout_s);
  auto dest_status = dest->wait(limit);
  if (!dest_status) return fail(dest_status.status().with_context("destination"), "local");
  auto source_status = source->process.wait(10s);
  if (!source_status) return fail(source_status.status().with_context("source"), "local");
  auto code = [](int status) {
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  };
  if (code(*dest_status) != 0) return code(*dest_status);
  return code(*source_status);
}

}  // namespace

KvPoolLayout PdReadOptions::layout() const {
  KvPoolLayout l;
  l.layers = layers;
  l.blocks = blocks;
  l.tensor_bytes = main_bytes;
  if (indexer_bytes > 0) l.tensor_bytes.push_back(indexer_bytes);
  return l;
}

Expected<SourceProcess> spawn_source(const PdReadOptions& o) {
  RD2H_TRY(p, Subprocess::spawn(source_argv(o, "127.0.0.1:0")));
  // Filling a large pool takes a while; the source prints its address once it is ready.
  // Other lines (UCX's own log goes to stdout) are passed through to stderr.
  Deadline deadline(std::chrono::seconds(120));
  for (;;) {
    auto line =
        p.read_line(std::chrono::duration_cast<std::chrono::milliseconds>(deadline.remaining()));
    if (!line) return line.status().with_context("waiting for the source to listen");
    if (line->rfind("LISTENING ", 0) == 0) return SourceProcess{std::move(p), line->substr(10)};
    std::fprintf(stderr, "%s\n", line->c_str());
  }
}

Expected<SourceConnection> connect_to_source(const std::string& address,
                                             transfer::EngineConfig cfg) {
  Deadline deadline(std::max(cfg.connect_timeout, std::chrono::milliseconds(10000)));
  RD2H_TRY(channel, DestChannel::connect(address));
  RD2H_TRY(bytes, channel.fetch_handshake(deadline));
  auto h = decode_handshake(bytes);
  if (!h) return h.status().with_context("the source at " + address);
  RD2H_RETURN_IF_ERROR(h->layout.validate(kMaxPoolBytes).with_context("source layout"));

  cfg.role = transfer::Role::kDecode;
  // A reader of a loopback source stays on loopback too.
  const std::string source_host = interface_host(address);
  if (source_host.rfind("127.", 0) == 0 || source_host == "::1") cfg.listen_host = source_host;
  RD2H_TRY(engine, transfer::create_ucx_engine(cfg));
  RD2H_TRY(session, engine->connect(h->engine_metadata));
  return SourceConnection{std::move(channel), std::move(*h), std::move(engine), session};
}

void release_source(SourceConnection& c, bool ok) {
  (void)c.channel.send_verdict(ok, Deadline(5s));
}

int run_pd_read(const PdReadOptions& o) {
  if (o.role == "source") return run_source(o);
  if (o.role == "dest") return run_dest(o);
  if (o.role == "local") return run_local(o);
  return fail(invalid_argument("--role must be local, source or dest, got " + o.role), "pd-read");
}

}  // namespace rd2h::tools
