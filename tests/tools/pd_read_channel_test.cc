// The ZeroMQ exchange of pd-read's source and destination, on loopback.
#include "pd_read_channel.h"

#include <gtest/gtest.h>

#include <future>

#include "pd_read.h"

namespace rd2h::tools {
namespace {

using namespace std::chrono_literals;

std::vector<std::byte> bytes_of(std::string_view s) {
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  return {p, p + s.size()};
}

TEST(SplitHostPort, AcceptsHostsAndRefusesBadPorts) {
  auto v4 = split_host_port("127.0.0.1:5555");
  ASSERT_TRUE(v4);
  EXPECT_EQ(*v4, (std::pair<std::string, int>{"127.0.0.1", 5555}));
  auto v6 = split_host_port("[::1]:0");
  ASSERT_TRUE(v6);
  EXPECT_EQ(*v6, (std::pair<std::string, int>{"::1", 0}));
  for (const char* bad : {"localhost", "h:", "h:x", "h:65536", "h:-1"}) {
    auto r = split_host_port(bad);
    ASSERT_FALSE(r) << bad;
    EXPECT_NE(r.status().message().find(bad), std::string::npos) << r.status().message();
  }
}

TEST(PdReadChannel, HandshakeAndVerdictCrossBetweenSourceAndDestination) {
  auto source = SourceChannel::bind("127.0.0.1:0");
  ASSERT_TRUE(source) << source.status().to_string();
  EXPECT_EQ(source->address().rfind("127.0.0.1:", 0), 0u) << source->address();
  const auto handshake = bytes_of("the handshake");
  auto served = std::async(std::launch::async, [&]() -> Expected<bool> {
    RD2H_RETURN_IF_ERROR(source->serve(handshake, Deadline(30s)));
    return source->await_verdict(Deadline(30s));
  });

  auto dest = DestChannel::connect(source->address());
  ASSERT_TRUE(dest) << dest.status().to_string();
  auto got = dest->fetch_handshake(Deadline(30s));
  ASSERT_TRUE(got) << got.status().to_string();
  EXPECT_EQ(*got, handshake);
  EXPECT_TRUE(dest->send_verdict(false, Deadline(30s)).is_ok());
  auto verdict = served.get();
  ASSERT_TRUE(verdict) << verdict.status().to_string();
  EXPECT_FALSE(*verdict);
}

TEST(PdReadChannel, ADestinationWhoseSourceNeverAnswersFailsAtItsDeadline) {
  // A source that is bound but never serves: the destination's request is never answered.
  auto silent = SourceChannel::bind("127.0.0.1:0");
  ASSERT_TRUE(silent) << silent.status().to_string();
  auto dest = DestChannel::connect(silent->address());
  ASSERT_TRUE(dest) << dest.status().to_string();
  const auto start = std::chrono::steady_clock::now();
  auto got = dest->fetch_handshake(Deadline(300ms));
  const auto took = std::chrono::steady_clock::now() - start;
  ASSERT_FALSE(got);
  EXPECT_EQ(got.status().code(), StatusCode::kTimeout);
  EXPECT_NE(got.status().message().find("no pd-read source at " + silent->address() +
                                        " answered before the deadline"),
            std::string::npos)
      << got.status().message();
  EXPECT_GE(took, 300ms);
  EXPECT_LT(took, 3s);
}

TEST(PdReadChannel, NothingListeningFailsLongBeforeTheDeadlineNamingTheAddress) {
  std::string address;
  {
    auto gone = SourceChannel::bind("127.0.0.1:0");
    ASSERT_TRUE(gone) << gone.status().to_string();
    address = gone->address();
  }
  auto dest = DestChannel::connect(address);
  ASSERT_TRUE(dest) << dest.status().to_string();
  const auto start = std::chrono::steady_clock::now();
  auto got = dest->fetch_handshake(Deadline(60s));
  ASSERT_FALSE(got);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30s);
  EXPECT_EQ(got.status().code(), StatusCode::kUnreachable);
  EXPECT_NE(got.status().message().find("cannot connect to " + address), std::string::npos)
      << got.status().message();
}

TEST(PdReadChannel, ASourceNobodyAsksFailsAtItsDeadlineNamingItsAddress) {
  auto source = SourceChannel::bind("127.0.0.1:0");
  ASSERT_TRUE(source) << source.status().to_string();
  Status st = source->serve(bytes_of("unasked"), Deadline(200ms));
  EXPECT_EQ(st.code(), StatusCode::kTimeout);
  EXPECT_NE(st.message().find("no destination asked " + source->address()), std::string::npos)
      << st.message();
}

TEST(PdReadChannel, ADestinationThatLeavesWithoutAVerdictFailsTheSourceAtOnce) {
  auto source = SourceChannel::bind("127.0.0.1:0");
  ASSERT_TRUE(source) << source.status().to_string();
  auto served = std::async(std::launch::async, [&]() -> Expected<bool> {
    RD2H_RETURN_IF_ERROR(source->serve(bytes_of("h"), Deadline(30s)));
    return source->await_verdict(Deadline(60s));
  });
  {
    auto dest = DestChannel::connect(source->address());
    ASSERT_TRUE(dest) << dest.status().to_string();
    ASSERT_TRUE(dest->fetch_handshake(Deadline(30s)));
  }
  const auto start = std::chrono::steady_clock::now();
  auto verdict = served.get();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30s);
  ASSERT_FALSE(verdict);
  EXPECT_EQ(verdict.status().code(), StatusCode::kPeerDead);
  EXPECT_NE(verdict.status().message().find("without a verdict"), std::string::npos)
      << verdict.status().message();
}

