#include "util/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace rd2h::metrics {

namespace {

std::string escape(const std::string& v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\' || c == '"') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  return fmt::format("{}", v);
}

// {a="x",b="y"}, with `extra` (e.g. le="0.1") last; empty when there are no labels.
std::string labels(const std::vector<std::string>& names, const std::vector<std::string>& values,
                   const std::string& extra = {}) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < values.size(); ++i) {
    out += (out.empty() ? "" : ",") + names[i] + "=\"" + escape(values[i]) + "\"";
  }
  if (!extra.empty()) out += (out.empty() ? "" : ",") + extra;
  return out.empty() ? out : "{" + out + "}";
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), buckets_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  const size_t i = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), value) -
                                       bounds_.begin());
  std::lock_guard lock(mu_);
  ++buckets_[i];
  sum_ += value;
  ++count_;
}

void Histogram::add(const std::vector<uint64_t>& buckets, double sum) {
  std::lock_guard lock(mu_);
  for (size_t i = 0; i < buckets.size() && i < buckets_.size(); ++i) {
    buckets_[i] += buckets[i];
    count_ += buckets[i];
  }
  sum_ += sum;
}

Histogram::Snapshot Histogram::snapshot() const {
  std::lock_guard lock(mu_);
  return {bounds_, buckets_, sum_, count_};
}

std::vector<double> transfer_buckets() {
  return {0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025,
          0.005,    0.01,    0.025,    0.05,    0.1,    0.25,    0.5,    1};
}

std::vector<double> latency_buckets() {
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
          0.1,    0.25,    0.5,    1,     2.5,    5,     10,   30,    60};
}

Registry::Entry& Registry::add(const std::string& name, const std::string& help, const char* type) {
  std::lock_guard lock(mu_);
  entries_.push_back(std::make_unique<Entry>());
  Entry& e = *entries_.back();
  e.name = name;
  e.help = help;
  e.type = type;
  return e;
}

Family<Counter>& Registry::counter(const std::string& name, const std::string& help,
                                   std::vector<std::string> label_names) {
  Entry& e = add(name, help, "counter");
  e.counters = std::make_unique<Family<Counter>>(std::move(label_names),
                                                 [] { return std::make_unique<Counter>(); });
  if (e.counters->label_names().empty()) e.counters->with();  // present at 0 from the start
  return *e.counters;
}

Family<Gauge>& Registry::gauge(const std::string& name, const std::string& help,
                               std::vector<std::string> label_names) {
  Entry& e = add(name, help, "gauge");
  e.gauges = std::make_unique<Family<Gauge>>(std::move(label_names),
                                             [] { return std::make_unique<Gauge>(); });
  if (e.gauges->label_names().empty()) e.gauges->with();
  return *e.gauges;
}

Family<Histogram>& Registry::histogram(const std::string& name, const std::string& help,
                                       std::vector<std::string> label_names,
                                       std::vector<double> bounds) {
  Entry& e = add(name, help, "histogram");
  e.histograms = std::make_unique<Family<Histogram>>(
      std::move(label_names), [bounds] { return std::make_unique<Histogram>(bounds); });
  if (e.histograms->label_names().empty()) e.histograms->with();
  return *e.histograms;
}

void Registry::gauge_callback(const std::string& name, const std::string& help,
                              std::function<double()> read) {
  add(name, help, "gauge").read = std::move(read);
}

void Registry::counter_callback(const std::string& name, const std::string& help,
                                std::function<double()> read) {
  add(name, help, "counter").read = std::move(read);
}

std::string Registry::render() const {
  std::string out;
  std::lock_guard lock(mu_);
  for (const auto& e : entries_) {
    out += "# HELP " + e->name + " " + e->help + "\n# TYPE " + e->name + " " + e->type + "\n";
    if (e->read) out += e->name + " " + number(e->read()) + "\n";
    if (e->counters) {
      e->counters->each([&](const std::vector<std::string>& values, const Counter& c) {
        out += e->name + labels(e->counters->label_names(), values) + " " +
               std::to_string(c.value()) + "\n";
      });
    }
    if (e->gauges) {
      e->gauges->each([&](const std::vector<std::string>& values, const Gauge& g) {
        out += e->name + labels(e->gauges->label_names(), values) + " " +
               std::to_string(g.value()) + "\n";
      });
    }
    if (e->histograms) {
      e->histograms->each([&](const std::vector<std::string>& values, const Histogram& h) {
        const auto s = h.snapshot();
        const auto& names = e->histograms->label_names();
        uint64_t cumulative = 0;
        for (size_t i = 0; i <= s.bounds.size(); ++i) {
          cumulative += s.buckets[i];
          const std::string le =
              "le=\"" + (i < s.bounds.size() ? number(s.bounds[i]) : std::string("+Inf")) + "\"";
          out += e->name + "_bucket" + labels(names, values, le) + " " +
                 std::to_string(cumulative) + "\n";
        }
        out += e->name + "_sum" + labels(names, values) + " " + number(s.sum) + "\n";
        out += e->name + "_count" + labels(names, values) + " " + std::to_string(s.count) + "\n";
      });
    }
  }
  return out;
}

double quantile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const auto rank = static_cast<size_t>(std::ceil(p * static_cast<double>(values.size())));
  return values[std::min(values.size() - 1, rank > 0 ? rank - 1 : 0)];
}

}  // namespace rd2h::metrics
