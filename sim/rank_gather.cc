#include "sim/rank_gather.h"

#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "rd2h/common/deadline.h"
#include "sim/sim_message.h"

namespace rd2h::sim {
namespace {

using nlohmann::json;

std::chrono::milliseconds left(const Deadline& d) {
  return std::chrono::milliseconds(d.remaining_ms());
}

// A rank's set from a message of round `round`, or nothing for a stale or foreign message.
std::optional<decode::RankTerminal> set_of(const json& j, uint64_t round, const char* key) {
  if (!j.is_object() || j.value("round", uint64_t{0}) != round || !j.contains(key)) return {};
  try {
    return j.at(key).get<decode::RankTerminal>();
  } catch (const json::exception&) {
    return {};
  }
}

}  // namespace

Expected<std::unique_ptr<RankGather>> RankGather::bind(int size, const std::string& host,
                                                       std::chrono::milliseconds timeout) {
  std::unique_ptr<RankGather> g(new RankGather(0, size, timeout));
  const std::string url =
      host.find(':') != std::string::npos ? "tcp://[" + host + "]:0" : "tcp://" + host + ":0";
  auto router = IpcRouter::bind(url);
  if (!router) return router.status().with_context("Decode rank 0 all-gather");
  g->router_ = std::move(*router);
  g->url_ = g->router_->url();
  return g;
}

Expected<std::unique_ptr<RankGather>> RankGather::bind_ipc(int size, const std::string& path,
                                                           std::chrono::milliseconds timeout) {
  std::unique_ptr<RankGather> g(new RankGather(0, size, timeout));
  auto router = IpcRouter::bind("ipc://" + path);
  if (!router) return router.status().with_context("Decode rank 0 all-gather");
  g->router_ = std::move(*router);
  g->url_ = g->router_->url();
  return g;
}

Expected<std::unique_ptr<RankGather>> RankGather::connect(int rank, int size,
                                                          const std::string& url,
                                                          std::chrono::milliseconds timeout) {
  std::unique_ptr<RankGather> g(new RankGather(rank, size, timeout));
  auto dealer = IpcDealer::connect(url);
  if (!dealer) return dealer.status().with_context("Decode rank " + std::to_string(rank));
  g->dealer_ = std::move(*dealer);
  g->url_ = url;
  return g;
}

Expected<std::vector<decode::RankTerminal>> RankGather::gather(const decode::RankTerminal& mine) {
  const uint64_t round = ++round_;
  const Deadline deadline(timeout_);
  const std::string who =
      "Decode rank " + std::to_string(rank_) + ", all-gather round " + std::to_string(round) + ": ";
  if (size_ == 1) return std::vector<decode::RankTerminal>{mine};
  if (rank_ != 0) {
    RD2H_RETURN_IF_ERROR(dealer_->send(pack({{"round", round}, {"rank", rank_}, {"set", mine}})));
    while (!deadline.expired()) {
      auto in = dealer_->receive(left(deadline));
      if (!in) return in.status().with_context(who);
      if (!in->has_value()) continue;
      json j = unpack(**in);
      if (!j.is_object() || j.value("round", uint64_t{0}) != round) continue;  // stale
      try {
        auto sets = j.at("sets").get<std::vector<decode::RankTerminal>>();
        if (static_cast<int>(sets.size()) == size_) return sets;
      } catch (const json::exception&) {
      }
      return internal_error(who + "rank 0 answered with a malformed gather");
    }
    return timeout_error(who + "rank 0 did not answer in time");
  }
  std::vector<decode::RankTerminal> sets(static_cast<size_t>(size_));
  sets[0] = mine;
  std::map<int, std::string> identities;
  while (static_cast<int>(identities.size()) < size_ - 1) {
    if (deadline.expired()) {
      return timeout_error(who + std::to_string(size_ - 1 - static_cast<int>(identities.size())) +
                           " of the other ranks did not gather in time");
    }
    auto in = router_->receive(left(deadline));
    if (!in) return in.status().with_context(who);
    if (!in->has_value()) continue;
    json j = unpack((*in)->payload);
    auto set = set_of(j, round, "set");
    const int rank = set ? j.value("rank", -1) : -1;
    if (rank < 1 || rank >= size_) continue;  // stale or foreign
    sets[static_cast<size_t>(rank)] = std::move(*set);
    identities[rank] = (*in)->identity;
  }
  const auto reply = pack({{"round", round}, {"sets", sets}});
  for (const auto& [rank, identity] : identities) {
    RD2H_RETURN_IF_ERROR(router_->send(identity, reply).with_context(who));
  }
  return sets;
}

}  // namespace rd2h::sim
