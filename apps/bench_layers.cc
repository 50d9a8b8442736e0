#include "bench_layers.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>

#include "decode/worker.h"
#include "prefill/worker.h"
#include "rd2h/common/trace.h"
#include "ucx_am_echo.h"
#include "util/metrics.h"

namespace rd2h::tools {

namespace {

using Clock = std::chrono::steady_clock;

struct Sample {
  double round_trip_us = 0;
  double read_us = 0;
  int64_t start_us = 0, end_us = 0;  // on the trace clock
};

// Where one layer's round trip goes, from the trace: the hops in order.
constexpr const char* kStages[] = {
    "save_kv_layer -> readiness sent (Prefill: reuse gate, encode, send)",
    "-> readiness at the reader (one way, reader wake-up, decode)",
    "-> read starts (the reader's checks and descriptors)",
    "-> read ends (the engine)",
    "-> answer sent (the reader's bookkeeping, reply)",
    "-> answer read (one way, the waiting thread wakes)",
    "-> wait_for_layer_send returns (gate)"};
constexpr size_t kStageCount = sizeof(kStages) / sizeof(kStages[0]);

std::shared_ptr<transfer::TransferEngine> make_engine(transfer::Role role, uint32_t timeout_ms) {
  transfer::EngineConfig cfg;
  cfg.role = role;
  cfg.transport = transfer::Transport::kShm;
  cfg.read_timeout = std::chrono::milliseconds(timeout_ms);
  cfg.listen_host = "127.0.0.1";
  auto e = transfer::create_ucx_engine(cfg);
  if (!e) {
    std::fprintf(stderr, "rd2h bench layers: %s\n", e.status().to_string().c_str());
    return nullptr;
  }
  return std::shared_ptr<transfer::TransferEngine>(std::move(*e));
}

// Every layer name of the model aliases one physical slot of `blocks` blocks per tensor.
Expected<std::vector<layout::CacheLayer>> slot_layers(transfer::TransferEngine& engine,
                                                      const BenchLayersOptions& o, uint32_t names,
                                                      bool fill) {
  std::vector<uint64_t> bytes = o.main_bytes;
  if (o.indexer_bytes) bytes.push_back(o.indexer_bytes);
  uint64_t total = 0;
  for (auto b : bytes) total += b * o.blocks;
  RD2H_TRY(region, engine.allocate_memory(total));
  std::memset(region.addr, fill ? 0x5a : 0, total);
  std::vector<layout::CacheLayer> layers;
  for (uint32_t l = 0; l < names; ++l) {
    layout::CacheLayer layer{"model.layers." + std::to_string(l) + ".self_attn",
                             {},
                             o.main_bytes.size(),
                             o.indexer_bytes != 0};
    uint64_t addr = reinterpret_cast<uint64_t>(region.addr);
    for (size_t t = 0; t < bytes.size(); ++t) {
      layer.tensors.push_back(
          {addr, bytes[t] * o.blocks, bytes[t], 1, t < o.main_bytes.size() ? 0u : 1u});
      addr += bytes[t] * o.blocks;
    }
    layers.push_back(std::move(layer));
  }
  return layers;
}

// One Prefill and one Decode worker, and the step they run: `requests` requests sharing
// the layer's blocks evenly.
struct Setup {
  uint32_t requests = 0;
  bool link = false;  // readiness and answers on the transfer engine's link, not ZeroMQ
  uint64_t layer_bytes = 0;
  std::unique_ptr<decode::Worker> decode;
  std::unique_ptr<prefill::Worker> prefill;
  uint64_t next_layer = 0;
  std::vector<Sample> samples;
};

constexpr uint32_t kNames = 61;

Expected<std::unique_ptr<Setup>> make_setup(const BenchLayersOptions& o, uint32_t requests,
                                            bool link) {
  auto p_engine = make_engine(transfer::Role::kPrefill, o.timeout_ms);
  auto d_engine = make_engine(transfer::Role::kDecode, o.timeout_ms);
  if (!p_engine || !d_engine) return internal_error("no transfer engine");
  RD2H_TRY(p_layers, slot_layers(*p_engine, o, kNames, true));
  RD2H_TRY(d_layers, slot_layers(*d_engine, o, kNames, false));

  auto setup = std::make_unique<Setup>();
  setup->requests = requests;
  setup->link = link;
  decode::WorkerConfig dc;
  dc.register_memory = false;
  // Prefill and Decode each with their own ZeroMQ context, as in two processes.
  RD2H_TRY(decode, decode::Worker::create(dc, d_engine, control::Context::create(), d_layers));
  setup->decode = std::move(decode);
  prefill::WorkerConfig pc;
  pc.register_memory = false;
  pc.send_timeout = std::chrono::milliseconds(o.timeout_ms);
  pc.sender.control_link = link;
  RD2H_TRY(prefill, prefill::Worker::create(pc, p_engine, control::Context::create(), p_layers));
  setup->prefill = std::move(prefill);
  const std::string url = setup->decode->url();
  const int port = std::stoi(url.substr(url.rfind(':') + 1));

  std::vector<prefill::SendRequest> step;
  const uint32_t per = o.blocks / requests;
  for (uint32_t r = 0; r < requests; ++r) {
    prefill::SendRequest s;
    s.ext_id = "bench-" + std::to_string(r);
    s.d_host = "127.0.0.1";
    s.d_base_port = port;
    for (uint32_t b = r * per; b < (r + 1) * per; ++b) s.main_block_ids.push_back(b);
    s.indexer_block_ids = s.main_block_ids;  // Decode's destinations mirror them
    RD2H_RETURN_IF_ERROR(
        setup->decode->add_request(s.ext_id, s.ext_id, s.main_block_ids, s.indexer_block_ids));
    step.push_back(std::move(s));
  }
  RD2H_RETURN_IF_ERROR(setup->prefill->bind_step(step));
  uint64_t per_block = o.indexer_bytes;
  for (auto b : o.main_bytes) per_block += b;
  setup->layer_bytes = per_block * per * requests;
  return setup;
}

// Publishes `count` layers one at a time, each waited for; records them unless warming up.
Status run_layers(Setup& s, uint32_t count, bool record) {
  for (uint32_t i = 0; i < count; ++i) {
    const std::string name =
        "model.layers." + std::to_string(s.next_layer++ % kNames) + ".self_attn";
    const uint64_t read_ns_before = s.decode->reader().stats().read_ns;
    const int64_t start_us = trace::now_us();
    const auto start = Clock::now();
    RD2H_RETURN_IF_ERROR(s.prefill->save_kv_layer(name));
    RD2H_RETURN_IF_ERROR(s.prefill->wait_for_layer_send(name));
    const auto end = Clock::now();
    const int64_t end_us = trace::now_us();
    // The reader counts a read before it answers, so the answer implies the count.
    const uint64_t read_ns = s.decode->reader().stats().read_ns - read_ns_before;
    if (record) {
      s.samples.push_back({std::chrono::duration<double, std::micro>(end - start).count(),
                           static_cast<double>(read_ns) / 1e3, start_us, end_us});
    }
  }
  return Status::ok();
}

// Runs `count` more layers with the timeline on and returns, per stage, the time of each
// layer whose every hop the trace shows.
std::vector<std::vector<double>> stage_times(Setup& s, uint32_t count) {
  std::vector<std::vector<double>> stages(kStageCount);
  s.samples.clear();
  (void)trace::drain();
  trace::set_enabled(true);
  const Status st = run_layers(s, count, true);
  trace::set_enabled(false);
  auto events = trace::drain();
  if (!st) return stages;
  std::sort(events.begin(), events.end(),
            [](const trace::Event& a, const trace::Event& b) { return a.ts_us < b.ts_us; });
  auto first = [&](int64_t from, int64_t to, const char* name) -> std::optional<int64_t> {
    auto it = std::lower_bound(events.begin(), events.end(), from,
                               [](const trace::Event& e, int64_t t) { return e.ts_us < t; });
    for (; it != events.end() && it->ts_us <= to; ++it) {
      if (it->name == name) return it->ts_us;
    }
    return std::nullopt;
  };
  for (const auto& x : s.samples) {
    const auto sent = first(x.start_us, x.end_us, "readiness");
    const auto in = first(x.start_us, x.end_us, "readiness in");
    const auto read = first(x.start_us, x.end_us, "read");
    const auto out = first(x.start_us, x.end_us, "answer out");
    const auto answer = first(x.start_us, x.end_us, "answer");
    if (!sent || !in || !read || !out || !answer) continue;
    const int64_t read_end = *read + static_cast<int64_t>(x.read_us);
    const int64_t points[] = {x.start_us, *sent, *in, *read, read_end, *out, *answer, x.end_us};
    for (size_t k = 0; k < kStageCount; ++k) {
      stages[k].push_back(static_cast<double>(std::max<int64_t>(0, points[k + 1] - points[k])));
    }
  }
  return stages;
}

// The floor under any control overhead on this machine: a bare DEALER/ROUTER round trip
// of a readiness-sized message between two ZeroMQ contexts, and a two-thread wake-up. The
// echo lives through the whole run and is measured in the same rounds as the layers, so a
// noisy spell of the machine hits the floor and the layers alike. With `work`, the echo
// busies its thread that long before answering, as the reader does with a layer's read,
// and the work is subtracted: the floor of a round trip around a read.
class ZmqEcho {
 public:
  ZmqEcho() {
    auto router = control::RouterChannel::bind(control::Context::create(), "127.0.0.1", 0);
    if (!router) return;
    router_ = std::move(*router);
    echo_ = std::thread([this] {
      while (!stop_.load()) {
        auto in = router_->receive(std::chrono::milliseconds(20));
        if (!in || !in->has_value()) continue;
        const auto until = Clock::now() + std::chrono::nanoseconds(work_ns_.load());
        while (Clock::now() < until) {
        }
        (void)router_->send((*in)->identity, (*in)->payload);
      }
    });
    auto dealer = control::DealerChannel::connect(control::Context::create(), router_->url());
    if (dealer) dealer_ = std::move(*dealer);
    std::vector<double> warm_up;
    measure(50, std::chrono::microseconds(0), warm_up);
  }
  ~ZmqEcho() {
    stop_.store(true);
    if (echo_.joinable()) echo_.join();
  }
  // Appends `count` round trips, less `work`, to `out`.
  void measure(uint32_t count, std::chrono::microseconds work, std::vector<double>& out) {
    work_ns_.store(std::chrono::duration_cast<std::chrono::nanoseconds>(work).count());
    const std::vector<std::byte> message(96, std::byte{0x5a});
    for (uint32_t i = 0; dealer_ && i < count; ++i) {
      const auto start = Clock::now();
      if (!dealer_->send(message)) return;
      auto reply = dealer_->receive(std::chrono::seconds(5));
      if (!reply || !reply->has_value()) return;
      out.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start - work).count());
    }
  }

