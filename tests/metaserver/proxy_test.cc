// The proxy over real HTTP on loopback, between stand-in engines that behave as vLLM's
// OpenAI servers do toward it: Decode posts each child's rendezvous (with rd2h's metaserver
// client) and answers once Prefill has run; Prefill records what it was sent.
#include "rd2h/metaserver/proxy.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <condition_variable>
#include <cstring>
#include <optional>
#include <nlohmann/json.hpp>

#include "metaserver/client.h"
#include "support/http_server.h"

namespace rd2h::metaserver {
namespace {

using nlohmann::json;
using rd2h::testing::ClosedPort;
using rd2h::testing::eventually;
using namespace std::chrono_literals;

// An engine on a free loopback port; `handle` serves both OpenAI routes.
class Engine {
 public:
  using Handler = std::function<void(const httplib::Request&, httplib::Response&)>;
  explicit Engine(Handler handle, std::atomic<int>* resets = nullptr) {
    server_.Post("/v1/completions", handle);
    server_.Post("/v1/chat/completions", handle);
    server_.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
      std::unique_lock lock(stall_mu_);
      stall_cv_.wait_for(lock, 30s, [this] { return !stalled_; });  // a stalled host
      res.status = health_.load();
    });
    server_.Post("/reset_prefix_cache",
                 [this, resets](const httplib::Request& req, httplib::Response& res) {
                   if (resets) ++*resets;
                   std::lock_guard lock(stall_mu_);
                   reset_params_ = req.params;
                   res.set_content("{}", "application/json");
                 });
    rd2h::testing::reuse_address_only(server_);
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    EXPECT_TRUE(eventually([this] { return server_.is_running(); }));
  }
  ~Engine() { kill(); }
  // Its /health stops answering (a host that froze) until the engine is killed.
  void stall_health() {
    std::lock_guard lock(stall_mu_);
    stalled_ = true;
  }
  std::string origin() const { return "http://127.0.0.1:" + std::to_string(port_); }
  // The query parameters of the last POST /reset_prefix_cache it got.
  httplib::Params reset_params() {
    std::lock_guard lock(stall_mu_);
    return reset_params_;
  }
  // What its /health answers (200 by default; 503: an engine whose core died).
  void set_health(int status) { health_.store(status); }

  // Gone as a killed engine is: its port refuses connections (and stays this test's).
  void kill() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard lock(stall_mu_);
      stalled_ = false;
    }
    stall_cv_.notify_all();
    server_.stop();
    thread_.join();
    closed_.emplace(port_);
  }

 private:
  httplib::Server server_;
  std::atomic<int> health_{200};
  std::mutex stall_mu_;
  httplib::Params reset_params_;  // guarded by stall_mu_
  std::condition_variable stall_cv_;
  bool stalled_ = false;
  int port_ = 0;
  std::thread thread_;
  std::optional<ClosedPort> closed_;
};

// What Prefill got, and whether it ran.
struct PrefillLog {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<json> bodies;
  std::vector<std::string> request_ids;
  std::vector<std::string> client_ids;     // the X-Client-Request-Id header of each dispatch
  std::vector<std::string> authorization;  // the Authorization header of each dispatch
  std::vector<int> prefill_index;  // which Prefill got each dispatch
  int succeeded = 0;               // Prefill runs that answered 200
  int decoding = 0;                // Decode requests whose Prefill ran
  bool released = false;           // the test lets Decode's handlers return
};

class ProxyTest : public ::testing::Test {
 protected:
  void start(int prefill_status = 200, int prefills = 1, int decodes = 1) {
    ClientConfig mc;
    mc.token = token_;
    metaserver_ = std::make_unique<Client>(mc);
    for (int i = 0; i < prefills; ++i) start_prefill(prefill_status, i);
    for (int i = 0; i < decodes; ++i) start_decode(i);
    ProxyConfig config;
    config.prefill_attempts = attempts_;
    config.token = token_;
    config.probe_interval = probe_interval_;
    config.probe_timeout = probe_timeout_;
    for (const auto& p : prefill_) config.prefill.push_back(p->origin());
    for (const auto& d : decodes_) config.decode.push_back(d->origin());
    config.max_body_bytes = 1 << 20;
    auto p = Proxy::start(config);
    ASSERT_TRUE(p) << p.status().to_string();
    proxy_ = std::move(*p);
  }
  void start_decode(int index) {
    decodes_.push_back(std::make_unique<Engine>(
        [this, index](const httplib::Request& req, httplib::Response& res) {
          serve_decode(req, res, index);
        },
        &resets_));
  }
  void start_prefill(int prefill_status, int index) {
    prefill_.push_back(std::make_unique<Engine>(
        [this, prefill_status, index](const httplib::Request& req, httplib::Response& res) {
          {
            std::lock_guard lock(log_.mu);
            log_.bodies.push_back(json::parse(req.body));
            log_.request_ids.push_back(req.get_header_value("X-Request-Id"));
            log_.client_ids.push_back(req.get_header_value("X-Client-Request-Id"));
            log_.authorization.push_back(req.get_header_value("Authorization"));
            log_.prefill_index.push_back(index);
          }
          log_.cv.notify_all();
          int status = prefill_status;
          {
            std::unique_lock lock(log_.mu);
            if (fail_first_ > 0) {
              --fail_first_;
              status = 503;
            }
            if (index == stalled_prefill_) {  // a Prefill whose host froze: no answer
              log_.cv.wait_for(lock, 30s, [&] { return log_.released; });
              return;
            }
          }
          res.status = status;
          if (!prefill_answer_.empty()) {  // an answer of the test's, which Decode waits out
            res.set_content(prefill_answer_, "application/json");
            return;
          }
          res.set_content(status == 200   ? R"({"choices":[{"text":"x"}]})"
                          : status == 400 ? R"({"error":{"message":"too long for Prefill"}})"
                                          : "engine error",
                          "application/json");
          std::lock_guard lock(log_.mu);
          if (status == 200) ++log_.succeeded;
          log_.cv.notify_all();
        },
        &resets_));
  }

