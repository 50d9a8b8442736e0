// Metrics in Prometheus's text exposition format (version 0.0.4): counters, gauges and
// histograms, with labels, kept in a Registry that renders them for GET /metrics. The one
// place the format is written.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace rd2h::metrics {

inline constexpr const char* kContentType = "text/plain; version=0.0.4; charset=utf-8";

class Counter {
 public:
  void inc(uint64_t n = 1) { v_.fetch_add(n, std::memory_order_relaxed); }
  uint64_t value() const { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> v_{0};
};

class Gauge {
 public:
  void add(int64_t n) { v_.fetch_add(n, std::memory_order_relaxed); }
  void set(int64_t n) { v_.store(n, std::memory_order_relaxed); }
  int64_t value() const { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> v_{0};
};

// Counts of observations at or below each upper bound (ascending), their sum and count.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double value);
  // Adds counts kept elsewhere with the same bounds: `buckets` per bound plus the +Inf
  // bucket, not cumulative.
  void add(const std::vector<uint64_t>& buckets, double sum);

  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> buckets;  // per bound, then +Inf; not cumulative
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot snapshot() const;

 private:
  const std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> buckets_;
  double sum_ = 0;
  uint64_t count_ = 0;
};

// Upper bounds for latencies in seconds, from 100 us to 60 s.
std::vector<double> latency_buckets();
// Bounds in seconds for transfers (a layer's read: 5 us up to 1 s).
std::vector<double> transfer_buckets();

// The p-quantile (0..1] of `values` by nearest rank: the smallest value with at least a
// share p of them at or below it; 0 for no values. The one definition every figure rd2h
// reports from samples uses (the demo, the benches, pd-read).
double quantile(std::vector<double> values, double p);

// One metric name with its label names; a series per distinct tuple of label values,
// made at its first use and kept for the registry's life.
template <typename M>
class Family {
 public:
  Family(std::vector<std::string> label_names, std::function<std::unique_ptr<M>()> make)
      : label_names_(std::move(label_names)), make_(std::move(make)) {}

  M& with(const std::vector<std::string>& values = {}) {
    std::lock_guard lock(mu_);
    auto& m = series_[values];
    if (!m) m = make_();
    return *m;
  }
  const std::vector<std::string>& label_names() const { return label_names_; }
  template <typename F>
  void each(F f) const {
    std::lock_guard lock(mu_);
    for (const auto& [values, m] : series_) f(values, *m);
  }

 private:
  const std::vector<std::string> label_names_;
  const std::function<std::unique_ptr<M>()> make_;
  mutable std::mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<M>> series_;
};

class Registry {
 public:
  Family<Counter>& counter(const std::string& name, const std::string& help,
                           std::vector<std::string> label_names = {});
  Family<Gauge>& gauge(const std::string& name, const std::string& help,
                       std::vector<std::string> label_names = {});
  Family<Histogram>& histogram(const std::string& name, const std::string& help,
                               std::vector<std::string> label_names, std::vector<double> bounds);
  // A gauge, or a counter, read when the registry is rendered (a value kept elsewhere).
  void gauge_callback(const std::string& name, const std::string& help,
                      std::function<double()> read);
  void counter_callback(const std::string& name, const std::string& help,
                        std::function<double()> read);

  std::string render() const;

 private:
  struct Entry {
    std::string name, help, type;
    std::unique_ptr<Family<Counter>> counters;
    std::unique_ptr<Family<Gauge>> gauges;
    std::unique_ptr<Family<Histogram>> histograms;
    std::function<double()> read;
  };
  Entry& add(const std::string& name, const std::string& help, const char* type);

  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Entry>> entries_;  // in the order registered
};

}  // namespace rd2h::metrics
