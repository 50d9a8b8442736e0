// The metaserver client against real HTTP servers on loopback.
#include "metaserver/client.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <thread>

#include "support/http_server.h"

namespace rd2h::metaserver {
namespace {

using namespace std::chrono_literals;
using testing::eventually;
using Server = testing::MetaserverStub;

TEST(MetaserverClient, DeliversTheBodyAsPosted) {
  Server server(200);
  Client client({});
  ASSERT_TRUE(client.post("r1", server.url(), R"({"request_id":"r1"})").is_ok());
  ASSERT_TRUE(eventually([&] { return client.stats().delivered == 1; }));
  EXPECT_EQ(server.bodies(), std::vector<std::string>{R"({"request_id":"r1"})"});
  EXPECT_FALSE(client.pending("r1"));
}

TEST(MetaserverClient, AnHttpErrorCountsAsDeliveredAndIsNotRetried) {
  Server server(500);
  Client client({});
  ASSERT_TRUE(client.post("r1", server.url(), "{}").is_ok());
  ASSERT_TRUE(eventually([&] { return !client.pending("r1"); }));
  EXPECT_EQ(client.stats().http_errors, 1u);
  EXPECT_EQ(server.bodies().size(), 1u);
}

TEST(MetaserverClient, RetriesARefusedConnectionUntilTheServerIsUp) {
  testing::ClosedPort closed;  // refuses until the server binds it
  const int port = closed.port();
  ClientConfig config;
  config.backoff = 10ms;
  config.resubmit = 50ms;
  Client client(config);
  const std::string url = "http://127.0.0.1:" + std::to_string(port) + "/v1/metaserver";
  ASSERT_TRUE(client.post("r1", url, "{}").is_ok());
  ASSERT_TRUE(eventually([&] { return client.stats().transport_errors >= 4; }))
      << "refused posts were not retried and resubmitted";
  EXPECT_TRUE(client.pending("r1"));
  Server server(200, 0ms, port);
  ASSERT_TRUE(eventually([&] { return client.stats().delivered == 1; }));
  EXPECT_EQ(server.bodies().size(), 1u);
}

TEST(MetaserverClient, CancellingAFinishedRequestStopsItsRetries) {
  ClientConfig config;
  config.backoff = 10ms;
  config.resubmit = 20ms;
  Client client(config);
  ASSERT_TRUE(client.post("r1", "http://127.0.0.1:1/v1/metaserver", "{}").is_ok());
  ASSERT_TRUE(eventually([&] { return client.stats().transport_errors >= 1; }));
  client.cancel("r1");
  EXPECT_FALSE(client.pending("r1"));
  EXPECT_EQ(client.stats().cancelled, 1u);
}

TEST(MetaserverClient, AServerThatHoldsPostsDoesNotWedgeThePool) {
  Server holding(200, 1s);
  Server good(200);
  ClientConfig config;
  config.timeout = 100ms;
  config.threads = 2;
  config.resubmit = 10s;
  Client client(config);
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE(client.post("held-" + std::to_string(i), holding.url(), "{}").is_ok());
  }
  ASSERT_TRUE(client.post("r", good.url(), "{}").is_ok());
  EXPECT_TRUE(eventually([&] { return !client.pending("r"); }))
      << "a post waited behind posts a server holds";
}

TEST(MetaserverClient, MalformedUrlsAreRefusedAtOnce) {
  Client client({});
  EXPECT_EQ(client.post("r", "https://x/v1", "{}").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(client.post("r", "http:///v1", "{}").code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(client.pending("r"));
}

}  // namespace
}  // namespace rd2h::metaserver
