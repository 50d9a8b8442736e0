#include "rd2h/metaserver/proxy.h"

#include <sodium.h>

#include "control/curve.h"
#include "metaserver/proxy_impl.h"

namespace rd2h::metaserver {

namespace {

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1" || host == "[::1]";
}

// Where Decode engines are told to post, and who may reach the proxy: an advertised
// address they can post to, and no open proxy on a network address unless asked for.
Status check_addresses(const ProxyConfig& config) {
  if (config.advertise_host.empty() && control::is_wildcard_host(config.host)) {
    return invalid_argument("--host '" + config.host +
                            "' is a wildcard address, which Decode engines cannot post their "
                            "rendezvous to: give --advertise-host, the address they reach this "
                            "proxy at");
  }
  if (!config.advertise_host.empty()) {
    if (control::is_wildcard_host(config.advertise_host)) {
      return invalid_argument("--advertise-host '" + config.advertise_host +
                              "' is a wildcard address: give the address Decode engines reach "
                              "this proxy at");
    }
    if (auto u = parse_origin(http_origin(config.advertise_host, 1)); !u) {
      return invalid_argument("--advertise-host '" + config.advertise_host +
                              "' is not a valid host name or address");
    }
  }
  if (!is_loopback(config.host) && config.token.empty() && config.api_key.empty()) {
    const std::string what = "the proxy serves " + config.host +
                             ", not a loopback address, with neither an API key (--api-key or "
                             "RD2H_API_KEY) for its clients nor a token (--token-file) for its "
                             "metaserver and engines: anyone who reaches it may use the "
                             "engines and post rendezvous";
    if (!config.allow_unauthenticated) {
      return invalid_argument(what + "; give them, or --allow-unauthenticated to serve it open");
    }
    log::warn("proxy: {} (--allow-unauthenticated)", what);
  }
  return Status::ok();
}

}  // namespace

Expected<std::unique_ptr<Proxy>> Proxy::start(ProxyConfig config) {
  for (const auto& [flag, list] :
       {std::pair{"--prefill", &config.prefill}, std::pair{"--decode", &config.decode}}) {
    for (const auto& origin : *list) {
      if (auto u = parse_origin(origin); !u) return u.status().with_context(flag);
    }
  }
  RD2H_RETURN_IF_ERROR(check_addresses(config));
  if (sodium_init() < 0) return internal_error("libsodium could not be initialised");
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  impl->decodes.assign("decode", config.decode);
  impl->prefills.assign("prefill", config.prefill);
  impl->publish_rotation(impl->decodes);
  impl->publish_rotation(impl->prefills);
  impl->decode_retry_count.with();  // present at 0 from the start
  impl->abandoned_count.with();
  impl->dispatchers = std::make_unique<ThreadPool>(config.max_concurrent);
  if (!config.token.empty()) impl->auth.emplace("Authorization", http::bearer(config.token));
  Impl* p = impl.get();
  p->make_servers();
  p->add_routes();
  RD2H_RETURN_IF_ERROR(p->api->start());
  RD2H_RETURN_IF_ERROR(p->rendezvous->start());
  p->api_port = p->api->port();
  p->rendezvous_port = p->rendezvous->port();
  if (config.probe_interval.count() > 0) p->prober = std::thread([p] { p->probe_loop(); });
  return std::unique_ptr<Proxy>(new Proxy(std::move(impl)));
}

void Proxy::Impl::make_servers() {
  http::HttpServerConfig client;
  client.host = config.host;
  client.port = config.port;
  client.name = "client API";
  client.max_body_bytes = config.max_body_bytes;
  client.max_connections = config.max_concurrent == 0 ? 1 : config.max_concurrent;
  client.token = config.token;
  client.api_key = config.api_key;
  client.metrics = &http_metrics;
  http::HttpServerConfig meta = client;
  meta.port = config.metaserver_port;
  meta.name = "metaserver";
  meta.max_connections = http::HttpServerConfig{}.max_connections;
  meta.api_key.clear();
  meta.access_log = false;  // a post per prompt: at debug level
  meta.metrics_name = "metaserver";
  api = std::make_unique<http::HttpServer>(client);
  rendezvous = std::make_unique<http::HttpServer>(meta);
}