  // Decode as vLLM's server is toward the proxy: child ids from X-Request-Id, one
  // rendezvous per child, an answer once Prefill ran.
  void serve_decode(const httplib::Request& req, httplib::Response& res, int index = 0) {
    const json body = json::parse(req.body);
    size_t mine = 0;  // this is the mine-th request Decode got; Prefill runs once for each
    {
      std::lock_guard lock(log_.mu);
      decode_bodies_.push_back(body);
      decode_index_.push_back(index);
      decode_client_ids_.push_back(req.get_header_value("X-Client-Request-Id"));
      mine = decode_bodies_.size();
      if (decode_status_ != 0) {  // a Decode that fails the request at once
        res.status = decode_status_;
        res.set_content("engine error", "text/plain");
        return;
      }
    }
    const std::string parent = req.get_header_value("X-Request-Id");
    std::vector<std::string> children;
    if (req.path == "/v1/chat/completions") {
      children.push_back("chatcmpl-" + parent);
    } else {
      const auto& prompt = body["prompt"];
      const size_t n = prompt.is_array() && !prompt[0].is_number() ? prompt.size() : 1;
      for (size_t i = 0; i < n; ++i) children.push_back("cmpl-" + parent + "-" + std::to_string(i));
    }
    const std::string url = body["kv_transfer_params"]["metaserver"];
    for (size_t i = 0; i < children.size(); ++i) {
      json r = {{"request_id", children[i]},  {"do_remote_prefill", false},
                {"do_remote_decode", true},   {"remote_engine_id", "decode-0"},
                {"remote_host", "127.0.0.1"}, {"remote_port", 30000 + static_cast<int>(i)}};
      EXPECT_TRUE(metaserver_->post(children[i], url, r.dump()).is_ok());
    }
    std::unique_lock lock(log_.mu);
    if (fail_after_dispatch_ != 0) {  // a Decode that fails once Prefill has the request
      log_.cv.wait_for(lock, 30s,
                       [&] { return log_.prefill_index.size() >= mine || log_.released; });
      res.status = fail_after_dispatch_;
      res.set_content("engine error", "text/plain");
      return;
    }
    // Like a Decode whose KV arrives only if Prefill ran: without it, it waits on.
    log_.cv.wait_for(lock, 30s, [&] {
      return static_cast<size_t>(log_.succeeded) >= mine || log_.released;
    });
    ++log_.decoding;
    log_.cv.notify_all();
    log_.cv.wait_for(lock, 30s, [&] { return !hold_decodes_ || log_.released; });
    if (body.value("stream", false)) {
      std::vector<std::string> events = decode_stream_;
      if (events.empty()) events = {R"({"t":"a"})", R"({"t":"b"})", "[DONE]"};
      res.set_chunked_content_provider("text/event-stream",
                                       [events](size_t, httplib::DataSink& sink) {
                                         for (const auto& e : events) {
                                           const std::string chunk = "data: " + e + "\n\n";
                                           sink.write(chunk.data(), chunk.size());
                                         }
                                         sink.done();
                                         return true;
                                       });
    } else {
      res.set_content(R"({"choices":[{"text":"decoded"}]})", "application/json");
    }
  }

  httplib::Result client_post(const std::string& path, const json& body,
                              const httplib::Headers& headers = {}) {
    httplib::Client c(proxy_->url());
    c.set_read_timeout(60, 0);
    return c.Post(path, headers, body.dump(), "application/json");
  }

  void TearDown() override {
    std::lock_guard lock(log_.mu);
    log_.released = true;
    log_.cv.notify_all();
  }

  PrefillLog log_;
  int fail_first_ = 0;  // Prefill answers 503 to this many dispatches first
  std::string token_;   // the engines' bearer token, if any
  std::string prefill_answer_;  // set: what Prefill answers instead of its one token
  std::vector<std::string> decode_stream_;  // set: the data of Decode's stream events
  int attempts_ = 3;
  std::atomic<int> resets_{0};
  std::vector<json> decode_bodies_;
  std::vector<int> decode_index_;  // which Decode got each request
  std::vector<std::string> decode_client_ids_;  // the X-Client-Request-Id of each
  int decode_status_ = 0;          // set: every Decode answers this at once
  int fail_after_dispatch_ = 0;    // set: Decode answers this once Prefill got the request
  bool hold_decodes_ = false;      // Decode answers only once this is false (under log_.mu)
  std::chrono::milliseconds probe_interval_{1000};
  std::chrono::milliseconds probe_timeout_{2000};
  int stalled_prefill_ = -1;  // set: that Prefill never answers a dispatch
  std::unique_ptr<Client> metaserver_;  // Decode's rendezvous posts, with the token
  std::vector<std::unique_ptr<Engine>> prefill_;
  std::vector<std::unique_ptr<Engine>> decodes_;
  std::unique_ptr<Proxy> proxy_;
};