 private:
  std::unique_ptr<control::RouterChannel> router_;
  std::unique_ptr<control::DealerChannel> dealer_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> work_ns_{0};
  std::thread echo_;
};

std::vector<double> wakeup_round_trips(uint32_t count) {
  std::mutex mu;
  std::condition_variable cv;
  int turn = 0;
  bool stop = false;
  std::thread peer([&] {
    std::unique_lock lock(mu);
    while (true) {
      cv.wait(lock, [&] { return turn == 1 || stop; });
      if (stop) return;
      turn = 0;
      cv.notify_all();
    }
  });
  std::vector<double> out;
  for (uint32_t i = 0; i < count + 50; ++i) {
    const auto start = Clock::now();
    std::unique_lock lock(mu);
    turn = 1;
    cv.notify_all();
    cv.wait(lock, [&] { return turn == 0; });
    if (i >= 50)
      out.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
  }
  {
    std::lock_guard lock(mu);
    stop = true;
    cv.notify_all();
  }
  peer.join();
  return out;
}

}  // namespace

namespace {

// Why the options cannot make a run, if they cannot.
std::optional<std::string> options_fault(const BenchLayersOptions& o) {
  if (o.layers == 0 || o.blocks == 0 || o.main_bytes.empty() || o.requests.empty()) {
    return "layers, blocks, main bytes and requests must be set";
  }
  for (uint32_t r : o.requests) {
    if (r == 0 || o.blocks % r != 0) {
      return std::to_string(r) + " requests do not split " + std::to_string(o.blocks) +
             " blocks evenly";
    }
  }
  return std::nullopt;
}

// One configuration per request count and control path (ZeroMQ, then the link).
Expected<std::vector<std::unique_ptr<Setup>>> make_setups(const BenchLayersOptions& o) {
  std::vector<std::unique_ptr<Setup>> setups;
  for (uint32_t requests : o.requests) {
    for (const bool link : {false, true}) {
      auto s = make_setup(o, requests, link);
      if (!s) return s.status().with_context(std::to_string(requests) + " requests");
      setups.push_back(std::move(*s));
    }
  }
  return setups;
}

// The warm-up layers; a connection moves to the link at its first readiness sent with none
// outstanding, once Prefill heard the link open: warmed up until then too (within bounds).
Status warm_up(std::vector<std::unique_ptr<Setup>>& setups, const BenchLayersOptions& o) {
  for (auto& s : setups) {
    RD2H_RETURN_IF_ERROR(run_layers(*s, o.warmup, false));
    for (int extra = 0;
         extra < 1000 && s->link && s->prefill->stats().sender.readiness_on_link == 0; ++extra) {
      RD2H_RETURN_IF_ERROR(run_layers(*s, 1, false));
    }
    if (s->link && s->prefill->stats().sender.readiness_on_link == 0) {
      return internal_error("no readiness went on the link in " + std::to_string(o.warmup + 1000) +
                            " layers");
    }
  }
  return Status::ok();
}

// The same floor on UCX active messages, over shared memory or over TCP.
struct UcxFloor {
  const char* tls;
  std::unique_ptr<UcxAmEcho> echo;
  std::vector<double> samples;
  std::string error;
};

// The floors, measured in the same rounds as the layers.
struct Floors {
  ZmqEcho zmq_echo;
  std::vector<double> zmq, zmq_around_read;
  std::vector<UcxFloor> ucx;
  std::vector<double> wake;  // two threads waking each other, measured last
};

// Configurations alternate in rounds, so a noisy spell of the machine hits them alike.
constexpr uint32_t kRounds = 5;

Status measure_rounds(std::vector<std::unique_ptr<Setup>>& setups, const BenchLayersOptions& o,
                      Floors& f) {
  for (const char* tls : {"shm", "tcp"}) {
    auto echo = UcxAmEcho::start(tls);
    f.ucx.push_back({tls,
                     echo ? std::move(*echo) : nullptr,
                     {},
                     echo ? std::string() : echo.status().to_string()});
  }
  for (uint32_t round = 0; round < kRounds; ++round) {
    const uint32_t count = o.layers / kRounds + (round < o.layers % kRounds ? 1 : 0);
    f.zmq_echo.measure(count, std::chrono::microseconds(0), f.zmq);
    for (auto& u : f.ucx) {
      if (!u.echo) continue;
      if (Status st = u.echo->measure(count, u.samples); !st) {
        u.error = st.to_string();
        u.echo.reset();
      }
    }
    for (auto& s : setups) {
      RD2H_RETURN_IF_ERROR(
          run_layers(*s, count, true).with_context(std::to_string(s->requests) + " requests"));
    }
    // Around the first configuration's read, as measured so far.
    std::vector<double> reads;
    for (const auto& x : setups.front()->samples) reads.push_back(x.read_us);
    f.zmq_echo.measure(
        count, std::chrono::microseconds(static_cast<int64_t>(metrics::quantile(reads, 0.5))),
        f.zmq_around_read);
  }
  return Status::ok();
}

std::vector<double> overheads(const Setup& s) {
  std::vector<double> overhead;
  for (const auto& x : s.samples) overhead.push_back(std::max(0.0, x.round_trip_us - x.read_us));
  return overhead;
}

void print_layers(const std::vector<std::unique_ptr<Setup>>& setups, const BenchLayersOptions& o) {
  std::printf("rd2h bench layers: shm, one Prefill and one Decode worker in one process\n");
  std::printf(
      "%u layers measured per configuration (in %u alternating rounds, after %u warm-up);"
      " %u blocks per layer\n\n",
      o.layers, kRounds, o.warmup, o.blocks);
  std::printf("%9s %7s %10s %14s %14s %15s %14s %8s %9s\n", "requests", "control", "MiB/layer",
              "overhead p50", "overhead p99", "round trip p50", "read p50", "GB/s", "vs first");
  double first_gbps = 0;
  for (const auto& s : setups) {
    const std::vector<double> overhead = overheads(*s);
    std::vector<double> round_trip, read;
    double total_us = 0;
    for (const auto& x : s->samples) {
      round_trip.push_back(x.round_trip_us);
      read.push_back(x.read_us);
      total_us += x.round_trip_us;
    }
    const double gbps = static_cast<double>(s->layer_bytes) *
                        static_cast<double>(s->samples.size()) / (total_us * 1e3);
    if (first_gbps == 0) first_gbps = gbps;
    std::printf("%9u %7s %10.2f %11.1f us %11.1f us %12.1f us %11.1f us %8.2f %8.2fx\n",
                s->requests, s->link ? "link" : "zeromq",
                static_cast<double>(s->layer_bytes) / (1 << 20), metrics::quantile(overhead, 0.5),
                metrics::quantile(overhead, 0.99), metrics::quantile(round_trip, 0.5),
                metrics::quantile(read, 0.5), gbps, gbps / first_gbps);
  }
}

void print_floors(const std::vector<std::unique_ptr<Setup>>& setups, const Floors& f) {
  const double zmq_p50 = metrics::quantile(f.zmq, 0.5);
  const double zmq_p99 = metrics::quantile(f.zmq, 0.99);
  std::printf("\nfloor on this machine, measured in the same rounds:\n");
  std::printf(
      "  bare ZeroMQ DEALER/ROUTER round trip (two contexts, tcp loopback): p50 %.1f us, "
      "p99 %.1f us\n",
      zmq_p50, zmq_p99);
  const double around_p50 = metrics::quantile(f.zmq_around_read, 0.5);
  std::printf(
      "  the same round trip around the read (the echo busy for the read's p50 first, which\n"
      "  is then subtracted):                                              p50 %.1f us, "
      "p99 %.1f us\n",
      around_p50, metrics::quantile(f.zmq_around_read, 0.99));
  for (const auto& u : f.ucx) {
    if (!u.error.empty()) {
      std::printf("  bare UCX active-message round trip (%s): not measured: %s\n", u.tls,
                  u.error.c_str());
      continue;
    }
    std::printf(
        "  bare UCX active-message round trip (two contexts, %s):%*s p50 %.1f us, p99 %.1f us "
        "(%.2fx the ZeroMQ one's p50)\n",
        u.tls, static_cast<int>(13 - std::string(u.tls).size()), "",
        metrics::quantile(u.samples, 0.5), metrics::quantile(u.samples, 0.99),
        zmq_p50 > 0 ? metrics::quantile(u.samples, 0.5) / zmq_p50 : 0.0);
  }
  std::printf(
      "  two-thread wake-up round trip (condition variable):              p50 %.1f us, "
      "p99 %.1f us\n",
      metrics::quantile(f.wake, 0.5), metrics::quantile(f.wake, 0.99));
  for (const auto& s : setups) {
    const std::vector<double> overhead = overheads(*s);
    std::printf(
        "  %u requests, %s: overhead p50 = %.2fx, p99 = %.2fx the bare ZeroMQ round trip's; "
        "p50 = %.2fx the one around the read\n",
        s->requests, s->link ? "link" : "zeromq",
        zmq_p50 > 0 ? metrics::quantile(overhead, 0.5) / zmq_p50 : 0.0,
        zmq_p99 > 0 ? metrics::quantile(overhead, 0.99) / zmq_p99 : 0.0,
        around_p50 > 0 ? metrics::quantile(overhead, 0.5) / around_p50 : 0.0);
  }
  std::printf(
      "\noverhead = round trip (save_kv_layer until every answer is in) - the reader's engine "
      "read time\n");
}

void print_stages(const std::vector<std::unique_ptr<Setup>>& setups,
                  const std::vector<std::vector<std::vector<double>>>& stages, uint32_t layers) {
  std::printf(
      "\nwhere a layer's round trip goes, p50 in us (another %u layers each, timeline on):\n",
      layers);
  std::printf("%-78s", "");
  for (const auto& s : setups) std::printf(" %5u %6s", s->requests, s->link ? "link" : "zeromq");
  std::printf("\n");
  for (size_t k = 0; k < kStageCount; ++k) {
    std::printf("%-78s", kStages[k]);
    for (const auto& st : stages) std::printf(" %12.1f", metrics::quantile(st[k], 0.5));
    std::printf("\n");
  }
}

}  // namespace

int run_bench_layers(const BenchLayersOptions& o) {
  if (auto fault = options_fault(o)) {
    std::fprintf(stderr, "rd2h bench layers: %s\n", fault->c_str());
    return 2;
  }
  auto setups = make_setups(o);
  Floors floors;
  Status st = setups ? warm_up(*setups, o) : setups.status();
  if (st) st = measure_rounds(*setups, o, floors);
  if (!st) {
    std::fprintf(stderr, "rd2h bench layers: %s\n", st.to_string().c_str());
    return 1;
  }
  const uint32_t traced = std::max<uint32_t>(50, o.layers / 5);
  std::vector<std::vector<std::vector<double>>> stages;
  for (auto& s : *setups) {
    auto kept = std::move(s->samples);
    stages.push_back(stage_times(*s, traced));
    s->samples = std::move(kept);
  }
  floors.wake = wakeup_round_trips(o.layers);
  print_layers(*setups, o);
  print_floors(*setups, floors);
  print_stages(*setups, stages, traced);
  return 0;
}

}  // namespace rd2h::tools
