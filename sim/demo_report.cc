#include "sim/demo_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>

namespace rd2h::sim {

using nlohmann::json;

double hidden_fraction(const std::vector<Interval>& reads, std::vector<Interval> compute) {
  // Merge the compute intervals, then measure each read against the merged set.
  std::sort(compute.begin(), compute.end(),
            [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
  std::vector<Interval> merged;
  for (const auto& c : compute) {
    if (!merged.empty() && c.begin <= merged.back().end) {
      merged.back().end = std::max(merged.back().end, c.end);
    } else {
      merged.push_back(c);
    }
  }
  double total = 0, hidden = 0;
  for (const auto& r : reads) {
    total += static_cast<double>(r.end - r.begin);
    auto it = std::upper_bound(merged.begin(), merged.end(), r.begin,
                               [](int64_t t, const Interval& c) { return t < c.end; });
    for (; it != merged.end() && it->begin < r.end; ++it) {
      hidden += static_cast<double>(std::min(r.end, it->end) - std::max(r.begin, it->begin));
    }
  }
  return total > 0 ? hidden / total : 0;
}

namespace {

// Request -> (Decode instance, rank) -> (start, duration) of its latest read of the last
// layer there.
using LastReads = std::map<std::string, std::map<std::pair<int, int>, std::pair<int64_t, int64_t>>>;

// What summarize takes from the engines' events before it reduces them to figures.
struct Timeline {
  std::vector<Interval> reads, compute;
  std::vector<double> read_us, compute_us;
  std::map<std::string, int64_t> prefill_done, kv_ready, kv_complete;
  LastReads last_reads;
  int64_t first_read = INT64_MAX, last_read = 0;
};

// The highest layer any engine computed, or -1.
int64_t last_computed_layer(const std::vector<EngineTrace>& engines) {
  int64_t last_layer = -1;
  for (const auto& e : engines) {
    for (const auto& ev : e.events) {
      if (ev.name == "compute") last_layer = std::max(last_layer, ev.layer);
    }
  }
  return last_layer;
}

// A Decode read: its interval and size; when it reads the last layer, the latest such read
// of each request it carries (`ev.request` lists them, comma-separated) on its rank.
void add_read(const EngineTrace& e, const trace::Event& ev, int64_t last_layer, Timeline& t,
              DemoSummary& s) {
  t.reads.push_back({ev.ts_us, ev.ts_us + ev.dur_us});
  t.read_us.push_back(static_cast<double>(ev.dur_us));
  s.bytes += ev.bytes;
  ++s.reads;
  t.first_read = std::min(t.first_read, ev.ts_us);
  if (ev.layer == last_layer) {
    size_t begin = 0;
    while (begin <= ev.request.size()) {
      size_t end = ev.request.find(',', begin);
      if (end == std::string::npos) end = ev.request.size();
      auto& slot = t.last_reads[ev.request.substr(begin, end - begin)][{e.instance, ev.rank}];
      if (ev.ts_us >= slot.first) slot = {ev.ts_us, ev.dur_us};
      begin = end + 1;
    }
  }
  t.last_read = std::max(t.last_read, ev.ts_us + ev.dur_us);
}

// The engines' events sorted into a Timeline; the read and slot-wait counts go into `s`.
Timeline collect_timeline(const std::vector<EngineTrace>& engines, DemoSummary& s) {
  Timeline t;
  const int64_t last_layer = last_computed_layer(engines);
  for (const auto& e : engines) {
    for (const auto& ev : e.events) {
      if (e.role == "decode" && ev.name == "read") {
        add_read(e, ev, last_layer, t, s);
      } else if (e.role == "prefill" && ev.name == "compute") {
        t.compute.push_back({ev.ts_us, ev.ts_us + ev.dur_us});
        t.compute_us.push_back(static_cast<double>(ev.dur_us));
      } else if (e.role == "prefill" && ev.name == "slot wait") {
        ++s.slot_waits;
        s.slot_wait_us += static_cast<double>(ev.dur_us);
      } else if (ev.name == "prefill done") {
        t.prefill_done[ev.request] = ev.ts_us;
      } else if (ev.name == "kv ready") {
        t.kv_ready[ev.request] = ev.ts_us;
      } else if (ev.name == "kv complete") {
        auto& at = t.kv_complete[ev.request];
        at = std::max(at, ev.ts_us);  // the last Decode rank
      }
    }
  }
  return t;
}

// The read times, the bandwidths and the share of the reads hidden behind compute.
void summarize_transfer(const Timeline& t, DemoSummary& s) {
  s.read_p50_us = quantile(t.read_us, 0.5);
  s.read_p99_us = quantile(t.read_us, 0.99);
  s.compute_p50_us = quantile(t.compute_us, 0.5);
  double busy_us = 0;
  for (double d : t.read_us) busy_us += d;
  if (busy_us > 0) s.link_gbps = static_cast<double>(s.bytes) / busy_us / 1e3;
  if (t.last_read > t.first_read) {
    s.aggregate_gbps =
        static_cast<double>(s.bytes) / static_cast<double>(t.last_read - t.first_read) / 1e3;
  }
  s.hidden = hidden_fraction(t.reads, t.compute);
}

// How long after Prefill's last layer each request was ready on Decode, and how that
// compares with its last-layer read.
void summarize_readiness(const Timeline& t, DemoSummary& s) {
  std::vector<double> delays, pickups, last_read_us, ratios;
  for (const auto& [id, done] : t.prefill_done) {
    auto it = t.kv_complete.find(id);
    if (it == t.kv_complete.end()) continue;
    const double delay = static_cast<double>(it->second - done);
    delays.push_back(delay);
    if (auto ready = t.kv_ready.find(id); ready != t.kv_ready.end()) {
      pickups.push_back(static_cast<double>(ready->second - done));
    }
    auto reads_of = t.last_reads.find(id);
    if (reads_of == t.last_reads.end()) continue;
    int64_t slowest = 0;
    for (const auto& [rank, read] : reads_of->second) slowest = std::max(slowest, read.second);
    if (slowest <= 0) continue;
    last_read_us.push_back(static_cast<double>(slowest));
    ratios.push_back(delay / static_cast<double>(slowest));
  }
  s.ready_matched = delays.size();
  s.ready_delay_p50_us = quantile(delays, 0.5);
  s.ready_delay_p99_us = quantile(delays, 0.99);
  s.pickup_delay_p50_us = quantile(pickups, 0.5);
  s.pickup_delay_p99_us = quantile(pickups, 0.99);
  s.last_layer_read_p50_us = quantile(last_read_us, 0.5);
  s.ready_ratio_p50 = quantile(ratios, 0.5);
  s.ready_ratio_p99 = quantile(ratios, 0.99);
}

// The client's counts, time to first token and wall time.
void summarize_client(const std::vector<ClientRecord>& client, DemoSummary& s) {
  std::vector<double> ttft;
  int64_t begin = INT64_MAX, end = 0;
  for (const auto& c : client) {
    ++s.requests;
    s.prompts += c.prompts;
    s.tokens += c.tokens;
    if (!c.ok) ++s.failed;
    if (c.ok && c.first_byte_us > 0) {
      ttft.push_back(static_cast<double>(c.first_byte_us - c.start_us) / 1e3);
    }
    begin = std::min(begin, c.start_us);
    end = std::max(end, c.end_us);
  }
  s.ttft_p50_ms = quantile(ttft, 0.5);
  s.ttft_p99_ms = quantile(ttft, 0.99);
  if (end > begin) s.wall_s = static_cast<double>(end - begin) / 1e6;
}

}  // namespace

DemoSummary summarize(const std::vector<EngineTrace>& engines,
                      const std::vector<ClientRecord>& client) {
  DemoSummary s;
  const Timeline timeline = collect_timeline(engines, s);
  summarize_transfer(timeline, s);
  summarize_readiness(timeline, s);
  summarize_client(client, s);
  return s;
}

std::string format_summary(const DemoSummary& s) {
  // Each figure that has a goal shows it beside, and whether this run met it.
  auto goal = [](bool met, const char* what) {
    return std::string("  [goal: ") + what + (met ? ", met]" : ", MISSED]");
  };
  char buf[2048];
  std::string out;
  std::snprintf(
      buf, sizeof(buf),
      "requests          %llu (%llu prompts, %llu failed) in %.1f s%s\n"
      "prompt tokens     %llu\n",
      static_cast<unsigned long long>(s.requests), static_cast<unsigned long long>(s.prompts),
      static_cast<unsigned long long>(s.failed), s.wall_s,
      goal(s.failed == 0, "none failed").c_str(), static_cast<unsigned long long>(s.tokens));
  out += buf;
  if (s.reads == 0) {
    // No engine timeline (--no-timeline): no transfer figures, rather than zeros.
    out += "transfer figures  none (the engines' timeline was off)\n";
  } else {
    std::snprintf(
        buf, sizeof(buf),
        "KV moved          %.3f GB (%llu bytes) in %llu layer reads\n"
        "layer read        p50 %.0f us, p99 %.0f us\n"
        "transfer          %.2f GB/s per read in flight, %.2f GB/s over the run\n"
        "hidden behind Prefill compute  %.1f%% of the read time (layer compute p50 %.0f us)%s\n"
        "Decode-ready delay after the last Prefill layer  p50 %.0f us, p99 %.0f us (%zu "
        "prompts)\n"
        "  over the prompt's last-layer read (p50 %.0f us)  p50 %.1fx, p99 %.1fx%s\n"
        "  until Decode's engine core scheduled it  p50 %.0f us, p99 %.0f us\n"
        "Prefill slot waits  %llu, %.1f ms in total\n",
        static_cast<double>(s.bytes) / 1e9, static_cast<unsigned long long>(s.bytes),
        static_cast<unsigned long long>(s.reads), s.read_p50_us, s.read_p99_us, s.link_gbps,
        s.aggregate_gbps, 100.0 * s.hidden, s.compute_p50_us,
        goal(s.hidden >= kHiddenGoal, "at least 90%").c_str(), s.ready_delay_p50_us,
        s.ready_delay_p99_us, s.ready_matched, s.last_layer_read_p50_us, s.ready_ratio_p50,
        s.ready_ratio_p99, goal(s.ready_ratio_p50 <= kReadyRatioGoal, "p50 at most 1.5x").c_str(),
        s.pickup_delay_p50_us, s.pickup_delay_p99_us, static_cast<unsigned long long>(s.slot_waits),
        s.slot_wait_us / 1e3);
    out += buf;
  }
  std::snprintf(buf, sizeof(buf), "time to first token  p50 %.1f ms, p99 %.1f ms\n", s.ttft_p50_ms,
                s.ttft_p99_ms);
  return out + buf;
}

namespace {

// The earliest timestamp of the run, which the trace counts from (0 for an empty run).
int64_t trace_origin(const std::vector<EngineTrace>& engines,
                     const std::vector<ClientRecord>& client) {
  int64_t origin = INT64_MAX;
  for (const auto& e : engines) {
    for (const auto& ev : e.events) origin = std::min(origin, ev.ts_us);
  }
  for (const auto& c : client) origin = std::min(origin, c.start_us);
  return origin == INT64_MAX ? 0 : origin;
}

json process_name(int pid, const std::string& name) {
  return {{"ph", "M"}, {"name", "process_name"}, {"pid", pid}, {"args", {{"name", name}}}};
}

json thread_name(int pid, int tid, const std::string& name) {
  return {
      {"ph", "M"}, {"name", "thread_name"}, {"pid", pid}, {"tid", tid}, {"args", {{"name", name}}}};
}

// The client as process 1, one span per request.
void add_client(const std::vector<ClientRecord>& client, int64_t origin, json& events) {
  events.push_back(process_name(1, "client"));
  events.push_back(thread_name(1, 0, "requests"));
  for (const auto& c : client) {
    json args = {{"prompts", c.prompts}, {"tokens", c.tokens}};
    if (c.first_byte_us > 0)
      args["ttft_ms"] = static_cast<double>(c.first_byte_us - c.start_us) / 1e3;
    if (!c.ok) args["error"] = c.error;
    events.push_back({{"ph", "X"},
                      {"name", c.id},
                      {"cat", "client"},
                      {"pid", 1},
                      {"tid", 0},
                      {"ts", c.start_us - origin},
                      {"dur", c.end_us - c.start_us},
                      {"args", args}});
  }
}

// One engine event on thread `tid` of process `pid`: a span, or an instant without a
// duration.
json engine_event(const trace::Event& ev, int pid, int tid, int64_t origin) {
  json args = json::object();
  if (ev.layer >= 0) args["layer"] = ev.layer;
  if (ev.bytes > 0) args["bytes"] = ev.bytes;
  if (!ev.request.empty()) args["request"] = ev.request;
  json out = {{"name", ev.layer >= 0 ? ev.name + " L" + std::to_string(ev.layer) : ev.name},
              {"cat", ev.lane},
              {"pid", pid},
              {"tid", tid},
              {"ts", ev.ts_us - origin},
              {"args", args}};
  if (ev.dur_us >= 0) {
    out["ph"] = "X";
    out["dur"] = ev.dur_us;
  } else {
    out["ph"] = "i";
    out["s"] = "t";
  }
  return out;
}

// An engine as a process (Prefill from 100, Decode from 200), a thread per rank and lane.
void add_engine(const EngineTrace& e, int64_t origin, json& events) {
  const std::vector<std::string> lanes = {"core", "compute", "sender", "reader"};
  const int pid = (e.role == "prefill" ? 100 : 200) + e.instance;
  events.push_back(process_name(pid, (e.role == "prefill" ? "Prefill " : "Decode ") +
                                         std::to_string(e.instance) + " (TP " +
                                         std::to_string(e.tp) + ")"));
  std::map<int, std::string> threads;
  for (const auto& ev : e.events) {
    const auto lane = std::find(lanes.begin(), lanes.end(), ev.lane) - lanes.begin();
    const int tid = (ev.rank + 1) * 10 + static_cast<int>(lane);
    threads[tid] = ev.rank < 0 ? "engine core" : "rank " + std::to_string(ev.rank) + " " + ev.lane;
    events.push_back(engine_event(ev, pid, tid, origin));
  }
  for (const auto& [tid, name] : threads) events.push_back(thread_name(pid, tid, name));
}

}  // namespace

std::string chrome_trace(const std::vector<EngineTrace>& engines,
                         const std::vector<ClientRecord>& client) {
  const int64_t origin = trace_origin(engines, client);
  json events = json::array();
  add_client(client, origin, events);
  for (const auto& e : engines) add_engine(e, origin, events);
  return json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump();
}

}  // namespace rd2h::sim