TEST_F(ProxyTest, ASinglePromptGoesToDecodeThenPrefillOnceWithDecodesRendezvous) {
  start();
  auto r = client_post("/v1/completions", {{"model", "m"}, {"prompt", "hello"}, {"max_tokens", 8}});
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body, R"({"choices":[{"text":"decoded"}]})");
  std::lock_guard lock(log_.mu);
  ASSERT_EQ(decode_bodies_.size(), 1u);
  const json& to_decode = decode_bodies_[0]["kv_transfer_params"];
  EXPECT_EQ(to_decode["do_remote_decode"], false);
  EXPECT_EQ(to_decode["do_remote_prefill"], true);
  EXPECT_EQ(to_decode["metaserver"], proxy_->metaserver_url());
  ASSERT_EQ(log_.bodies.size(), 1u);
  const json& to_prefill = log_.bodies[0];
  EXPECT_EQ(to_prefill["stream"], false);
  EXPECT_EQ(to_prefill["max_tokens"], 1);
  EXPECT_EQ(to_prefill["min_tokens"], 1);
  EXPECT_EQ(to_prefill["prompt"], "hello");
  EXPECT_EQ(to_prefill["kv_transfer_params"]["request_id"], "cmpl-" + log_.request_ids[0] + "-0");
  EXPECT_EQ(to_prefill["kv_transfer_params"]["do_remote_decode"], true);
  EXPECT_FALSE(to_prefill["kv_transfer_params"].contains("batch_kv_transfer_params"));
}

TEST_F(ProxyTest, PrefillGetsOneTokenToMakeNoStreamOptionsAndTheTokenAndRequestId) {
  token_ = "engine-token";
  start();
  auto r = client_post("/v1/chat/completions",
                       {{"model", "m"},
                        {"messages", {{{"role", "user"}, {"content", "hi"}}}},
                        {"max_completion_tokens", 8},
                        {"max_tokens", 8},
                        {"min_tokens", 4},
                        {"stream", true},
                        {"stream_options", {{"include_usage", true}}}});
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200);
  std::lock_guard lock(log_.mu);
  ASSERT_EQ(log_.bodies.size(), 1u);
  const json& to_prefill = log_.bodies[0];
  EXPECT_EQ(to_prefill["max_completion_tokens"], 1);
  EXPECT_EQ(to_prefill["max_tokens"], 1);
  EXPECT_EQ(to_prefill["min_tokens"], 1);
  EXPECT_EQ(to_prefill["stream"], false);
  EXPECT_FALSE(to_prefill.contains("stream_options")) << to_prefill.dump();
  EXPECT_EQ(log_.authorization[0], "Bearer engine-token");
  EXPECT_FALSE(log_.request_ids[0].empty()) << "no X-Request-Id to Prefill";
  ASSERT_EQ(decode_bodies_.size(), 1u);
  EXPECT_EQ(decode_bodies_[0]["max_completion_tokens"], 8) << "Decode gets the client's budget";
}

// The proxy routes; the engines decide what they offer. Options rd2h's own engines refuse
// reach real ones as the client wrote them, on both legs.
TEST_F(ProxyTest, EveryOpenAiFieldReachesBothEnginesAsTheClientSentIt) {
  start();
  const json options = {{"n", 2},
                        {"best_of", 3},
                        {"logprobs", 2},
                        {"echo", true},
                        {"stop", {"\n", "END"}},
                        {"logit_bias", {{"50256", -100}}},
                        {"response_format", {{"type", "json_object"}}},
                        {"suffix", "!"},
                        {"top_k", 5},
                        {"guided_choice", {"yes", "no"}},
                        {"temperature", "an engine's business"}};
  json body = {{"model", "m"}, {"prompt", "hello"}, {"max_tokens", 8}};
  body.update(options);
  auto r = client_post("/v1/completions", body);
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200) << r->body;
  std::lock_guard lock(log_.mu);
  ASSERT_EQ(decode_bodies_.size(), 1u);
  ASSERT_EQ(log_.bodies.size(), 1u);
  for (const auto& [name, value] : options.items()) {
    EXPECT_EQ(decode_bodies_[0].value(name, json()), value) << name << " to Decode";
    EXPECT_EQ(log_.bodies[0].value(name, json()), value) << name << " to Prefill";
  }
}

// The client's own id reaches both engines beside the proxy's (which names the transfer), so
// their lines can be found by it; without one, no such header.
TEST_F(ProxyTest, TheClientsRequestIdReachesBothEnginesBesideTheProxysOwn) {
  start();
  const json body = {{"model", "m"}, {"prompt", "hello"}, {"max_tokens", 4}};
  auto r = client_post("/v1/completions", body, {{"X-Request-Id", "client-7"}});
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(r->get_header_value("X-Request-Id"), "client-7");
  auto bare = client_post("/v1/completions", body);
  ASSERT_TRUE(bare) << httplib::to_string(bare.error());
  EXPECT_EQ(bare->status, 200) << bare->body;
  std::lock_guard lock(log_.mu);
  ASSERT_EQ(log_.client_ids.size(), 2u);
  ASSERT_EQ(decode_client_ids_.size(), 2u);
  EXPECT_EQ(log_.client_ids[0], "client-7") << "to Prefill";
  EXPECT_EQ(decode_client_ids_[0], "client-7") << "to Decode";
  EXPECT_NE(log_.request_ids[0], "client-7") << "the transfer is named by the proxy's own id";
  EXPECT_EQ(log_.client_ids[1], "");
  EXPECT_EQ(decode_client_ids_[1], "");
}

