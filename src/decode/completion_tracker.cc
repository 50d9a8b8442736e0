#include "decode/completion_tracker.h"

#include <algorithm>

namespace rd2h::decode {

CompletionTracker::CompletionTracker(size_t max_early) : max_early_(max_early) {}

Status CompletionTracker::add_request(const std::string& ext_id, const std::string& internal_id,
                                      Destinations destinations) {
  if (requests_.count(ext_id) != 0) {
    return already_exists("request " + ext_id + " is already tracked");
  }
  if (removed_.erase(ext_id) != 0) {
    removed_order_.erase(std::find(removed_order_.begin(), removed_order_.end(), ext_id));
  }
  Request r;
  r.internal_id = internal_id;
  r.destinations = std::move(destinations);
  if (auto it = early_.find(ext_id); it != early_.end()) {
    r.signals = std::move(it->second);
    early_.erase(it);
  }
  update_terminal(r);
  requests_.emplace(ext_id, std::move(r));
  return Status::ok();
}

std::optional<std::string> CompletionTracker::remove_request(const std::string& ext_id) {
  std::optional<std::string> internal_id;
  if (auto it = requests_.find(ext_id); it != requests_.end()) {
    internal_id = std::move(it->second.internal_id);
    requests_.erase(it);
  }
  early_.erase(ext_id);
  if (removed_.insert(ext_id).second) {
    removed_order_.push_back(ext_id);
    if (removed_order_.size() > max_early_) {
      removed_.erase(removed_order_.front());
      removed_order_.pop_front();
    }
  }
  return internal_id;
}

const Destinations* CompletionTracker::destinations(const std::string& ext_id) const {
  auto it = requests_.find(ext_id);
  return it == requests_.end() ? nullptr : &it->second.destinations;
}

void CompletionTracker::expire(std::chrono::steady_clock::time_point now) {
  for (auto& [ext_id, r] : requests_) {
    if (now < r.destinations.arrival_deadline) continue;
    r.signals.failed = true;
    update_terminal(r);
  }
}

Status CompletionTracker::record(const std::string& ext_id, Signals& s, int group_member_idx,
                                 int tp_ratio) {
  if (s.contributors != 0 && s.contributors != tp_ratio) {
    s.failed = true;
    return failed_precondition("request " + ext_id + ": contributor " +
                               std::to_string(group_member_idx) + " says tp_ratio " +
                               std::to_string(tp_ratio) + ", an earlier one said " +
                               std::to_string(s.contributors) + "; the request fails");
  }
  s.contributors = tp_ratio;
  s.contributors_done.insert(group_member_idx);
  return Status::ok();
}

Status CompletionTracker::on_final_layer(const std::string& ext_id, int group_member_idx,
                                         int tp_ratio) {
  if (tp_ratio < 1 || group_member_idx < 0 || group_member_idx >= tp_ratio) {
    return invalid_argument("request " + ext_id + ": contributor " +
                            std::to_string(group_member_idx) + " is outside 0.." +
                            std::to_string(tp_ratio - 1) + " (tp_ratio " +
                            std::to_string(tp_ratio) + ")");
  }
  if (removed_.count(ext_id) != 0) return Status::ok();
  if (auto it = requests_.find(ext_id); it != requests_.end()) {
    Status st = record(ext_id, it->second.signals, group_member_idx, tp_ratio);
    update_terminal(it->second);
    return st;
  }
  if (early_.count(ext_id) == 0 && early_.size() >= max_early_) {
    return failed_precondition("request " + ext_id + ": " + std::to_string(max_early_) +
                               " completions already wait for requests Decode does not know");
  }
  return record(ext_id, early_[ext_id], group_member_idx, tp_ratio);
}

void CompletionTracker::on_failed(const std::string& ext_id) {
  if (removed_.count(ext_id) != 0) return;
  if (auto it = requests_.find(ext_id); it != requests_.end()) {
    it->second.signals.failed = true;
    update_terminal(it->second);
    return;
  }
  if (early_.count(ext_id) != 0 || early_.size() < max_early_) early_[ext_id].failed = true;
}

void CompletionTracker::update_terminal(Request& r) {
  const Signals& s = r.signals;
  r.terminal =
      s.failed || (s.contributors > 0 && s.contributors_done.size() == static_cast<size_t>(s.contributors));
}

Combined combine(const std::vector<RankTerminal>& ranks) {
  Combined out;
  if (ranks.empty()) return out;
  for (const auto& [ext_id, failed_here] : ranks.front()) {
    bool everywhere = true, failed = failed_here;
    for (size_t r = 1; r < ranks.size() && everywhere; ++r) {
      auto it = ranks[r].find(ext_id);
      if (it == ranks[r].end()) {
        everywhere = false;
      } else {
        failed = failed || it->second;
      }
    }
    if (everywhere) (failed ? out.failed : out.finished).push_back(ext_id);
  }
  return out;
}

RankTerminal CompletionTracker::terminal() const {
  RankTerminal mine;
  for (const auto& [ext_id, r] : requests_) {
    if (r.terminal) mine.emplace(ext_id, r.signals.failed);
  }
  return mine;
}

std::vector<Ended> CompletionTracker::take(const std::vector<RankTerminal>& ranks) {
  const Combined done = combine(ranks);
  std::vector<Ended> ended;
  for (const auto* list : {&done.finished, &done.failed}) {
    for (const auto& ext_id : *list) {
      auto it = requests_.find(ext_id);
      if (it == requests_.end()) continue;  // removed while the ranks gathered
      ended.push_back({ext_id, std::move(it->second.internal_id), list == &done.failed,
                       std::move(it->second.destinations)});
      requests_.erase(it);
    }
  }
  return ended;
}

}  // namespace rd2h::decode
