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
    internal_id = it->second.internal_id;
    to_report_.push_back(
        {ext_id, std::move(it->second.internal_id), reads_in_flight_.empty() ? 0 : reads_begun_});
    requests_.erase(it);
  }
  early_.erase(ext_id);
  source_.erase(ext_id);
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

uint64_t CompletionTracker::read_started() {
  reads_in_flight_.insert(++reads_begun_);
  return reads_begun_;
}

void CompletionTracker::read_ended(uint64_t read) {
  reads_in_flight_.erase(read);
}

void CompletionTracker::read_into(const std::string& ext_id, uint64_t read) {
  auto it = requests_.find(ext_id);
  if (it == requests_.end()) return;
  auto& reads = it->second.reads;
  std::erase_if(reads, [this](uint64_t r) { return reads_in_flight_.count(r) == 0; });
  reads.push_back(read);
}

bool CompletionTracker::any_in_flight(const std::vector<uint64_t>& reads) const {
  return std::any_of(reads.begin(), reads.end(),
                     [this](uint64_t r) { return reads_in_flight_.count(r) != 0; });
}

bool CompletionTracker::read_on(const std::string& ext_id, const std::string& connection,
                                int group_member_idx, bool owes) {
  if (!known(ext_id)) return true;
  if (owes) owed_[connection].insert(ext_id);
  auto [it, fresh] = source_[ext_id].emplace(group_member_idx, connection);
  if (fresh || it->second == connection) return true;
  on_failed(ext_id);
  return false;
}

size_t CompletionTracker::connection_lost(const std::string& connection) {
  auto owed = owed_.find(connection);
  if (owed == owed_.end()) return 0;
  size_t failed = 0;
  for (const auto& ext_id : owed->second) {
    if (!known(ext_id) || complete(ext_id)) continue;
    on_failed(ext_id);
    ++failed;
  }
  owed_.erase(owed);
  return failed;
}

Status CompletionTracker::on_final_layer(const std::string& ext_id, int group_member_idx,
                                         int tp_ratio, const std::string& connection) {
  if (auto owed = owed_.find(connection); owed != owed_.end()) {
    owed->second.erase(ext_id);
    if (owed->second.empty()) owed_.erase(owed);
  }
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

RankTerminal CompletionTracker::terminal(std::chrono::steady_clock::time_point now) {
  expire(now);
  RankTerminal mine;
  for (const auto& [ext_id, r] : requests_) {
    if (r.terminal) mine.emplace(ext_id, r.signals.failed);
  }
  return mine;
}

Finished CompletionTracker::finish(const std::vector<RankTerminal>& ranks) {
  const Combined done = combine(ranks);
  Finished out;
  const auto append = [](std::vector<int64_t>& to, const std::vector<int64_t>& blocks) {
    to.insert(to.end(), blocks.begin(), blocks.end());
  };
  for (const auto* list : {&done.finished, &done.failed}) {
    const bool failed = list == &done.failed;
    for (const auto& ext_id : *list) {
      auto it = requests_.find(ext_id);
      if (it == requests_.end()) continue;  // removed while the ranks gathered
      const Destinations& d = it->second.destinations;
      if (failed && any_in_flight(it->second.reads)) {
        // Another contributor's read still writes its blocks: handed back once it ended.
        failed_later_.push_back({ext_id, std::move(it->second.internal_id),
                                 std::move(it->second.destinations), std::move(it->second.reads)});
      } else {
        (failed ? out.failed : out.finished).push_back(std::move(it->second.internal_id));
        append(failed ? out.invalid_main_blocks : out.loaded_main_blocks, d.main);
        append(failed ? out.invalid_indexer_blocks : out.loaded_indexer_blocks, d.indexer);
        out.ended_ext_ids.push_back(ext_id);
      }
      requests_.erase(it);
      for (auto owed = owed_.begin(); owed != owed_.end();) {
        owed->second.erase(ext_id);
        owed = owed->second.empty() ? owed_.erase(owed) : std::next(owed);
      }
      source_.erase(ext_id);
    }
  }
  for (auto it = failed_later_.begin(); it != failed_later_.end();) {
    if (any_in_flight(it->reads)) {
      ++it;
      continue;
    }
    out.failed.push_back(std::move(it->internal_id));
    append(out.invalid_main_blocks, it->destinations.main);
    append(out.invalid_indexer_blocks, it->destinations.indexer);
    out.ended_ext_ids.push_back(it->ext_id);
    it = failed_later_.erase(it);
  }
  for (auto it = to_report_.begin(); it != to_report_.end();) {
    if (it->read != 0 && !reads_in_flight_.empty() && *reads_in_flight_.begin() <= it->read) {
      ++it;  // a read begun before it was removed may be writing its blocks: next time
      continue;
    }
    out.ended_ext_ids.push_back(it->ext_id);
    out.finished.push_back(std::move(it->internal_id));
    it = to_report_.erase(it);
  }
  return out;
}

}  // namespace rd2h::decode