void Proxy::Impl::add_routes() {
  for (http::HttpServer* s : {api.get(), rendezvous.get()}) {
    s->post("/v1/metaserver", http::HttpServer::Auth::kToken,
            [this](const httplib::Request& req, httplib::Response& res) {
              handle_rendezvous(req, res);
            });
  }
  // The client-facing routes take the client API key (if one is set), not the engine token.
  using Auth = http::HttpServer::Auth;
  api->post("/v1/completions", Auth::kApiKey,
            [this](const httplib::Request& req, httplib::Response& res) {
              handle_client(req, res, false);
            });
  api->post("/v1/chat/completions", Auth::kApiKey,
            [this](const httplib::Request& req, httplib::Response& res) {
              handle_client(req, res, true);
            });
  api->get("/v1/models", Auth::kApiKey,
           [this](const httplib::Request&, httplib::Response& res) { handle_models(res); });
  // The existing proxy's operator routes.
  api->get("/healthcheck", Auth::kNone, [this](const httplib::Request&, httplib::Response& res) {
    std::lock_guard lock(mu);
    res.set_content(ordered_json{{"status", "ok"},
                                 {"prefill_instances", prefills.members().size()},
                                 {"decode_instances", decodes.members().size()}}
                        .dump(),
                    "application/json");
  });
  // The pools, listed and set while the proxy runs: with the engines' token.
  auto instances = [this](const httplib::Request& req, httplib::Response& res) {
    handle_instances(req, res);
  };
  api->get("/admin/instances", Auth::kToken, instances);
  api->post("/admin/instances", Auth::kToken, instances);
  api->post("/reset_prefix_cache", Auth::kApiKey,
            [this](const httplib::Request& req, httplib::Response& res) {
              handle_reset_prefix_cache(req, res);
            });
  api->get("/health", Auth::kNone,
           [this](const httplib::Request&, httplib::Response& res) { handle_health(res); });
  api->get("/metrics", Auth::kNone, [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(registry.render(), metrics::kContentType);
  });
  api->get("/version", Auth::kNone, [](const httplib::Request&, httplib::Response& res) {
    res.set_content(ordered_json{{"version", rd2h::version()}}.dump(), "application/json");
  });
}

Proxy::Proxy(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

bool Proxy::drain(std::chrono::milliseconds bound) {
  Impl& p = *impl_;
  std::unique_lock lock(p.mu);
  p.draining = true;
  return p.idle_cv.wait_for(lock, bound, [&] { return p.parents.empty(); });
}

Proxy::~Proxy() {
  Impl& p = *impl_;
  std::vector<std::shared_ptr<Parent>> in_flight;
  {
    std::lock_guard lock(p.mu);
    p.stopping = true;
    in_flight.assign(p.parents.begin(), p.parents.end());
  }
  p.idle_cv.notify_all();  // a dispatch backing off (or the prober) stops waiting
  if (p.prober.joinable()) p.prober.join();
  // Failed first, so that the dispatches cut below are not taken for Prefill's failures.
  for (auto& parent : in_flight) {
    parent->fail(503, http::api_error_json(503, "the proxy is stopping"));
  }
  in_flight.clear();
  {
    std::lock_guard lock(p.mu);
    for (auto& [which, c] : p.dispatch_clients) c->stop();
  }
  {
    // Their handlers wake within a look and answer 503 before the connections close.
    std::unique_lock lock(p.mu);
    p.idle_cv.wait_for(lock, std::chrono::seconds(5), [&] { return p.parents.empty(); });
  }
  p.api->stop(std::chrono::seconds(5));  // the 503s of what was aborted go out first
  p.rendezvous->stop();
  p.dispatchers->stop();
}

int Proxy::port() const {
  return impl_->api_port;
}
std::string Proxy::url() const {
  return "http://" + impl_->config.host + ":" + std::to_string(impl_->api_port);
}
std::string Proxy::metaserver_url() const {
  return impl_->metaserver_url();
}
ProxyStats Proxy::stats() const {
  std::lock_guard lock(impl_->mu);
  return impl_->stats;
}

}  // namespace rd2h::metaserver