TEST(PdReadChannel, AMalformedRequestIsNotAnsweredWithTheHandshake) {
  auto source = SourceChannel::bind("127.0.0.1:0");
  ASSERT_TRUE(source) << source.status().to_string();
  auto stranger =
      control::DealerChannel::connect(control::Context::create(), "tcp://" + source->address());
  ASSERT_TRUE(stranger) << stranger.status().to_string();
  ASSERT_TRUE((*stranger)->send(bytes_of("GET / HTTP/1.1")).is_ok());
  Status st = source->serve(bytes_of("h"), Deadline(300ms));
  EXPECT_EQ(st.code(), StatusCode::kTimeout) << st.to_string();
  auto reply = (*stranger)->try_receive();
  ASSERT_TRUE(reply);
  EXPECT_FALSE(reply->has_value());
}

// A source that answers the handshake request with `reply` and then keeps quiet.
class FakeSource {
 public:
  explicit FakeSource(std::vector<std::byte> reply) : reply_(std::move(reply)) {
    auto router = control::RouterChannel::bind(control::Context::create(), "127.0.0.1", 0);
    EXPECT_TRUE(router) << router.status().to_string();
    router_ = std::move(*router);
    answered_ = std::async(std::launch::async, [this] {
      auto in = router_->receive(30s);
      if (!in || !in->has_value()) return in ? timeout_error("no request") : in.status();
      return router_->send((*in)->identity, reply_);
    });
  }
  std::string address() const { return router_->url().substr(6); }
  Status answered() { return answered_.get(); }

 private:
  std::vector<std::byte> reply_;
  std::unique_ptr<control::RouterChannel> router_;
  std::future<Status> answered_;
};

TEST(PdReadChannel, ADestinationRefusesAGarbageHandshakeNamingTheSource) {
  const std::string map = std::string("\x81\xa6") + "format" + "\xa4" + "rd2h";  // {format: rd2h}
  FakeSource source(bytes_of(map));
  auto conn = connect_to_source(source.address(), transfer::EngineConfig{});
  EXPECT_TRUE(source.answered().is_ok());
  ASSERT_FALSE(conn);
  EXPECT_EQ(conn.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(conn.status().message().find("the source at " + source.address() +
                                         ": pd-read handshake.format: 'rd2h' is not"),
            std::string::npos)
      << conn.status().message();
}

TEST(PdReadChannel, ADestinationRefusesAnOversizedHandshake) {
  FakeSource source(std::vector<std::byte>(kMaxHandshakeBytes + 1, std::byte{0xc0}));
  auto conn = connect_to_source(source.address(), transfer::EngineConfig{});
  EXPECT_TRUE(source.answered().is_ok());
  ASSERT_FALSE(conn);
  EXPECT_NE(conn.status().message().find("pd-read handshake: 33554433 bytes exceed the limit"),
            std::string::npos)
      << conn.status().message();
}

TEST(PdReadChannel, ADestinationRefusesAHandshakeWithAnInvalidLayout) {
  FakeSource source(encode_handshake({{1, 4, {8, 0}}, 1, 0x1000, bytes_of("meta")}));
  auto conn = connect_to_source(source.address(), transfer::EngineConfig{});
  EXPECT_TRUE(source.answered().is_ok());
  ASSERT_FALSE(conn);
  EXPECT_NE(conn.status().message().find("source layout: tensor 1 has 0 bytes per block"),
            std::string::npos)
      << conn.status().message();
}

}  // namespace
}  // namespace rd2h::tools
