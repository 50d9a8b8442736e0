#include "decode/completion_tracker.h"

#include <algorithm>

namespace rd2h::decode {

CompletionTracker::CompletionTracker(int tp_ratio, size_t max_early)
    : tp_ratio_(tp_ratio < 1 ? 1 : tp_ratio), max_early_(max_early) {}

Status CompletionTracker::add_request(const std::string& ext_id, const std::string& internal_id) {
  if (requests_.count(ext_id) != 0) {
    return already_exists("request " + ext_id + " is already tracked");
  }
  if (removed_.erase(ext_id) != 0) {
    removed_order_.erase(std::find(removed_order_.begin(), removed_order_.end(), ext_id));
  }
  Request r;
  r.internal_id = internal_id;
  if (auto it = early_.find(ext_id); it != early_.end()) {
    r.contributors_done = std::move(it->second.contributors_done);
    r.failed = it->second.failed;
    early_.erase(it);
  }
  update_terminal(r);
  requests_.emplace(ext_id, std::move(r));
  return Status::ok();
}

void CompletionTracker::remove_request(const std::string& ext_id) {
  requests_.erase(ext_id);
  early_.erase(ext_id);
  if (removed_.insert(ext_id).second) {
    removed_order_.push_back(ext_id);
    if (removed_order_.size() > max_early_) {
      removed_.erase(removed_order_.front());
      removed_order_.pop_front();
    }
  }
}

Status CompletionTracker::on_final_layer(const std::string& ext_id, int group_member_idx) {
  if (group_member_idx < 0 || group_member_idx >= tp_ratio_) {
    return invalid_argument("request " + ext_id + ": contributor " +
                            std::to_string(group_member_idx) + " is outside 0.." +
                            std::to_string(tp_ratio_ - 1));
  }
  if (removed_.count(ext_id) != 0) return Status::ok();
  if (auto it = requests_.find(ext_id); it != requests_.end()) {
    it->second.contributors_done.insert(group_member_idx);
    update_terminal(it->second);
    return Status::ok();
  }
  if (early_.count(ext_id) == 0 && early_.size() >= max_early_) {
    return failed_precondition("request " + ext_id + ": " + std::to_string(max_early_) +
                               " completions already wait for requests Decode does not know");
  }
  early_[ext_id].contributors_done.insert(group_member_idx);
  return Status::ok();
}

void CompletionTracker::on_failed(const std::string& ext_id) {
  if (removed_.count(ext_id) != 0) return;
  if (auto it = requests_.find(ext_id); it != requests_.end()) {
    it->second.failed = true;
    update_terminal(it->second);
    return;
  }
  if (early_.count(ext_id) != 0 || early_.size() < max_early_) early_[ext_id].failed = true;
}

void CompletionTracker::update_terminal(Request& r) {
  r.terminal = r.failed || r.contributors_done.size() == static_cast<size_t>(tp_ratio_);
}

Finished combine(const std::vector<RankTerminal>& ranks) {
  Finished out;
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
    if (r.terminal) mine.emplace(ext_id, r.failed);
  }
  return mine;
}

std::vector<Ended> CompletionTracker::take(const std::vector<RankTerminal>& ranks) {
  const Finished done = combine(ranks);
  std::vector<Ended> ended;
  for (const auto* list : {&done.finished, &done.failed}) {
    for (const auto& ext_id : *list) {
      auto it = requests_.find(ext_id);
      if (it == requests_.end()) continue;  // removed while the ranks gathered
      ended.push_back({ext_id, std::move(it->second.internal_id), list == &done.failed});
      requests_.erase(it);
    }
  }
  return ended;
}

Expected<Finished> CompletionTracker::get_finished(const AllGather& all_gather) {
  auto ranks = all_gather(terminal());
  if (!ranks) return ranks.status().with_context("gathering completions across Decode TP ranks");
  Finished out;
  for (auto& e : take(*ranks)) (e.failed ? out.failed : out.finished).push_back(e.internal_id);
  return out;
}

}  // namespace rd2h::decode
