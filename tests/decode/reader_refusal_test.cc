// What a Decode rank's reader refuses, answering Prefill with the reason: readiness without
// MF_META, malformed or over a limit, an MF_META of another model or version, frames too large.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <variant>
#include <zmq.hpp>

#include "decode/reader.h"
#include "decode/reader_fixture.h"
#include "rd2h/common/deadline.h"

namespace rd2h::decode {
namespace {

using namespace std::chrono_literals;

using namespace rd2h::testing;

TEST_F(ReaderTest, ReadinessBeforeMfMetaIsAnsweredReadFailed) {
  auto m = exchange_message(protocol::encode(ready(2, {})));
  ASSERT_TRUE(std::holds_alternative<protocol::ReadFailed>(m));
  EXPECT_EQ(std::get<protocol::ReadFailed>(m).layer_idx, 2);
  EXPECT_NE(std::get<protocol::ReadFailed>(m).error.find("no MF_META"), std::string::npos);
}

TEST_F(ReaderTest, AReadinessOfUnknownRequestsWithoutMfMetaIsAnsweredAtOnceNotHeld) {
  ReaderConfig config;
  config.hold_timeout = 30s;  // longer than the reply is waited for below
  start_reader(config);
  ASSERT_TRUE(dealer_->send(protocol::encode(ready(3, {{"unknown", {1}, {1}, 0, 0}}))).is_ok());
  auto reply = dealer_->receive(10s);
  ASSERT_TRUE(reply && reply->has_value()) << "the readiness was held, not answered";
  auto m = protocol::decode_message(**reply);
  ASSERT_TRUE(m && std::holds_alternative<protocol::ReadFailed>(*m));
  EXPECT_EQ(std::get<protocol::ReadFailed>(*m).layer_idx, 3);
  EXPECT_NE(std::get<protocol::ReadFailed>(*m).error.find("no MF_META"), std::string::npos);
  EXPECT_EQ(reader_->stats().readiness_held, 0u);
}

TEST_F(ReaderTest, AMalformedReadinessIsAnsweredForItsLayer) {
  send_mf_meta(mf_meta(prefill_));
  // read_reqs as a str: undecodable, but layer 7 can be read and is answered.
  std::vector<std::byte> broken;
  for (int b : {0x94, 0xc4, 0x10}) broken.push_back(static_cast<std::byte>(b));
  for (char c : std::string("read_ready_batch")) broken.push_back(static_cast<std::byte>(c));
  for (int b : {0x07, 0xa1, int{'x'}, 0xa1, int{'x'}}) broken.push_back(static_cast<std::byte>(b));
  auto m = exchange_message(broken);
  ASSERT_TRUE(std::holds_alternative<protocol::ReadFailed>(m));
  EXPECT_EQ(std::get<protocol::ReadFailed>(m).layer_idx, 7);
}

TEST_F(ReaderTest, ALayoutMismatchFailsTheLayerAndWritesNothing) {
  auto meta = mf_meta(prefill_);
  meta.layers[1].second.block_len[2] = 32;  // Prefill's indexer blocks of layer 1 differ
  send_mf_meta(meta);
  ASSERT_TRUE(reader_->add_request("req-1", "int-1", {5}, {6}).is_ok());
  auto m = exchange_message(protocol::encode(ready(1, {{"req-1", {2}, {3}, 0, 0}}, {"req-1"})));
  ASSERT_TRUE(std::holds_alternative<protocol::ReadFailed>(m));
  const auto& failed = std::get<protocol::ReadFailed>(m);
  EXPECT_EQ(failed.layer_idx, 1);
  EXPECT_NE(failed.error.find("indexer block bytes 32 on Prefill != 64 on Decode"),
            std::string::npos)
      << failed.error;
  sync_with_reader();
  for (size_t t = 0; t < 3; ++t) EXPECT_TRUE(decode_.zero(1, t, t < 2 ? 5 : 6)) << "tensor " << t;
  auto done = reader_->get_finished(kAlone);
  EXPECT_EQ(done->failed, std::vector<std::string>{"int-1"});
}

TEST_F(ReaderTest, AnIncompatiblePrefillIsRefusedWithBothVersions) {
  auto meta = mf_meta(prefill_);
  meta.protocol_version = protocol::kProtocolVersion + 1;
  auto m = exchange_message(protocol::encode(meta));
  ASSERT_TRUE(std::holds_alternative<protocol::ReadFailed>(m));
  EXPECT_NE(std::get<protocol::ReadFailed>(m).error.find("protocol version"), std::string::npos);
}

// A ZMTP 3.0 peer by hand, over a plain TCP socket: it can claim a frame size no ZeroMQ
// socket would send without having the bytes.
class RawZmtpPeer {
 public:
  explicit RawZmtpPeer(const std::string& url) {
    const auto colon = url.rfind(':');
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(std::stoi(url.substr(colon + 1))));
    ::inet_pton(AF_INET, url.substr(6, colon - 6).c_str(), &addr.sin_addr);
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    connected_ = fd_ >= 0 && ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~RawZmtpPeer() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool connected() const { return connected_; }
  bool send(const std::string& bytes) {
    return ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) ==
           static_cast<ssize_t>(bytes.size());
  }
  // Greeting (NULL mechanism) and READY as a DEALER.
  bool handshake() {
    std::string greeting(64, '\0');
    greeting[0] = '\xff';
    greeting[9] = '\x7f';
    greeting[10] = 3;
    greeting.replace(12, 4, "NULL");
    std::string ready = "\x04\x1c\x05READY\x0bSocket-Type";
    ready += std::string("\x00\x00\x00\x06", 4) + "DEALER";
    return send(greeting) && send(ready);
  }
  // Whether the other end closed the connection within `timeout` (what it sent is read
  // and discarded).
  bool closed_within(std::chrono::milliseconds timeout) {
    Deadline deadline(timeout);
    char buf[4096];
    while (!deadline.expired()) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(deadline.remaining_ms())) <= 0) continue;
      const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
      if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) return true;
    }
    return false;
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

