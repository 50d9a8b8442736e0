#include "rd2h/common/trace.h"

#include <atomic>
#include <chrono>
#include <mutex>

namespace rd2h::trace {
namespace {

std::atomic<bool> g_enabled{false};
std::atomic<int> g_rank{-1};
std::atomic<uint64_t> g_dropped{0};
std::mutex g_mu;
std::vector<Event>& buffer() {
  static auto* events = new std::vector<Event>();  // outlives every recording thread
  return *events;
}

}  // namespace

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void set_enabled(bool on) {
  g_enabled.store(on, std::memory_order_relaxed);
}
bool enabled() {
  return g_enabled.load(std::memory_order_relaxed);
}
void set_rank(int rank) {
  g_rank.store(rank, std::memory_order_relaxed);
}

void record(Event event) {
  if (event.rank == kThisProcessRank) event.rank = g_rank.load(std::memory_order_relaxed);
  std::lock_guard lock(g_mu);
  auto& events = buffer();
  if (events.size() >= kMaxEvents) {
    g_dropped.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  events.push_back(std::move(event));
}

std::vector<Event> drain() {
  std::lock_guard lock(g_mu);
  std::vector<Event> out;
  out.swap(buffer());
  return out;
}

uint64_t dropped() {
  return g_dropped.load(std::memory_order_relaxed);
}

}  // namespace rd2h::trace
