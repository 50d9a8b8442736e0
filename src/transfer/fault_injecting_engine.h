// FaultInjectingEngine: wraps a real TransferEngine and makes chosen batches of reads fail,
// the way a broken link or peer would, so tests exercise failure paths over real transports.
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>

#include "rd2h/transfer/transfer_engine.h"

namespace rd2h::transfer {

enum class FaultPoint {
  kBeforeRead,  // the batch fails without reading anything
  kAfterRead,   // the batch reads, then reports failure (a completion flipped to an error)
};

class FaultInjectingEngine final : public TransferEngine {
 public:
  explicit FaultInjectingEngine(std::shared_ptr<TransferEngine> inner) : inner_(std::move(inner)) {}

  // The next `count` batch reads fail with `status` at `point`.
  void fail_next_reads(int count, Status status, FaultPoint point = FaultPoint::kBeforeRead);
  // Every batch read first sleeps `delay` (a slow link); zero turns it off.
  void delay_reads(std::chrono::milliseconds delay);
  int injected_failures() const;
  // Batch reads after the next `after` wait before reading until release_reads() (for at
  // most a minute): a test can act while a read is in flight, as if the reading process had
  // stalled. held_reads() counts the reads waiting now.
  void hold_reads(int after = 0);
  void release_reads();
  int held_reads() const;
  // Batches posted from now on stay in flight (test() finds them running, wait() waits)
  // until release_completions(), for at most a minute, as reads on a slow link would; they
  // then end as the inner engine's did. completions_held() counts those in flight now.
  void hold_completions();
  void release_completions();
  int completions_held() const;
  // What the engine shares with the requests posted while completions are held.
  struct CompletionHold {
    std::mutex mu;
    std::condition_variable released;
    bool holding = false;
    int in_flight = 0;
  };
  // Connects wait until release_connects() (for at most a minute), as they would for a
  // peer host that answers slowly. held_connects() counts the connects waiting now.
  void hold_connects();
  void release_connects();
  int held_connects() const;

  std::string_view backend_name() const override { return inner_->backend_name(); }
  const EngineConfig& config() const override { return inner_->config(); }
  const std::string& session_id() const override { return inner_->session_id(); }
  Status register_memory(void* addr, size_t length) override {
    return inner_->register_memory(addr, length);
  }
  Expected<MemoryRegion> allocate_memory(size_t length) override {
    return inner_->allocate_memory(length);
  }
  Status unregister_memory(void* addr) override { return inner_->unregister_memory(addr); }
  Expected<std::vector<std::byte>> export_metadata() const override {
    return inner_->export_metadata();
  }
  Expected<SessionHandle> connect(std::span<const std::byte> peer_metadata) override;
  Status disconnect(const SessionHandle& session) override { return inner_->disconnect(session); }
  Expected<SessionInfo> session_info(const SessionHandle& session) const override {
    return inner_->session_info(session);
  }
  // Held, delayed or failed here (a batch held waits in the post, as a stalled reader).
  Expected<std::unique_ptr<ReadRequest>> post_reads(const SessionHandle& session,
                                                    std::span<const ReadOp> ops) override;
  bool supports_notifications() const override { return inner_->supports_notifications(); }
  Status listen_notifications(uint64_t channel) override {
    return inner_->listen_notifications(channel);
  }
  Status open_notifications(const SessionHandle& session, uint64_t channel) override {
    return inner_->open_notifications(session, channel);
  }
  Status send_notification(uint64_t channel, std::span<const std::byte> message) override {
    return inner_->send_notification(channel, message);
  }
  void close_notifications(uint64_t channel) override { inner_->close_notifications(channel); }
  bool get_notifications(std::vector<Notification>& out, bool arm) override {
    return inner_->get_notifications(out, arm);
  }
  int notification_fd() override { return inner_->notification_fd(); }

 private:
  std::shared_ptr<TransferEngine> inner_;
  mutable std::mutex mu_;
  int pending_failures_ = 0;
  Status failure_status_;
  FaultPoint failure_point_ = FaultPoint::kBeforeRead;
  std::chrono::milliseconds delay_{0};
  int injected_ = 0;
  bool holding_ = false;
  int hold_after_ = 0;  // reads still let through before holding
  int held_ = 0;
  std::condition_variable released_;
  bool holding_connects_ = false;
  int held_connects_ = 0;
  std::shared_ptr<CompletionHold> completions_ = std::make_shared<CompletionHold>();
};

}  // namespace rd2h::transfer