TEST_F(ReaderTest, AFrameOverTheLimitClosesItsConnectionAndOthersAreStillServed) {
  RawZmtpPeer raw(reader_->url());
  ASSERT_TRUE(raw.connected());
  ASSERT_TRUE(raw.handshake());
  // A long frame header claiming 1 GiB, then a little of it.
  std::string frame = "\x02";
  const uint64_t size = uint64_t{1} << 30;
  for (int shift = 56; shift >= 0; shift -= 8) frame += static_cast<char>((size >> shift) & 0xff);
  frame += std::string(1024, 'x');
  ASSERT_TRUE(raw.send(frame));
  EXPECT_TRUE(raw.closed_within(10s)) << "the rank kept a connection announcing a 1 GiB frame";
  send_mf_meta(mf_meta(prefill_));  // the rank still serves its other connections
  auto m = exchange_message(protocol::encode(ready(1, {})));
  ASSERT_TRUE(std::holds_alternative<protocol::ReadDone>(m));
}

TEST_F(ReaderTest, AnMfMetaFailingItsChecksIsRefusedWithTheReason) {
  auto meta = mf_meta(prefill_);
  meta.layers[0].second.block_len.pop_back();
  auto m = exchange_message(protocol::encode(meta));
  ASSERT_TRUE(std::holds_alternative<protocol::ReadFailed>(m)) << "no refusal";
  const auto& error = std::get<protocol::ReadFailed>(m).error;
  EXPECT_NE(error.find("MF_META refused"), std::string::npos) << error;
  EXPECT_NE(error.find("they must match"), std::string::npos) << error;
}

