#include "control/channel.h"

#include <gtest/gtest.h>

#include <map>
#include <zmq.hpp>

#include "protocol/messages.h"

namespace rd2h::control {
namespace {

using namespace std::chrono_literals;

std::vector<std::byte> bytes(std::string_view s) {
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  return {p, p + s.size()};
}

TEST(Endpoint, UrlsBracketIpv6Hosts) {
  EXPECT_EQ(endpoint_url("127.0.0.1", 5555), "tcp://127.0.0.1:5555");
  EXPECT_EQ(endpoint_url("::1", 5555), "tcp://[::1]:5555");
  EXPECT_EQ(endpoint_url("decode-0", 1), "tcp://decode-0:1");
}

class Channels : public ::testing::Test {
 protected:
  void SetUp() override {
    auto r = RouterChannel::bind(context_, "127.0.0.1", 0);
    ASSERT_TRUE(r) << r.status().to_string();
    router_ = std::move(*r);
  }
  std::unique_ptr<DealerChannel> dealer() {
    auto d = DealerChannel::connect(context_, router_->url());
    EXPECT_TRUE(d) << d.status().to_string();
    return d ? std::move(*d) : nullptr;
  }

  std::shared_ptr<Context> context_ = Context::create();
  std::unique_ptr<RouterChannel> router_;
};

TEST_F(Channels, ReadinessReachesDecodeAndTheReplyComesBack) {
  auto d = dealer();
  auto ready = protocol::encode(protocol::ReadDone{4});  // any protocol payload
  ASSERT_TRUE(d->send(ready).is_ok());
  auto in = router_->receive(5s);
  ASSERT_TRUE(in) << in.status().to_string();
  ASSERT_TRUE(in->has_value());
  EXPECT_EQ((*in)->payload, ready);
  ASSERT_TRUE(router_->send((*in)->identity, bytes("ACK")).is_ok());
  auto reply = d->receive(5s);
  ASSERT_TRUE(reply) << reply.status().to_string();
  ASSERT_TRUE(reply->has_value());
  EXPECT_TRUE(protocol::is_ack(**reply));
}

TEST_F(Channels, EachConnectionHasItsOwnIdentityAndGetsItsOwnReplies) {
  auto a = dealer(), b = dealer();
  ASSERT_TRUE(a->send(bytes("from-a")).is_ok());
  ASSERT_TRUE(b->send(bytes("from-b")).is_ok());
  std::map<std::string, std::string> sender;  // payload -> identity
  for (int i = 0; i < 2; ++i) {
    auto in = router_->receive(5s);
    ASSERT_TRUE(in && in->has_value());
    sender[std::string(reinterpret_cast<const char*>((*in)->payload.data()),
                       (*in)->payload.size())] = (*in)->identity;
  }
  ASSERT_NE(sender["from-a"], sender["from-b"]);
  ASSERT_TRUE(router_->send(sender["from-b"], bytes("to-b")).is_ok());
  ASSERT_TRUE(router_->send(sender["from-a"], bytes("to-a")).is_ok());
  auto got_a = a->receive(5s);
  ASSERT_TRUE(got_a && got_a->has_value());
  EXPECT_EQ(**got_a, bytes("to-a"));
  auto got_b = b->receive(5s);
  ASSERT_TRUE(got_b && got_b->has_value());
  EXPECT_EQ(**got_b, bytes("to-b"));
  EXPECT_FALSE(a->receive(0ms)->has_value());  // b's reply did not reach a
}

TEST_F(Channels, ReceiveTimesOutWithNothingToRead) {
  auto in = router_->receive(20ms);
  ASSERT_TRUE(in);
  EXPECT_FALSE(in->has_value());
  auto d = dealer();
  auto out = d->receive(20ms);
  ASSERT_TRUE(out);
  EXPECT_FALSE(out->has_value());
}

TEST_F(Channels, MessagesWithoutExactlyOnePayloadFrameAreDropped) {
  // A raw DEALER sends what rd2h never would: two payload frames, then only empty frames.
  zmq::context_t ctx;
  zmq::socket_t raw(ctx, zmq::socket_type::dealer);
  raw.set(zmq::sockopt::linger, 0);
  raw.connect(router_->url());
  raw.send(zmq::str_buffer("one"), zmq::send_flags::sndmore);
  raw.send(zmq::str_buffer("two"), zmq::send_flags::none);
  raw.send(zmq::message_t(), zmq::send_flags::none);
  // Empty frames around a single payload are fine.
  raw.send(zmq::message_t(), zmq::send_flags::sndmore);
  raw.send(zmq::str_buffer("good"), zmq::send_flags::none);
  auto in = router_->receive(5s);
  ASSERT_TRUE(in && in->has_value());
  EXPECT_EQ((*in)->payload, bytes("good"));
  EXPECT_EQ(router_->dropped(), 2u);
}

TEST_F(Channels, ReplyingToAnUnknownIdentityIsAnError) {
  Status st = router_->send("nobody", bytes("x"));
  EXPECT_EQ(st.code(), StatusCode::kPeerDead) << st.to_string();
}

TEST(Router, BindingATakenPortIsAnErrorNamingTheAddress) {
  auto ctx = Context::create();
  auto first = RouterChannel::bind(ctx, "127.0.0.1", 0);
  ASSERT_TRUE(first);
  const std::string url = (*first)->url();
  const int port = std::stoi(url.substr(url.rfind(':') + 1));
  auto second = RouterChannel::bind(ctx, "127.0.0.1", port);
  ASSERT_FALSE(second);
  EXPECT_EQ(second.status().code(), StatusCode::kUnreachable);
  EXPECT_NE(second.status().message().find(url), std::string::npos) << second.status().message();
  EXPECT_FALSE(RouterChannel::bind(ctx, "127.0.0.1", 70000));
}

}  // namespace
}  // namespace rd2h::control