// An engine's reason is passed on whole, however long what comes before it.
TEST_F(ProxyTest, APrefillFailureReachesTheClientWithItsWholeReason) {
  const std::string reason =
      "MF_META refused: " + std::string(300, '.') + " layer 'model.layers.3' is not in Prefill's";
  prefill_answer_ = json{{"error", {{"message", reason}, {"type", "server_error"}}}}.dump();
  attempts_ = 1;
  start(500);
  auto r = client_post("/v1/completions", {{"model", "m"}, {"prompt", "hello"}});
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 502) << r->body;
  const json e = json::parse(r->body);
  EXPECT_NE(e["error"]["message"].get<std::string>().find(reason), std::string::npos) << r->body;
}

TEST_F(ProxyTest, APrefillAnswerOverTheBoundIsRefusedNotBufferedAndNotRetried) {
  prefill_answer_ = std::string(2u << 20, 'x');  // 2 MiB for a one-token answer
  start();
  auto r = client_post("/v1/completions", {{"model", "m"}, {"prompt", "hello"}});
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 502);
  EXPECT_NE(r->body.find("answered more than 1048576 bytes"), std::string::npos) << r->body;
  std::lock_guard lock(log_.mu);
  EXPECT_EQ(log_.bodies.size(), 1u) << "an engine that answers too much is not asked again";
}

TEST_F(ProxyTest, ARecomputedEndAfterTheWholeBudgetIsTheAnswersEndNotANewRound) {
  decode_stream_ = {
      R"({"id":"cmpl-1","choices":[{"index":0,"text":"a","finish_reason":null}]})",
      R"({"id":"cmpl-1","choices":[{"index":0,"text":"b","finish_reason":"stop","stop_reason":"recomputed"}]})",
      "[DONE]"};
  start();
  auto r = client_post("/v1/completions",
                       {{"model", "m"}, {"prompt", "hello"}, {"max_tokens", 2}, {"stream", true}});
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body.find("recomputed"), std::string::npos) << r->body;
  EXPECT_NE(r->body.find(R"("text":"b","finish_reason":"length")"), std::string::npos) << r->body;
  EXPECT_EQ(proxy_->stats().reissued, 0u);
  std::lock_guard lock(log_.mu);
  EXPECT_EQ(log_.bodies.size(), 1u) << "Prefill was asked again";
}

TEST_F(ProxyTest, APromptListOf200IsDispatchedToPrefillOnceAfterEveryChildReported) {
  start();
  json prompts = json::array();
  for (int i = 0; i < 200; ++i) prompts.push_back("prompt " + std::to_string(i));
  auto r = client_post("/v1/completions", {{"model", "m"}, {"prompt", prompts}});
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200);
  std::lock_guard lock(log_.mu);
  ASSERT_EQ(log_.bodies.size(), 1u) << "Prefill dispatched more than once";
  const json& params = log_.bodies[0]["kv_transfer_params"];
  const json& batch = params["batch_kv_transfer_params"];
  ASSERT_EQ(batch.size(), 200u);
  const std::string parent = log_.request_ids[0];
  EXPECT_EQ(params["request_id"], "cmpl-" + parent + "-0") << "the first child's params on top";
  EXPECT_EQ(batch["cmpl-" + parent + "-199"]["remote_port"], 30199);
  EXPECT_EQ(log_.bodies[0]["prompt"].size(), 200u) << "the original list goes to Prefill";
  EXPECT_EQ(proxy_->stats().rendezvous, 200u);
}