TEST_F(ReaderTest, APrefillOfAnotherModelIsRefusedAtMfMetaNamingTheDifference) {
  auto fewer = mf_meta(prefill_);
  fewer.layers.pop_back();  // a model with one layer less
  auto m = exchange_message(protocol::encode(fewer));
  ASSERT_TRUE(std::holds_alternative<protocol::ReadFailed>(m)) << "no refusal";
  auto error = std::get<protocol::ReadFailed>(m).error;
  EXPECT_NE(error.find("Prefill's model has 2 cache layers, this Decode's has 3; layer '" +
                       layer_name(2) + "' is not in Prefill's MF_META"),
            std::string::npos)
      << error;
  auto renamed = mf_meta(prefill_);
  renamed.layers[0].first = "model.layers.0.attn";
  m = exchange_message(protocol::encode(renamed));
  ASSERT_TRUE(std::holds_alternative<protocol::ReadFailed>(m)) << "no refusal";
  error = std::get<protocol::ReadFailed>(m).error;
  EXPECT_NE(error.find("layer 'model.layers.0.attn' is not in Decode's cache"), std::string::npos)
      << error;
  // Nothing was kept: a readiness on this connection has no MF_META behind it.
  m = exchange_message(protocol::encode(ready(1, {})));
  ASSERT_TRUE(std::holds_alternative<protocol::ReadFailed>(m));
  EXPECT_NE(std::get<protocol::ReadFailed>(m).error.find("no MF_META"), std::string::npos);
}

TEST_F(ReaderTest, AReadinessOverAnItemLimitIsAnsweredForItsLayerNamingTheLimit) {
  send_mf_meta(mf_meta(prefill_));
  auto big = ready(2, {});
  big.read_reqs.resize(protocol::kMaxReadReqs + 1, {"r", {}, {}, 0, 0});
  auto m = exchange_message(protocol::encode(big));
  ASSERT_TRUE(std::holds_alternative<protocol::ReadFailed>(m));
  EXPECT_EQ(std::get<protocol::ReadFailed>(m).layer_idx, 2);
  EXPECT_NE(std::get<protocol::ReadFailed>(m).error.find("exceed the limit of 16384"),
            std::string::npos)
      << std::get<protocol::ReadFailed>(m).error;
}

TEST_F(ReaderTest, AReadinessWhoseLayerIsUnreadableIsAnsweredAndItsConnectionDropped) {
  send_mf_meta(mf_meta(prefill_));
  // The layer is a str: nothing says which layer to answer for.
  std::vector<std::byte> broken;
  for (int b : {0x94, 0xc4, 0x10}) broken.push_back(static_cast<std::byte>(b));
  for (char c : std::string("read_ready_batch")) broken.push_back(static_cast<std::byte>(c));
  for (int b : {0xa1, int{'7'}, 0xa1, int{'x'}, 0x90}) broken.push_back(static_cast<std::byte>(b));
  auto m = exchange_message(broken);
  ASSERT_TRUE(std::holds_alternative<protocol::ReadFailed>(m)) << "no answer";
  EXPECT_NE(std::get<protocol::ReadFailed>(m).error.find("message refused"), std::string::npos)
      << std::get<protocol::ReadFailed>(m).error;
  // The connection's MF_META is gone: Prefill must start over on a new connection.
  auto after = exchange_message(protocol::encode(ready(1, {})));
  ASSERT_TRUE(std::holds_alternative<protocol::ReadFailed>(after));
  EXPECT_NE(std::get<protocol::ReadFailed>(after).error.find("no MF_META"), std::string::npos);
  EXPECT_EQ(reader_->stats().connections, 0u);
}

// msgpack bytes from `parts`: ints are raw bytes, strings their characters.
std::vector<std::byte> bytes_of(std::initializer_list<std::variant<int, std::string>> parts) {
  std::vector<std::byte> out;
  for (const auto& p : parts) {
    if (const int* b = std::get_if<int>(&p)) {
      out.push_back(static_cast<std::byte>(*b));
    } else {
      for (char c : std::get<std::string>(p)) out.push_back(static_cast<std::byte>(c));
    }
  }
  return out;
}

