// The reader's tests' ground: a Decode rank's reader over the KV fixture's Decode pool, a
// ZeroMQ DEALER to it speaking for Prefill, and a one-rank all-gather.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "decode/kv_fixture.h"
#include "decode/reader.h"
#include "rd2h/common/deadline.h"

namespace rd2h::testing {

using namespace std::chrono_literals;

inline const decode::AllGather kAlone =
    [](const decode::RankTerminal& mine) -> Expected<std::vector<decode::RankTerminal>> {
  return std::vector<decode::RankTerminal>{mine};
};

class ReaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    decode::ReaderConfig config;
    config.hold_timeout = 500ms;
    start_reader(config);
  }
  void start_reader(const decode::ReaderConfig& config) {
    dealer_.reset();
    reader_.reset();
    if (!decode_engine_)
      decode_engine_ = std::shared_ptr<transfer::TransferEngine>(std::move(decode_.engine));
    decode::DecodeLayout layout;
    for (int l = 0; l < kLayers; ++l) layout[layer_name(l)] = decode_.tensors(l);
    auto r = decode::Reader::start(config, decode_engine_, std::move(layout), context_);
    ASSERT_TRUE(r) << r.status().to_string();
    reader_ = std::move(*r);
    auto d = control::DealerChannel::connect(context_, reader_->url());
    ASSERT_TRUE(d);
    dealer_ = std::move(*d);
  }
  std::vector<std::byte> exchange(const std::vector<std::byte>& payload) {
    EXPECT_TRUE(dealer_->send(payload).is_ok());
    auto reply = dealer_->receive(10s);
    EXPECT_TRUE(reply && reply->has_value()) << "no reply within 10 s";
    return reply && reply->has_value() ? **reply : std::vector<std::byte>{};
  }
  protocol::Message exchange_message(const std::vector<std::byte>& payload) {
    auto m = protocol::decode_message(exchange(payload));
    EXPECT_TRUE(m) << m.status().to_string();
    return m ? *m : protocol::Message{};
  }
  // Sends MF_META as an rd2h Prefill does; its requests then complete on commit().
  void send_mf_meta(const protocol::MfMeta& m) {
    EXPECT_TRUE(protocol::is_commit_ack(exchange(protocol::encode(m))));
  }
  // What an rd2h Prefill sends on the READ_DONE of a readiness that completed `ids`; returns
  // once the reader took it (an empty readiness behind it is answered after).
  void commit(int layer, std::vector<std::string> ids) {
    EXPECT_TRUE(dealer_->send(protocol::encode(protocol::KvCommit{layer, std::move(ids)})).is_ok());
    EXPECT_TRUE(std::holds_alternative<protocol::ReadDone>(
        exchange_message(protocol::encode(ready(0, {})))));
  }
  // Decode reads its destinations after the reader reports the request finished, which
  // synchronises through the reader's lock; a test checking bytes right after a READ_DONE
  // (which travels through ZeroMQ, invisible to ThreadSanitizer) does the same.
  void sync_with_reader() { (void)reader_->tracked_requests(); }
  protocol::ReadReadyBatch ready(int layer, std::vector<protocol::ReadReq> reqs,
                                 std::vector<std::string> done = {}) {
    return {layer, layer_name(layer), std::move(reqs), std::move(done), 0, 1};
  }

  Pool prefill_{transfer::Role::kPrefill, true};
  Pool decode_{transfer::Role::kDecode, false};
  std::shared_ptr<transfer::TransferEngine> decode_engine_;
  std::shared_ptr<control::Context> context_ = control::Context::create();
  std::unique_ptr<decode::Reader> reader_;
  std::unique_ptr<control::DealerChannel> dealer_;
};

// Waits, bounded, until the reader holds `n` readiness messages.
inline bool wait_held(const decode::Reader& reader, size_t n) {
  Deadline deadline(10s);
  while (reader.stats().held_now != n) {
    if (deadline.expired()) return false;
    std::this_thread::yield();
  }
  return true;
}

}  // namespace rd2h::testing