TEST_F(ProxyTest, ChatAndStreamingPassDecodesOutputThrough) {
  start();
  auto r = client_post(
      "/v1/chat/completions",
      {{"model", "m"}, {"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"stream", true}});
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body, "data: {\"t\":\"a\"}\n\ndata: {\"t\":\"b\"}\n\ndata: [DONE]\n\n");
  std::lock_guard lock(log_.mu);
  ASSERT_EQ(log_.bodies.size(), 1u);
  EXPECT_EQ(log_.bodies[0]["kv_transfer_params"]["request_id"], "chatcmpl-" + log_.request_ids[0]);
  EXPECT_EQ(log_.bodies[0]["stream"], false);
}

TEST_F(ProxyTest, AFailedPrefillDispatchIsTriedThreeTimesThenFailsTheClientRequestWith502) {
  start(/*prefill_status=*/500);
  auto r = client_post("/v1/completions", {{"model", "m"}, {"prompt", "hello"}});
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 502);
  EXPECT_NE(r->body.find("answered HTTP 500"), std::string::npos) << r->body;
  EXPECT_EQ(proxy_->stats().prefill_dispatches, 3u);
  EXPECT_EQ(proxy_->stats().prefill_failures, 3u);
  std::lock_guard lock(log_.mu);
  EXPECT_EQ(log_.bodies.size(), 3u);
}

TEST_F(ProxyTest, APrefillThatFailsOnceIsTriedAgainAndTheClientNeverSeesIt) {
  fail_first_ = 1;
  start();
  auto r = client_post("/v1/completions", {{"model", "m"}, {"prompt", "hello"}});
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(proxy_->stats().prefill_dispatches, 2u);
  std::lock_guard lock(log_.mu);
  ASSERT_EQ(log_.bodies.size(), 2u);
  EXPECT_EQ(log_.bodies[0], log_.bodies[1]) << "the second attempt is the same request";
}

TEST_F(ProxyTest, PrefillAttemptsAreConfigurable) {
  attempts_ = 1;
  start(/*prefill_status=*/503);
  auto r = client_post("/v1/completions", {{"model", "m"}, {"prompt", "hello"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 502);
  EXPECT_EQ(proxy_->stats().prefill_dispatches, 1u);
}

TEST_F(ProxyTest, AClientBodyPrefillRefusesIsNotTriedAgainAndReachesTheClientAsIs) {
  start(/*prefill_status=*/400);
  auto r = client_post("/v1/completions", {{"model", "m"}, {"prompt", "hello"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400) << r->body;
  EXPECT_NE(r->body.find("too long for Prefill"), std::string::npos) << r->body;
  EXPECT_EQ(proxy_->stats().prefill_dispatches, 1u);
}

TEST_F(ProxyTest, HealthcheckCountsInstancesAndResetPrefixCacheReachesEveryEngine) {
  start(200, /*prefills=*/2);
  httplib::Client c(proxy_->url());
  auto h = c.Get("/healthcheck");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  EXPECT_EQ(json::parse(h->body),
            json({{"status", "ok"}, {"prefill_instances", 2}, {"decode_instances", 1}}));
  auto reset = c.Post("/reset_prefix_cache?reset_running_requests=true&reset_external=1", "",
                      "application/json");
  ASSERT_TRUE(reset);
  EXPECT_EQ(reset->status, 200) << reset->body;
  EXPECT_EQ(resets_.load(), 3);
  // Its query parameters reached every engine, as vLLM's own route takes them.
  const httplib::Params asked = {{"reset_external", "1"}, {"reset_running_requests", "true"}};
  for (auto* engines : {&prefill_, &decodes_}) {
    for (auto& e : *engines) EXPECT_EQ(e->reset_params(), asked) << e->origin();
  }
  prefill_.back()->kill();  // one engine gone: named in a 500
  reset = c.Post("/reset_prefix_cache", "", "application/json");
  ASSERT_TRUE(reset);
  EXPECT_EQ(reset->status, 500);
  EXPECT_NE(reset->body.find("not reset on http://127.0.0.1:"), std::string::npos) << reset->body;
}

TEST_F(ProxyTest, APrefillThatIsGoneFailsTheClientRequestWithinASecond) {
  start();
  for (auto& p : prefill_) p->kill();
  const auto begin = std::chrono::steady_clock::now();
  auto r = client_post("/v1/completions", {{"model", "m"}, {"prompt", "hello"}});
  const auto took = std::chrono::steady_clock::now() - begin;
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 502);
  EXPECT_NE(r->body.find("did not answer: Connection"), std::string::npos) << r->body;
  // Decode here would wait 30 s for KV that never comes: the proxy cuts its request. The
  // bound is the issue's second, with slack for sanitizers.
  EXPECT_LT(took, 5s);
}

TEST_F(ProxyTest, AnUnknownRendezvousIs404AndOversizedOrBrokenBodiesAreRefused) {
  start();
  httplib::Client meta(proxy_->metaserver_url().substr(0, proxy_->metaserver_url().find("/v1")));
  auto r = meta.Post("/v1/metaserver", R"({"request_id":"cmpl-nobody-0"})", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);
  EXPECT_NE(r->body.find("cmpl-nobody-0"), std::string::npos);
  r = meta.Post("/v1/metaserver", "[1]", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  auto big = client_post("/v1/completions", {{"prompt", std::string(2 << 20, 'x')}});
  ASSERT_TRUE(big);
  EXPECT_EQ(big->status, 413);
  httplib::Client c(proxy_->url());
  auto broken = c.Post("/v1/completions", "{not json", "application/json");
  ASSERT_TRUE(broken);
  EXPECT_EQ(broken->status, 400);
  std::lock_guard lock(log_.mu);
  EXPECT_TRUE(decode_bodies_.empty()) << "a refused request reached Decode";
}

TEST_F(ProxyTest, ADeeplyNestedBodyIsRefusedWith400) {
  start();
  // 100k levels: copying or writing the body would recurse past a thread's stack.
  const std::string body =
      R"({"prompt":"x","extra":)" + std::string(100000, '[') + std::string(100000, ']') + "}";
  httplib::Client c(proxy_->url());
  c.set_read_timeout(60, 0);
  auto r = c.Post("/v1/completions", body, "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_NE(r->body.find("deeper than 64 levels"), std::string::npos) << r->body;
  std::lock_guard lock(log_.mu);
  EXPECT_TRUE(decode_bodies_.empty()) << "a refused request reached Decode";
}

TEST_F(ProxyTest, IdleInstancesAreUsedInTurn) {
  start(200, /*prefills=*/2);
  // Idle: the proxy counts a Prefill's request done when Prefill answered, which may come
  // after the client has Decode's answer.
  const auto idle = [&] {
    for (const auto& p : prefill_) {
      const std::string series =
          "rd2h_proxy_upstream_in_flight{role=\"prefill\",engine=\"" + p->origin() + "\"}";
      if (rd2h::testing::metric(proxy_->url(), series).value_or(0.0) != 0.0) return false;
    }
    return true;
  };
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(eventually(idle)) << "a Prefill request never ended";
    auto r = client_post("/v1/completions", {{"model", "m"}, {"prompt", "p"}});
    ASSERT_TRUE(r && r->status == 200);
  }
  std::lock_guard lock(log_.mu);
  EXPECT_EQ(log_.prefill_index, (std::vector<int>{0, 1, 0, 1}));
}

// GET /health of the proxy: its status and JSON body.
std::pair<int, json> health(const std::string& url) {
  httplib::Client c(url);
  auto r = c.Get("/health");
  EXPECT_TRUE(r);
  if (!r) return {0, json()};
  return {r->status, json::parse(r->body, nullptr, false)};
}

using rd2h::testing::metric;

// A series of the proxy's metrics about one engine instance.
std::string about(const std::string& name, const std::string& role, const std::string& origin) {
  return name + "{role=\"" + role + "\",engine=\"" + origin + "\"}";
}

TEST_F(ProxyTest, ADecodeThatIsGoneLeavesTheRotationAtOnceAndItsRequestGoesToAnother) {
  start(200, /*prefills=*/1, /*decodes=*/2);
  decodes_[0]->kill();
  for (int i = 0; i < 10; ++i) {
    auto r = client_post("/v1/completions", {{"model", "m"}, {"prompt", "p"}});
    ASSERT_TRUE(r) << httplib::to_string(r.error());
    EXPECT_EQ(r->status, 200) << "request " << i << ": " << r->body;
  }
  // The first request may meet the dead Decode (before a probe did); no other does.
  EXPECT_LE(proxy_->stats().decode_retries, 1u);
  {
    std::lock_guard lock(log_.mu);
    EXPECT_EQ(log_.succeeded, 10) << "a Prefill dispatch per request, each served";
    for (int d : decode_index_) EXPECT_EQ(d, 1) << "the dead Decode got a request";
  }
  ASSERT_TRUE(eventually([&] { return health(proxy_->url()).second.value("status", "") == "degraded"; }))
      << health(proxy_->url()).second.dump();
  const auto [status, body] = health(proxy_->url());
  EXPECT_EQ(status, 200) << "one Prefill and one Decode serve";
  EXPECT_EQ(body["decode"][0]["healthy"], false) << body.dump();
  EXPECT_NE(body["decode"][0].value("reason", "").find("did not answer"), std::string::npos)
      << body.dump();
  EXPECT_EQ(body["decode"][1]["healthy"], true) << body.dump();
  // And so says /metrics.
  const std::string gone = decodes_[0]->origin(), serving = decodes_[1]->origin();
  const std::string rotation = "rd2h_proxy_instance_in_rotation";
  EXPECT_EQ(metric(proxy_->url(), about(rotation, "decode", gone)), 0.0);
  EXPECT_EQ(metric(proxy_->url(), about(rotation, "decode", serving)), 1.0);
  EXPECT_EQ(metric(proxy_->url(), about(rotation, "prefill", prefill_[0]->origin())), 1.0);
  EXPECT_GE(metric(proxy_->url(), about("rd2h_proxy_taken_out_total", "decode", gone)), 1.0);
}

TEST_F(ProxyTest, ADecodeThatFailsARequestWithA5xxBeforeAnswerIsTriedOnAnother) {
  decode_status_ = 500;  // every Decode fails at once: both are tried, then the client hears
  start(200, /*prefills=*/1, /*decodes=*/2);
  auto r = client_post("/v1/completions", {{"model", "m"}, {"prompt", "p"}});
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 500) << r->body;  // the last Decode's own answer
  EXPECT_EQ(proxy_->stats().decode_retries, 1u);
  EXPECT_EQ(metric(proxy_->url(), "rd2h_proxy_decode_retries_total"), 1.0);
  std::lock_guard lock(log_.mu);
  EXPECT_EQ(decode_index_.size(), 2u);
  ASSERT_EQ(decode_index_.size(), 2u);
  EXPECT_NE(decode_index_[0], decode_index_[1]) << "the second attempt went to the same Decode";
}

TEST_F(ProxyTest, APrefillThatFailsLeavesTheRotationAndComesBackWhenItsProbeAnswers) {
  probe_interval_ = 100ms;
  fail_first_ = 1;  // the first dispatch gets a 503 from whichever Prefill takes it
  start(200, /*prefills=*/2);
  auto r = client_post("/v1/completions", {{"model", "m"}, {"prompt", "p"}});
  ASSERT_TRUE(r && r->status == 200) << (r ? r->body : httplib::to_string(r.error()));
  int failed_one = 0;
  {
    std::lock_guard lock(log_.mu);
    ASSERT_EQ(log_.prefill_index.size(), 2u);
    failed_one = log_.prefill_index[0];
    EXPECT_NE(log_.prefill_index[1], failed_one) << "the retry went to the Prefill that failed";
  }
  EXPECT_GE(proxy_->stats().taken_out, 1u);
  // Its probe answers: it is back, and takes requests in turn again.
  ASSERT_TRUE(eventually([&] { return proxy_->stats().brought_back >= 1; }));
  for (int i = 0; i < 4; ++i) {
    auto again = client_post("/v1/completions", {{"model", "m"}, {"prompt", "p"}});
    ASSERT_TRUE(again && again->status == 200);
  }
  std::lock_guard lock(log_.mu);
  EXPECT_EQ(std::count(log_.prefill_index.begin() + 2, log_.prefill_index.end(), failed_one), 2)
      << "the Prefill that came back is not used in turn";
}

TEST_F(ProxyTest, ADispatchHeldByAPrefillThatStallsIsCutWhenItsProbeFailsAndServedByAnother) {
  probe_interval_ = 100ms;
  probe_timeout_ = 300ms;
  stalled_prefill_ = 0;  // the first dispatch goes to Prefill 0, which never answers it
  start(200, /*prefills=*/2);
  std::optional<httplib::Result> r;
  std::thread client([&] { r = client_post("/v1/completions", {{"model", "m"}, {"prompt", "p"}}); });
  ASSERT_TRUE(eventually([&] {
    std::lock_guard lock(log_.mu);
    return !log_.prefill_index.empty();
  }));
  prefill_[0]->stall_health();  // now its host freezes: its probe fails
  client.join();
  ASSERT_TRUE(r && *r) << "no answer";
  EXPECT_EQ((*r)->status, 200) << (*r)->body;
  EXPECT_GE(proxy_->stats().taken_out, 1u);
  std::lock_guard lock(log_.mu);
  EXPECT_EQ(log_.prefill_index, (std::vector<int>{0, 1})) << "not cut and sent to Prefill 1";
}

TEST_F(ProxyTest, HealthIs503OnlyWhenNoInstanceOfARoleServesAndNamesWhatIsOut) {
  probe_interval_ = 50ms;
  start(200, /*prefills=*/2, /*decodes=*/1);
  prefill_[0]->set_health(503);  // an engine whose core died
  ASSERT_TRUE(eventually([&] { return health(proxy_->url()).second.value("status", "") == "degraded"; }));
  auto [status, body] = health(proxy_->url());
  EXPECT_EQ(status, 200);
  EXPECT_NE(body["prefill"][0].value("reason", "").find("HTTP 503"), std::string::npos)
      << body.dump();
  decodes_[0]->set_health(503);
  ASSERT_TRUE(eventually([&] { return health(proxy_->url()).first == 503; }));
  std::tie(status, body) = health(proxy_->url());
  EXPECT_EQ(body["status"], "unhealthy") << body.dump();
  decodes_[0]->set_health(200);
  prefill_[0]->set_health(200);
  ASSERT_TRUE(eventually([&] { return health(proxy_->url()).second.value("status", "") == "ok"; }));
}

TEST_F(ProxyTest, ADecodeThatFailsWithNoOtherToTryHasItsPrefillDispatchStoppedNotRetried) {
  fail_after_dispatch_ = 500;
  stalled_prefill_ = 0;  // Prefill holds the dispatch: only the proxy can end it
  start(200, /*prefills=*/1, /*decodes=*/1);
  auto r = client_post("/v1/completions", {{"model", "m"}, {"prompt", "p"}});
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 500) << "not Decode's own answer: " << r->body;
  ASSERT_TRUE(eventually([&] { return proxy_->stats().prefill_abandoned == 1; }))
      << "the Prefill dispatch of a request whose Decode failed goes on";
  const auto stats = proxy_->stats();
  EXPECT_EQ(stats.prefill_dispatches, 1u) << "the dispatch was tried again";
  EXPECT_EQ(stats.prefill_failures, 0u) << "a dispatch the proxy stopped is no Prefill failure";
  EXPECT_EQ(metric(proxy_->url(), "rd2h_proxy_prefill_abandoned_total"), 1.0);
  EXPECT_EQ(health(proxy_->url()).second["prefill"][0]["healthy"], true);
}

// GET or POST /admin/instances with the engines' token: status and JSON body.
std::pair<int, json> admin(const std::string& url, const std::optional<json>& set,
                           const std::string& token) {
  httplib::Client c(url);
  httplib::Headers h;
  if (!token.empty()) h.emplace("Authorization", "Bearer " + token);
  auto r = set ? c.Post("/admin/instances", h, set->dump(), "application/json")
               : c.Get("/admin/instances", h);
  EXPECT_TRUE(r);
  if (!r) return {0, json()};
  return {r->status, json::parse(r->body, nullptr, false)};
}

// The states of a pool's instances as GET /admin/instances lists them: url -> state.
std::map<std::string, std::string> states(const json& pool) {
  std::map<std::string, std::string> out;
  for (const auto& i : pool) out[i.value("url", "")] = i.value("state", "");
  return out;
}

TEST_F(ProxyTest, InstancesAreAddedAndRemovedWhileTheProxyRunsWithoutDroppingRequestsInFlight) {
  token_ = "an-operator-token-of-some-length";
  hold_decodes_ = true;
  start(200, /*prefills=*/1, /*decodes=*/2);
  const std::string d0 = decodes_[0]->origin(), d1 = decodes_[1]->origin();
  EXPECT_EQ(admin(proxy_->url(), std::nullopt, "").first, 401) << "the admin routes take a token";

  std::optional<httplib::Result> held;
  std::thread client([&] {
    held = client_post("/v1/completions", {{"model", "m"}, {"prompt", "p"}});
  });
  ASSERT_TRUE(eventually([&] {
    std::lock_guard lock(log_.mu);
    return log_.decoding == 1;
  }));
  int holder = 0;
  {
    std::lock_guard lock(log_.mu);
    holder = decode_index_.at(0);
  }
  const std::string leaving = holder == 0 ? d0 : d1, staying = holder == 0 ? d1 : d0;
  start_decode(2);  // a new Decode joins, and the one holding the request leaves
  const std::string joined = decodes_[2]->origin();
  const ClosedPort dead;
  const std::string nobody = "http://127.0.0.1:" + std::to_string(dead.port());
  auto [status, pools] = admin(proxy_->url(), json{{"decode", {staying, joined, nobody}}}, token_);
  ASSERT_EQ(status, 200) << pools.dump();
  EXPECT_EQ(states(pools["decode"]),
            (std::map<std::string, std::string>{{leaving, "leaving"},
                                                {staying, "serving"},
                                                {joined, "serving"},
                                                {nobody, "out of rotation"}}))
      << pools.dump();
  EXPECT_EQ(pools["prefill"].size(), 1u) << "a pool the body does not name is changed";

  {
    std::lock_guard lock(log_.mu);
    hold_decodes_ = false;
  }
  log_.cv.notify_all();
  client.join();
  ASSERT_TRUE(held && *held) << "the request in flight on the Decode that left was dropped";
  EXPECT_EQ((*held)->status, 200) << (*held)->body;

  for (int i = 0; i < 4; ++i) {
    auto r = client_post("/v1/completions", {{"model", "m"}, {"prompt", "p"}});
    ASSERT_TRUE(r && r->status == 200) << (r ? r->body : httplib::to_string(r.error()));
  }
  {
    std::lock_guard lock(log_.mu);
    const std::vector<int> later(decode_index_.begin() + 1, decode_index_.end());
    EXPECT_EQ(std::count(later.begin(), later.end(), holder), 0) << "the removed Decode got one";
    EXPECT_EQ(std::count(later.begin(), later.end(), 2), 2) << "the new Decode is not used in turn";
  }
  std::tie(status, pools) = admin(proxy_->url(), std::nullopt, token_);
  EXPECT_EQ(states(pools["decode"]).count(leaving), 0u) << "gone once its request finished";
  EXPECT_EQ(health(proxy_->url()).second["decode"].size(), 3u);
}

TEST_F(ProxyTest, ABadInstanceListIsRefusedWholeNamingWhatIsWrong) {
  start(200, /*prefills=*/1, /*decodes=*/1);
  const std::string d0 = decodes_[0]->origin();
  const std::vector<std::pair<json, std::string>> bad = {
      {json{{"decode", json::array()}}, "list of 1 to"},
      {json{{"decode", {d0, "127.0.0.1:1"}}}, "'127.0.0.1:1' is not http://host:port"},
      {json{{"decode", {d0, "http://10.0.0.256:1"}}}, "'10.0.0.256' is not a valid IPv4 address"},
      {json{{"decode", {d0, d0}}}, "listed twice"},
      {json{{"decode", {d0}}, {"encode", {d0}}}, "unknown key 'encode'"},
      {json{{"prefill", "http://127.0.0.1:1"}}, "prefill must be a list"},
  };
  for (const auto& [body, why] : bad) {
    auto [status, answer] = admin(proxy_->url(), body, "");
    EXPECT_EQ(status, 400) << body.dump();
    EXPECT_NE(answer["error"].value("message", "").find(why), std::string::npos)
        << body.dump() << " -> " << answer.dump();
  }
  auto [status, pools] = admin(proxy_->url(), std::nullopt, "");
  EXPECT_EQ(states(pools["decode"]), (std::map<std::string, std::string>{{d0, "serving"}}));
}

TEST(Proxy, RefusesEngineAddressesThatAreNotOrigins) {
  ProxyConfig config;
  config.prefill = {"127.0.0.1:8000"};
  auto p = Proxy::start(config);
  ASSERT_FALSE(p);
  EXPECT_NE(p.status().message().find("127.0.0.1:8000"), std::string::npos);
}

// A proxy bound to every address, its engines on a closed port.
ProxyConfig on_wildcard() {
  ProxyConfig config;
  config.host = "0.0.0.0";
  config.prefill = config.decode = {"http://127.0.0.1:9"};
  return config;
}

TEST(Proxy, AWildcardHostNeedsAnAdvertisedAddressWhichDecodeIsToldToPostTo) {
  ProxyConfig config = on_wildcard();
  config.token = "a-token-of-sixteen-chars";
  auto refused = Proxy::start(config);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.status().message().find("--advertise-host"), std::string::npos)
      << refused.status().to_string();
  for (const char* wrong : {"0.0.0.0", "::", "10.0.0.256"}) {
    config.advertise_host = wrong;
    auto p = Proxy::start(config);
    ASSERT_FALSE(p) << wrong;
    EXPECT_NE(p.status().message().find(std::string("--advertise-host '") + wrong + "'"),
              std::string::npos)
        << p.status().to_string();
  }
  config.advertise_host = "proxy-0.example";
  auto p = Proxy::start(config);
  ASSERT_TRUE(p) << p.status().to_string();
  EXPECT_EQ((*p)->metaserver_url().rfind("http://proxy-0.example:", 0), 0u)
      << (*p)->metaserver_url();
  config.advertise_host = "fd00::1";
  auto v6 = Proxy::start(config);
  ASSERT_TRUE(v6) << v6.status().to_string();
  EXPECT_EQ((*v6)->metaserver_url().rfind("http://[fd00::1]:", 0), 0u) << (*v6)->metaserver_url();
}

TEST(Proxy, AProxyOffLoopbackWithoutKeyOrTokenIsRefusedUnlessAllowed) {
  ProxyConfig config = on_wildcard();
  config.advertise_host = "127.0.0.1";
  auto refused = Proxy::start(config);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.status().message().find("neither an API key"), std::string::npos)
      << refused.status().to_string();
  EXPECT_NE(refused.status().message().find("--allow-unauthenticated"), std::string::npos);
  config.api_key = "a-client-key-of-sixteen";
  EXPECT_TRUE(Proxy::start(config)) << "an API key is enough";
  config.api_key.clear();
  config.allow_unauthenticated = true;
  EXPECT_TRUE(Proxy::start(config));
  config.allow_unauthenticated = false;
  config.host = "127.0.0.1";
  config.advertise_host.clear();
  EXPECT_TRUE(Proxy::start(config)) << "loopback needs neither";
}

}  // namespace
}  // namespace rd2h::metaserver