// As the existing connector does: a message Decode does not understand is not a reason to
// forget what the connection set up, so a newer Prefill's messages cost nothing.
TEST_F(ReaderTest, AnUnknownTagAStrTagOrABrokenMfMetaLeavesTheConnectionsMfMetaInPlace) {
  send_mf_meta(mf_meta(prefill_));
  // [bin "from_the_future", 1]: a tag of a newer protocol.
  ASSERT_TRUE(dealer_->send(bytes_of({0x92, 0xc4, 15, std::string("from_the_future"), 1})).is_ok());
  // [str "read_ready_batch", 1]: a tag as str, which the wire never uses.
  ASSERT_TRUE(dealer_->send(bytes_of({0x92, 0xb0, std::string("read_ready_batch"), 1})).is_ok());
  // [bin "mf_meta", 7]: an MF_META that does not decode is refused, and nothing else.
  auto m = exchange_message(bytes_of({0x92, 0xc4, 7, std::string("mf_meta"), 7}));
  ASSERT_TRUE(std::holds_alternative<protocol::ReadFailed>(m)) << "no refusal";
  EXPECT_NE(std::get<protocol::ReadFailed>(m).error.find("MF_META refused"), std::string::npos);
  // The MF_META accepted first still stands: readiness is served.
  m = exchange_message(protocol::encode(ready(1, {})));
  ASSERT_TRUE(std::holds_alternative<protocol::ReadDone>(m))
      << (std::holds_alternative<protocol::ReadFailed>(m) ? std::get<protocol::ReadFailed>(m).error
                                                          : "another answer");
  EXPECT_EQ(reader_->stats().connections, 1u);
  EXPECT_EQ(reader_->stats().messages_rejected, 3u);
}

