#include "control/curve.h"

#include <gtest/gtest.h>
#include <spdlog/sinks/ringbuffer_sink.h>
#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "control/channel.h"
#include "rd2h/common/deadline.h"
#include "util/log.h"

namespace rd2h::control {
namespace {

using namespace std::chrono_literals;

std::vector<std::byte> bytes(std::string_view s) {
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  return {p, p + s.size()};
}

CurveKeyPair keys() {
  auto k = generate_key_pair();
  EXPECT_TRUE(k) << k.status().to_string();
  return *k;
}

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/rd2h-curve-XXXXXX";
    path_ = ::mkdtemp(tmpl);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

void write(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
}

TEST(CurveKeys, KeygenFilesRoundTripAndAreNeverOverwritten) {
  TempDir dir;
  const auto pair = keys();
  ASSERT_TRUE(write_key_pair(dir / "decode", pair).is_ok());
  struct stat st {};
  ASSERT_EQ(::stat((dir / "decode.key_secret").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  auto secret = read_secret_key_file(dir / "decode.key_secret");
  ASSERT_TRUE(secret) << secret.status().to_string();
  EXPECT_EQ(secret->public_key, pair.public_key);
  EXPECT_EQ(secret->secret_key, pair.secret_key);
  auto trusted = read_public_keys_file(dir / "decode.key");
  ASSERT_TRUE(trusted) << trusted.status().to_string();
  EXPECT_EQ(*trusted, std::vector<std::string>{pair.public_key});
  // The public file carries no secret.
  std::ifstream in(dir / "decode.key");
  std::string text((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(text.find(pair.secret_key), std::string::npos);
  auto again = write_key_pair(dir / "decode", keys());
  EXPECT_EQ(again.code(), StatusCode::kAlreadyExists) << again.to_string();
  EXPECT_EQ(read_secret_key_file(dir / "decode.key_secret")->secret_key, pair.secret_key);
  // Readable by others, the secret is refused, saying how to fix it.
  for (const mode_t mode : {0644, 0640, 0602}) {
    ASSERT_EQ(::chmod((dir / "decode.key_secret").c_str(), mode), 0);
    auto open = read_secret_key_file(dir / "decode.key_secret");
    ASSERT_FALSE(open) << std::oct << mode;
    EXPECT_NE(open.status().message().find("can be read or written by others"), std::string::npos)
        << open.status().message();
    EXPECT_NE(open.status().message().find("chmod 600 " + (dir / "decode.key_secret")),
              std::string::npos)
        << open.status().message();
  }
  ASSERT_EQ(::chmod((dir / "decode.key_secret").c_str(), 0400), 0);
  EXPECT_TRUE(read_secret_key_file(dir / "decode.key_secret"));
}

TEST(CurveKeys, BadKeyFilesAreRefusedNamingTheFileAndLine) {
  TempDir dir;
  const auto a = keys(), b = keys();
  write(dir / "list", "# trusted Prefill keys\n" + a.public_key + "\n\n  " + b.public_key +
                          "  # second\n");
  auto list = read_public_keys_file(dir / "list");
  ASSERT_TRUE(list) << list.status().to_string();
  EXPECT_EQ(*list, (std::vector<std::string>{a.public_key, b.public_key}));

  write(dir / "short", a.public_key + "\nnot-a-key\n");
  auto bad = read_public_keys_file(dir / "short");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.status().message().find("line 2"), std::string::npos) << bad.status().to_string();
  write(dir / "empty", "# nothing\n");
  EXPECT_FALSE(read_public_keys_file(dir / "empty"));
  auto missing = read_secret_key_file(dir / "absent");
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.status().message().find(dir / "absent"), std::string::npos);
  write(dir / "public-only", "    public-key = \"" + a.public_key + "\"\n");
  EXPECT_FALSE(read_secret_key_file(dir / "public-only"));
}

TEST(CurveKeys, LoopbackHosts) {
  for (const char* h : {"127.0.0.1", "127.1.2.3", "::1", "localhost"}) {
    EXPECT_TRUE(is_loopback_host(h)) << h;
  }
  for (const char* h : {"0.0.0.0", "192.0.2.2", "::", "fd00::2", "decode-0", ""}) {
    EXPECT_FALSE(is_loopback_host(h)) << h;
  }
}

class Curve : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerSecurity s{server_, {client_.public_key}};
    auto r = RouterChannel::bind(context_, "127.0.0.1", 0, s);
    ASSERT_TRUE(r) << r.status().to_string();
    router_ = std::move(*r);
  }
  std::unique_ptr<DealerChannel> dealer(std::optional<ClientSecurity> security) {
    auto d = DealerChannel::connect(Context::create(), router_->url(), security);
    EXPECT_TRUE(d) << d.status().to_string();
    return d ? std::move(*d) : nullptr;
  }
  // Sends until the dealer's handshake is refused; the router must never see a message.
  void expect_refused(DealerChannel& d, std::string_view why) {
    ASSERT_TRUE(d.send(bytes("let me in")).is_ok());
    Deadline deadline(10s);
    bool refused = false;
    while (!refused && !deadline.expired()) {
      auto in = router_->receive(20ms);
      ASSERT_TRUE(in) << in.status().to_string();
      ASSERT_FALSE(in->has_value()) << "a refused peer's message reached Decode";
      refused = d.connection_lost();
    }
    ASSERT_TRUE(refused) << "the handshake was not refused within 10 s";
    EXPECT_NE(d.refusal().find(why), std::string::npos) << d.refusal();
  }

  std::shared_ptr<Context> context_ = Context::create();
  CurveKeyPair server_ = keys(), client_ = keys();
  std::unique_ptr<RouterChannel> router_;
};

TEST_F(Curve, ATrustedClientTalksToTheServerItTrusts) {
  auto d = dealer(ClientSecurity{client_, server_.public_key});
  ASSERT_TRUE(d->send(bytes("MF_META")).is_ok());
  auto in = router_->receive(10s);
  ASSERT_TRUE(in) << in.status().to_string();
  ASSERT_TRUE(in->has_value());
  EXPECT_EQ((*in)->payload, bytes("MF_META"));
  ASSERT_TRUE(router_->send((*in)->identity, bytes("ACK")).is_ok());
  auto reply = d->receive(10s);
  ASSERT_TRUE(reply && reply->has_value());
  EXPECT_EQ(**reply, bytes("ACK"));
  EXPECT_FALSE(d->connection_lost());
  EXPECT_TRUE(d->refusal().empty());
}

TEST_F(Curve, AClientWhoseKeyIsNotTrustedGetsNothing) {
  auto d = dealer(ClientSecurity{keys(), server_.public_key});
  expect_refused(*d, "refused this Prefill's CURVE key");
}

TEST_F(Curve, AClientThatTrustsAnotherServerKeyNeverTalksToThisOne) {
  auto d = dealer(ClientSecurity{client_, keys().public_key});
  expect_refused(*d, "CURVE handshake");
}

TEST_F(Curve, APlaintextClientGetsNothing) {
  auto d = dealer(std::nullopt);
  ASSERT_TRUE(d->send(bytes("let me in")).is_ok());
  // A NULL-mechanism client is dropped by the CURVE server during the greeting; whatever
  // the client sees, Decode receives nothing in the time a trusted client needs to connect.
  auto trusted = dealer(ClientSecurity{client_, server_.public_key});
  ASSERT_TRUE(trusted->send(bytes("trusted")).is_ok());
  auto in = router_->receive(10s);
  ASSERT_TRUE(in && in->has_value());
  EXPECT_EQ((*in)->payload, bytes("trusted"));
  in = router_->receive(200ms);
  ASSERT_TRUE(in);
  EXPECT_FALSE(in->has_value());
}

// The refusal of a plaintext peer, which no authentication request names, is in the log.
TEST_F(Curve, APlaintextClientsRefusalIsLogged) {
  auto sink = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(64);
  log::logger().sinks().push_back(sink);
  auto d = dealer(std::nullopt);
  ASSERT_TRUE(d->send(bytes("let me in")).is_ok());
  auto logged = [&] {
    for (const auto& line : sink->last_formatted()) {
      // Which side ends the handshake first varies: the line says the mechanism differs, or
      // that the handshake did not finish.
      if (line.find("refused a connection to " + router_->url()) != std::string::npos) {
        return true;
      }
    }
    return false;
  };
  Deadline deadline(10s);
  bool seen = false;
  while (!(seen = logged()) && !deadline.expired()) {
    auto in = router_->receive(20ms);
    ASSERT_TRUE(in);
    ASSERT_FALSE(in->has_value());
    (void)router_->take_disconnected();  // the ROUTER's owner reads its monitor
  }
  log::logger().sinks().pop_back();
  EXPECT_TRUE(seen) << "no line says a plaintext connection was refused";
}

TEST_F(Curve, BadKeysAreRefusedAtBindAndConnect) {
  EXPECT_FALSE(RouterChannel::bind(context_, "127.0.0.1", 0, ServerSecurity{server_, {}}));
  EXPECT_FALSE(RouterChannel::bind(context_, "127.0.0.1", 0,
                                   ServerSecurity{{"short", "short"}, {client_.public_key}}));
  EXPECT_FALSE(DealerChannel::connect(context_, router_->url(), ClientSecurity{client_, "x"}));
}

}  // namespace
}  // namespace rd2h::control
