// rd2h bench layers: the floors under the control overhead, the rounds that measure them and
// the layers alike, and the report (the workers and their layers: bench_layers_workers.cc).
#include "bench_layers.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <optional>
#include <thread>

#include "bench_layers_workers.h"
#include "peers.h"
#include "ucx_am_echo.h"
#include "util/metrics.h"

namespace rd2h::tools {

using namespace bench_layers;

namespace {

using Clock = std::chrono::steady_clock;

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

// Layer ready to read and acknowledged, rd2h's paths against each peer's, on the same
// layers (sizes, blocks per layer, 61 layers in memory of their own).
void print_peers(const std::vector<std::unique_ptr<Setup>>& setups, const BenchLayersOptions& o) {
  auto python = peers_python(o.peers_python);
  std::string tensors;
  for (uint64_t b : o.main_bytes) tensors += std::to_string(b) + ",";
  if (o.indexer_bytes != 0) tensors += std::to_string(o.indexer_bytes) + ",";
  tensors.pop_back();
  std::printf("\nlayer ready -> read and acknowledged (p50 / p99, us), the same layers:\n");
  for (const auto& peer : o.peers) {
    std::optional<nlohmann::json> result;
    std::string why;
    if (!python) {
      why = python.status().message();
    } else {
      auto out = run_peers_harness(
          *python,
          {"layer", "--peer", peer, "--blocks-per-layer", std::to_string(o.blocks),
           "--tensor-bytes", tensors, "--layers", std::to_string(kModelLayers), "--iterations",
           std::to_string(o.layers)},
          std::chrono::seconds(300));
      if (!out) {
        why = out.status().to_string();
      } else {
        for (const auto& j : out->results) {
          if (j.contains("skip")) why = j.value("skip", std::string());
          if (j.contains("error")) why = j.value("error", std::string());
          if (j.contains("p50_s")) result = j;
        }
        if (!result && why.empty()) why = "no result: " + out->last_words;
      }
    }
    if (!result) {
      std::printf("  %s: not measured: %s\n", peer.c_str(), why.c_str());
      continue;
    }
    const double p50 = result->value("p50_s", 0.0) * 1e6, p99 = result->value("p99_s", 0.0) * 1e6;
    std::printf("  %-40s p50 %9.1f  p99 %9.1f\n",
                (result->value("engine", peer) + " (notifications)").c_str(), p50, p99);
    for (const auto& s : setups) {
      std::vector<double> round_trip;
      for (const auto& x : s->samples) round_trip.push_back(x.round_trip_us);
      const double r50 = metrics::quantile(round_trip, 0.5),
                   r99 = metrics::quantile(round_trip, 0.99);
      std::printf(
          "  rd2h, %2u requests, control on %-10s p50 %9.1f  p99 %9.1f  = %.2fx / %.2fx %s's\n",
          s->requests, s->link ? "the link" : "ZeroMQ", r50, r99, r50 / p50, r99 / p99,
          result->value("engine", peer).c_str());
    }
    std::printf("  (%s: %s)\n", result->value("engine", peer).c_str(),
                result->value("settings", std::string()).c_str());
  }
}

}  // namespace

int run_bench_layers(BenchLayersOptions o) {
  if (!o.peers.empty()) o.distinct_layers = true;
  // Layers in memory of their own are each touched once before anything is measured.
  if (o.distinct_layers) o.warmup = std::max(o.warmup, kModelLayers);
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
  if (!o.peers.empty()) print_peers(*setups, o);
  return 0;
}

}  // namespace rd2h::tools