// Envelopes a Prefill never sends (no payload frame, two, more frames than a message has):
// refused once whole, answered READ_FAILED for their layer when it can be read, and the
// connection keeps its MF_META.
TEST_F(ReaderTest, AMessageOfTheWrongShapeIsRefusedAndItsConnectionKeepsItsState) {
  zmq::context_t ctx;
  zmq::socket_t raw(ctx, zmq::socket_type::dealer);
  raw.set(zmq::sockopt::linger, 0);
  raw.set(zmq::sockopt::rcvtimeo, 10000);
  raw.connect(reader_->url());
  auto send_parts = [&](const std::vector<std::vector<std::byte>>& parts) {
    for (size_t i = 0; i < parts.size(); ++i) {
      raw.send(zmq::buffer(parts[i].data(), parts[i].size()),
               i + 1 < parts.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
    }
  };
  // The next answer's message, skipping the empty delimiter.
  auto answer = [&]() -> std::optional<protocol::Message> {
    for (;;) {
      zmq::message_t m;
      if (!raw.recv(m)) return std::nullopt;
      if (m.size() == 0) continue;
      auto decoded =
          protocol::decode_message(std::span(static_cast<const std::byte*>(m.data()), m.size()));
      if (!decoded) return std::nullopt;
      return *decoded;
    }
  };
  const std::vector<std::byte> empty;
  send_parts({empty, protocol::encode(mf_meta(prefill_))});
  auto ack = [&] {
    zmq::message_t m;
    while (raw.recv(m) && m.size() == 0) {
    }
    return m.to_string();
  }();
  ASSERT_FALSE(ack.empty()) << "no ACK of MF_META";
  // Two payload frames, the first a readiness of layer 2: READ_FAILED for layer 2.
  send_parts({empty, protocol::encode(ready(2, {})), protocol::encode(ready(1, {}))});
  auto m = answer();
  ASSERT_TRUE(m && std::holds_alternative<protocol::ReadFailed>(*m)) << "no answer";
  EXPECT_EQ(std::get<protocol::ReadFailed>(*m).layer_idx, 2);
  EXPECT_NE(std::get<protocol::ReadFailed>(*m).error.find("2 payload frames (one expected)"),
            std::string::npos)
      << std::get<protocol::ReadFailed>(*m).error;
  // More frames than a message has, the first payload a readiness of layer 1.
  std::vector<std::vector<std::byte>> many(40);
  many[1] = protocol::encode(ready(1, {}));
  send_parts(many);
  m = answer();
  ASSERT_TRUE(m && std::holds_alternative<protocol::ReadFailed>(*m)) << "no answer";
  EXPECT_EQ(std::get<protocol::ReadFailed>(*m).layer_idx, 1);
  EXPECT_NE(std::get<protocol::ReadFailed>(*m).error.find("40 frames (at most 7)"),
            std::string::npos)
      << std::get<protocol::ReadFailed>(*m).error;
  // No payload at all: nothing to answer.
  send_parts({empty, empty});
  // The connection kept its MF_META: a readiness is served.
  send_parts({empty, protocol::encode(ready(1, {}))});
  m = answer();
  ASSERT_TRUE(m && std::holds_alternative<protocol::ReadDone>(*m))
      << (m && std::holds_alternative<protocol::ReadFailed>(*m)
              ? std::get<protocol::ReadFailed>(*m).error
              : "another answer");
  EXPECT_EQ(reader_->stats().connections, 1u);
}

TEST_F(ReaderTest, OneConnectionCannotFillTheHoldQueue) {
  ReaderConfig config;
  config.hold_timeout = 30s;
  config.max_held = 8;
  config.max_held_per_peer = 2;
  start_reader(config);
  send_mf_meta(mf_meta(prefill_));
  for (int l = 0; l < 2; ++l) {
    ASSERT_TRUE(dealer_->send(protocol::encode(ready(l, {{"unknown", {1}, {1}, 0, 0}}))).is_ok());
  }
  ASSERT_TRUE(wait_held(*reader_, 2));
  // Its third does not fit: everything it has held fails, in order, at once.
  ASSERT_TRUE(dealer_->send(protocol::encode(ready(2, {{"unknown", {1}, {1}, 0, 0}}))).is_ok());
  for (int l = 0; l < 3; ++l) {
    auto reply = dealer_->receive(10s);
    ASSERT_TRUE(reply && reply->has_value()) << "layer " << l << " unanswered";
    auto m = protocol::decode_message(**reply);
    ASSERT_TRUE(m && std::holds_alternative<protocol::ReadFailed>(*m));
    EXPECT_EQ(std::get<protocol::ReadFailed>(*m).layer_idx, l);
    EXPECT_NE(std::get<protocol::ReadFailed>(*m).error.find("limit 2 per connection"),
              std::string::npos)
        << std::get<protocol::ReadFailed>(*m).error;
  }
  EXPECT_EQ(reader_->stats().held_now, 0u);
  // Another connection still gets its place.
  auto other = control::DealerChannel::connect(context_, reader_->url());
  ASSERT_TRUE(other);
  ASSERT_TRUE((*other)->send(protocol::encode(mf_meta(prefill_))).is_ok());
  auto ack = (*other)->receive(10s);
  ASSERT_TRUE(ack && ack->has_value() && protocol::is_ack(**ack));
  ASSERT_TRUE((*other)->send(protocol::encode(ready(0, {{"late", {1}, {1}, 0, 0}}))).is_ok());
  ASSERT_TRUE(wait_held(*reader_, 1));
  ASSERT_TRUE(reader_->add_request("late", "int-late", {4}, {4}).is_ok());
  auto done = (*other)->receive(10s);
  ASSERT_TRUE(done && done->has_value());
  auto m = protocol::decode_message(**done);
  EXPECT_TRUE(m && std::holds_alternative<protocol::ReadDone>(*m));
}

}  // namespace
}  // namespace rd2h::decode
