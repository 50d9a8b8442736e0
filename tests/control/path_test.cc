// The control paths behind their one interface: ZeroMQ (DealerPath and RouterPath on a real
// ROUTER) and notification channels of real UCX engines on loopback, fed by Notifications.
// The test thread is each side's only consumer, as Sender's and Reader's threads are.
#include "control/path.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <functional>
#include <thread>

#include "rd2h/common/deadline.h"
#include "util/unique_fd.h"

namespace rd2h::control {
namespace {

using namespace std::chrono_literals;

std::vector<std::byte> bytes_of(const std::string& text) {
  const auto* p = reinterpret_cast<const std::byte*>(text.data());
  return {p, p + text.size()};
}
std::string text_of(const std::vector<std::byte>& bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

// How a test side takes what came: `poll` takes it into the paths and says whether the side
// may sleep on `fd` (-1: a short pause instead).
struct Feed {
  std::function<bool()> poll;
  int fd = -1;
  void sleep() const {
    if (fd < 0) {
      std::this_thread::sleep_for(1ms);
      return;
    }
    pollfd p{fd, POLLIN, 0};
    ::poll(&p, 1, 100);
  }
};

// Feeds until `done` holds or 10 s pass; whether it held.
bool until(const std::function<bool()>& done, const Feed& feed) {
  const Deadline deadline(10s);
  while (!done()) {
    if (deadline.expired()) return false;
    if (feed.poll() && !done()) feed.sleep();
  }
  return true;
}

// The next message on `path`, fed by `feed`, within 10 s.
std::optional<std::string> receive(Path& path, const Feed& feed) {
  std::optional<std::string> got;
  auto take = [&] {
    auto m = path.try_receive();
    EXPECT_TRUE(m) << m.status().to_string();
    if (m && m->has_value()) got = text_of(**m);
    return got.has_value() || !m;
  };
  until(take, feed);
  return got;
}

// Feeds until `path` is lost; why, or nullopt after 10 s.
std::optional<Status> lost(Path& path, const Feed& feed) {
  std::optional<Status> why;
  until([&] { return (why = path.lost()).has_value(); }, feed);
  return why;
}

const Feed kZeroMq{[] { return true; }};

std::shared_ptr<transfer::TransferEngine> make_engine(transfer::Role role) {
  transfer::EngineConfig cfg;
  cfg.role = role;
  cfg.transport = transfer::Transport::kTcp;
  cfg.read_timeout = 2000ms;
  cfg.connect_timeout = 5000ms;
  auto e = transfer::create_ucx_engine(cfg);
  EXPECT_TRUE(e) << e.status().to_string();
  return e ? std::shared_ptr<transfer::TransferEngine>(std::move(*e)) : nullptr;
}

// A serving engine (Prefill's, which offers channels) and one connected to it (Decode's,
// which opens them), each with its Notifications.
class NotificationPaths : public ::testing::Test {
 protected:
  void SetUp() override {
    serving_engine_ = make_engine(transfer::Role::kPrefill);
    connecting_engine_ = make_engine(transfer::Role::kDecode);
    ASSERT_TRUE(serving_engine_ && connecting_engine_);
    ASSERT_TRUE(serving_engine_->allocate_memory(4096));
    auto metadata = serving_engine_->export_metadata();
    ASSERT_TRUE(metadata) << metadata.status().to_string();
    auto session = connecting_engine_->connect(*metadata);
    ASSERT_TRUE(session) << session.status().to_string();
    session_ = *session;
    serving_.emplace(serving_engine_);
    connecting_.emplace(connecting_engine_);
    ASSERT_TRUE(serving_->available() && connecting_->available());
  }

  // A channel offered by the serving side and opened by the connecting side, once the
  // serving side heard it open.
  std::pair<std::unique_ptr<NotificationPath>, std::unique_ptr<NotificationPath>> pair() {
    auto offered = serving_->listen();
    EXPECT_TRUE(offered) << offered.status().to_string();
    if (!offered) return {};
    const uint64_t channel = (*offered)->channel();
    auto opened = connecting_->expect(channel);
    EXPECT_TRUE(opened) << opened.status().to_string();
    if (!opened) return {};
    Status st = connecting_engine_->open_notifications(session_, channel);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    NotificationPath& served = **offered;
    EXPECT_TRUE(until([&] { return served.opened(); }, feed_serving()));
    return {std::move(*offered), std::move(*opened)};
  }
  Feed feed_serving() {
    return {[this] { return serving_->poll(); }, serving_->fd()};
  }
  Feed feed_connecting() {
    return {[this] { return connecting_->poll(); }, connecting_->fd()};
  }

  std::shared_ptr<transfer::TransferEngine> serving_engine_, connecting_engine_;
  transfer::SessionHandle session_;
  std::optional<Notifications> serving_, connecting_;
};

TEST_F(NotificationPaths, MessagesTravelBothWaysThroughThePathInterface) {
  auto [served, opened] = pair();
  ASSERT_TRUE(served && opened);
  Path& prefill = *served;
  Path& decode = *opened;
  for (int i = 0; i < 50; ++i) {
    ASSERT_TRUE(prefill.send(bytes_of("readiness " + std::to_string(i))).is_ok());
  }
  for (int i = 0; i < 50; ++i) {
    EXPECT_EQ(receive(decode, feed_connecting()), "readiness " + std::to_string(i));
  }
  ASSERT_TRUE(decode.send(bytes_of("answer")).is_ok());
  EXPECT_EQ(receive(prefill, feed_serving()), "answer");
  EXPECT_FALSE(prefill.lost());
  EXPECT_FALSE(decode.lost());
}

TEST_F(NotificationPaths, EachChannelFeedsOnlyItsOwnPath) {
  auto [served_a, opened_a] = pair();
  auto [served_b, opened_b] = pair();
  ASSERT_TRUE(served_a && opened_a && served_b && opened_b);
  EXPECT_NE(served_a->channel(), served_b->channel());
  ASSERT_TRUE(served_b->send(bytes_of("to b")).is_ok());
  ASSERT_TRUE(served_a->send(bytes_of("to a")).is_ok());
  EXPECT_EQ(receive(*opened_a, feed_connecting()), "to a");
  EXPECT_EQ(receive(*opened_b, feed_connecting()), "to b");
  auto none = opened_a->try_receive();
  ASSERT_TRUE(none);
  EXPECT_FALSE(none->has_value());
}

TEST_F(NotificationPaths, APathIsLostWhenItsSessionGoes) {
  auto [served, opened] = pair();
  ASSERT_TRUE(served && opened);
  ASSERT_TRUE(connecting_engine_->disconnect(session_).is_ok());
  NotificationPath& decode = *opened;
  auto why = lost(decode, feed_connecting());
  ASSERT_TRUE(why);
  EXPECT_EQ(why->code(), StatusCode::kPeerDead) << why->to_string();
  EXPECT_FALSE(decode.send(bytes_of("late")).is_ok());
}

TEST_F(NotificationPaths, AChannelHasOnePathAtATime) {
  auto first = connecting_->expect(42);
  ASSERT_TRUE(first);
  auto second = connecting_->expect(42);
  ASSERT_FALSE(second);
  EXPECT_EQ(second.status().code(), StatusCode::kAlreadyExists);
  first->reset();
  EXPECT_TRUE(connecting_->expect(42));
}

TEST_F(NotificationPaths, MessagesForAPathThatWentAreDropped) {
  auto [served, opened] = pair();
  auto [served_b, opened_b] = pair();
  ASSERT_TRUE(served && opened && served_b && opened_b);
  ASSERT_TRUE(served->send(bytes_of("nobody reads this")).is_ok());
  const uint64_t channel = opened->channel();
  opened.reset();  // before the connecting side polled
  ASSERT_TRUE(served_b->send(bytes_of("after")).is_ok());
  EXPECT_EQ(receive(*opened_b, feed_connecting()), "after");
  // A new path on the same channel starts empty: the old path's message is not handed on.
  auto again = connecting_->expect(channel);
  ASSERT_TRUE(again);
  connecting_->poll();
  auto none = (*again)->try_receive();
  ASSERT_TRUE(none);
  EXPECT_FALSE(none->has_value());
}

// ZeroMQ: Prefill's DEALER and Decode's ROUTER, each behind the same interface.
TEST(ZeroMqPaths, DealerAndRouterPathsCarryMessagesAndTheDealerNoticesTheRouterGo) {
  auto context = Context::create();
  auto router = RouterChannel::bind(context, "127.0.0.1", 0);
  ASSERT_TRUE(router) << router.status().to_string();
  auto dealer = DealerPath::connect(context, (*router)->url());
  ASSERT_TRUE(dealer) << dealer.status().to_string();
  Path& prefill = **dealer;
  ASSERT_TRUE(prefill.send(bytes_of("MF_META")).is_ok());
  auto in = (*router)->receive(10s);
  ASSERT_TRUE(in) << in.status().to_string();
  ASSERT_TRUE(in->has_value());
  EXPECT_EQ(text_of((*in)->payload), "MF_META");

  RouterPath back(**router, (*in)->identity);
  Path& decode = back;
  ASSERT_TRUE(decode.send(bytes_of("ACK")).is_ok());
  EXPECT_EQ(receive(prefill, kZeroMq), "ACK");
  // The router delivers every connection's messages itself; its path only sends.
  auto none = decode.try_receive();
  ASSERT_TRUE(none);
  EXPECT_FALSE(none->has_value());
  EXPECT_FALSE(prefill.lost());

  router->reset();  // Decode went
  auto why = lost(prefill, kZeroMq);
  ASSERT_TRUE(why);
  EXPECT_EQ(why->code(), StatusCode::kPeerDead) << why->to_string();
}

TEST(ZeroMqPaths, ADealerWithNobodyAtItsUrlIsLostAsUnreachable) {
  auto context = Context::create();
  // A port held by a socket that does not listen: connects to it are refused, and nothing
  // else can bind it meanwhile.
  UniqueFd holder(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_TRUE(holder.valid());
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(addr);
  ASSERT_EQ(::bind(holder.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::getsockname(holder.get(), reinterpret_cast<sockaddr*>(&addr), &length), 0);
  const int port = ntohs(addr.sin_port);
  auto dealer = DealerPath::connect(context, endpoint_url("127.0.0.1", port));
  ASSERT_TRUE(dealer) << dealer.status().to_string();
  Path& prefill = **dealer;
  auto why = lost(prefill, kZeroMq);
  ASSERT_TRUE(why);
  EXPECT_EQ(why->code(), StatusCode::kUnreachable) << why->to_string();
}

}  // namespace
}  // namespace rd2h::control
