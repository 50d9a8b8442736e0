#include "sim/engine.h"

#include "sim/engine_impl.h"

namespace rd2h::sim {

Status Engine::Impl::check_config() const {
  const auto& m = config.model;
  if (m.layers < 1 || m.block_size == 0 || m.num_blocks == 0 || m.bytes_per_token.size() < 2 ||
      std::find(m.bytes_per_token.begin(), m.bytes_per_token.end(), 0u) !=
          m.bytes_per_token.end()) {
    return invalid_argument(
        "model layout: layers, block size, blocks and tensor sizes must be set");
  }
  if (config.tp_size < 1) return invalid_argument("TP size must be at least 1");
  if (config.token_budget == 0) return invalid_argument("token budget must be at least 1");
  if (config.worker_executable.empty()) {
    return invalid_argument(
        "worker_executable: the rd2h binary the TP rank processes run is not set");
  }
  return Status::ok();
}

Status Engine::Impl::init() {
  RD2H_RETURN_IF_ERROR(check_config());
  const auto& m = config.model;
  prefill = config.connector.role == connector::KvRole::kProducer;
  model = std::make_unique<KvModel>(m);
  corrupt_pending = prefill && config.test_corrupt_layer >= 0;
  trace::set_enabled(config.trace);
  connector::Parallel parallel{config.tp_size, 1, 1, 0};
  connector::KvCacheGroup group{{}, m.block_size};
  for (int l = 0; l < m.layers; ++l) group.layer_names.push_back(layer_name(l));
  RD2H_TRY(s, connector::Scheduler::create(config.connector, parallel, {group}));
  scheduler = std::move(s);
  if (!prefill) {
    RD2H_TRY(p, SharedPool::create(model->main_pool_bytes()));
    pool = std::move(p);
    stats.main_pool_locked = pool->lock();
  }
  RD2H_TRY(set, RankSet::start(config.worker_executable, config.tp_size, kRankStartTimeout));
  ranks = std::move(set);
  RD2H_RETURN_IF_ERROR(init_ranks());
  if (pool) pool->unlink();  // every rank mapped it: nothing is left behind after a crash
  for (int64_t b = static_cast<int64_t>(m.num_blocks) - 1; b >= 0; --b) free_blocks.push_back(b);
  stats.free_blocks = m.num_blocks;
  return Status::ok();
}

Status Engine::Impl::init_ranks() {
  const auto& m = config.model;
  json init = {{"op", "init"},
               {"tp", config.tp_size},
               {"trace", config.trace},
               {"connector", config.connector.to_json()},
               {"layers", m.layers},
               {"block_size", m.block_size},
               {"bytes_per_token", m.bytes_per_token},
               {"num_blocks", m.num_blocks},
               {"slots", m.prefill_slots},
               {"compute_ns_per_token", config.compute_ns_per_token},
               {"compute_min_layer_us", config.compute_min_layer_us},
               {"corrupt_layer", config.test_corrupt_layer},
               {"fault_rank", config.test_fault_rank},
               {"host", config.connector.host}};
  if (pool) init["pool"] = pool->name();
  init["ipc_dir"] = ranks->ipc_dir();
  // Decode rank 0 binds the group's all-gather before the others connect to it.
  std::vector<json> first(ranks->size());
  first[0] = init;
  first[0]["rank"] = 0;
  RD2H_TRY(r0, ranks->call(first, kRankStartTimeout));
  if (!r0[0].value("ok", false)) {
    return internal_error("TP rank 0: " + r0[0].value("error", std::string()));
  }
  std::vector<json> rest(ranks->size());
  for (size_t k = 1; k < rest.size(); ++k) {
    rest[k] = init;
    rest[k]["rank"] = k;
    rest[k]["gather"] = r0[0].value("gather", std::string());
  }
  RD2H_TRY(rn, ranks->call(rest, kRankStartTimeout));
  for (size_t k = 1; k < rest.size(); ++k) {
    if (!rn[k].value("ok", false)) {
      return internal_error("TP rank " + std::to_string(k) + ": " +
                            rn[k].value("error", std::string()));
    }
  }
  return Status::ok();
}

Expected<std::unique_ptr<Engine>> Engine::start(EngineConfig config) {
  auto impl = std::make_unique<Impl>();
  impl->config = std::move(config);
  RD2H_RETURN_IF_ERROR(impl->init());
  Impl* p = impl.get();
  http::HttpServerConfig api;
  api.host = p->config.host;
  api.port = p->config.port;
  api.name = "engine's HTTP API";
  api.max_body_bytes = p->config.max_body_bytes;
  api.token = p->config.token;
  api.metrics = &p->http_metrics;
  p->server = std::make_unique<http::HttpServer>(api);
  p->add_routes();
  p->add_metrics();
  // The core first: the destructor joins it before it stops HTTP.
  p->core = std::thread([p] { p->run_core(); });
  if (Status st = p->server->start(); !st) {
    {
      std::lock_guard lock(p->mu);
      p->stopping = true;
    }
    p->cv.notify_all();
    p->core.join();
    p->ranks->stop(std::chrono::seconds(10));
    return st;
  }
  p->http_port = p->server->port();
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

void Engine::Impl::add_routes() {
  using Auth = http::HttpServer::Auth;
  server->post("/v1/completions", Auth::kToken,
             [this](const httplib::Request& q, httplib::Response& s) { serve(q, s, false); });
  server->post("/v1/chat/completions", Auth::kToken,
             [this](const httplib::Request& q, httplib::Response& s) { serve(q, s, true); });
  server->get("/v1/models", Auth::kToken, [this](const httplib::Request&, httplib::Response& s) {
    const json model = {{"id", config.served_model_name},
                        {"object", "model"},
                        {"created", started_at},
                        {"owned_by", "rd2h"},
                        {"max_model_len", config.model.num_blocks * config.model.block_size}};
    s.set_content(json{{"object", "list"}, {"data", {model}}}.dump(), "application/json");
  });
  // Nothing to drop: the pretend local prefix cache is a setting, not a cache.
  server->post("/reset_prefix_cache", Auth::kToken,
             [](const httplib::Request&, httplib::Response& s) {
               s.set_content(R"({"status":"ok"})", "application/json");
             });
  // Probes take no token, as load balancers and orchestrators send none.
  server->get("/health", Auth::kNone, [this](const httplib::Request&, httplib::Response& s) {
    std::lock_guard lock(mu);
    if (auto why = refusal()) return http::set_api_error(s, 503, *why);
    s.set_content(json{{"status", "ok"}, {"role", prefill ? "prefill" : "decode"}}.dump(),
                  "application/json");
  });
  server->get("/metrics", Auth::kNone, [this](const httplib::Request&, httplib::Response& s) {
    s.set_content(registry.render(), metrics::kContentType);
  });
  server->get("/version", Auth::kNone, [](const httplib::Request&, httplib::Response& s) {
    s.set_content(json{{"version", rd2h::version()}}.dump(), "application/json");
  });
  server->get("/rd2h/report", Auth::kToken,
            [this](const httplib::Request&, httplib::Response& s) { report(s); });
}

void Engine::Impl::add_metrics() {
  registry.gauge_callback("rd2h_engine_free_blocks", "KV blocks free after the last step", [this] {
    std::lock_guard lock(mu);
    return static_cast<double>(stats.free_blocks);
  });
  registry.gauge_callback("rd2h_engine_waiting_for_blocks",
                          "Prompts queued until their blocks are free", [this] {
                            std::lock_guard lock(mu);
                            return static_cast<double>(stats.waiting_for_blocks);
                          });
  if (!prefill) {
    connector::Scheduler* s = scheduler.get();
    registry.counter_callback("rd2h_metaserver_posts_delivered_total",
                              "Rendezvous posts the metaserver answered 2xx",
                              [s] { return static_cast<double>(s->metaserver_stats().delivered); });
    registry.counter_callback("rd2h_metaserver_posts_refused_total",
                              "Rendezvous posts the metaserver answered otherwise",
                              [s] { return static_cast<double>(s->metaserver_stats().refused); });
    registry.counter_callback(
        "rd2h_metaserver_post_retries_total",
        "Rendezvous post attempts that got no answer (each is tried again)",
        [s] { return static_cast<double>(s->metaserver_stats().failed_attempts); });
  }
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

std::optional<std::string> Engine::Impl::refusal() const {
  if (stopping) return "the engine is stopping";
  if (!broken.empty()) return broken;
  if (draining) return "the engine is draining: it takes no new requests";
  return std::nullopt;
}

bool Engine::drain(std::chrono::milliseconds bound) {
  Impl& p = *impl_;
  std::unique_lock lock(p.mu);
  p.draining = true;
  return p.idle_cv.wait_for(lock, bound, [&] { return p.in_flight.empty(); });
}

Engine::~Engine() {
  Impl& p = *impl_;
  {
    std::lock_guard lock(p.mu);
    p.stopping = true;
  }
  p.cv.notify_all();
  p.core.join();  // answers what is pending, so the HTTP handlers return
  p.server->stop();
  p.ranks->stop(std::chrono::seconds(10));
}

std::string Engine::origin() const {
  return "http://" + impl_->config.host + ":" + std::to_string(impl_->http_port);
}
int Engine::kv_base_port() const {
  return impl_->scheduler->base_port();
}
EngineStats Engine::stats() const {
  std::lock_guard lock(impl_->mu);
  return impl_->stats;
}

// What the engine did and recorded (GET /rd2h/report), and its reader.
void Engine::Impl::report(httplib::Response& res) {
  if (trace::enabled()) {
    std::future<void> drained;
    {
      std::lock_guard lock(mu);
      if (!stopping) {
        event_drains.emplace_back();
        drained = event_drains.back().get_future();
      }
    }
    cv.notify_all();
    if (drained.valid() &&
        drained.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
      res.status = 503;
      return res.set_content(R"({"error": {"message": "the engine core is busy", "code": 503}})",
                             "application/json");
    }
  }
  json out;
  {
    std::lock_guard lock(mu);
    out["stats"] = {{"requests", stats.requests},
                    {"steps", stats.steps},
                    {"prefill_chunks", stats.prefill_chunks},
                    {"verified_blocks", stats.verified_blocks},
                    {"failed_requests", stats.failed_requests},
                    {"main_pool_locked", stats.main_pool_locked}};
  }
  out["role"] = prefill ? "prefill" : "decode";
  out["tp"] = config.tp_size;
  out["events"] = to_json(trace::drain());
  out["events_dropped"] = trace::dropped();
  res.set_content(out.dump(), "application/json");
}

Expected<Report> parse_report(std::string_view body) {
  const json j = json::parse(body, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("stats")) {
    return invalid_argument("an engine report must be a JSON object with stats and events");
  }
  Report r;
  try {
    r.role = j.at("role").get<std::string>();
    r.tp_size = j.at("tp").get<int>();
    const json& s = j.at("stats");
    r.stats.requests = s.at("requests").get<uint64_t>();
    r.stats.steps = s.at("steps").get<uint64_t>();
    r.stats.prefill_chunks = s.at("prefill_chunks").get<uint64_t>();
    r.stats.verified_blocks = s.at("verified_blocks").get<uint64_t>();
    r.stats.failed_requests = s.at("failed_requests").get<uint64_t>();
    r.stats.main_pool_locked = s.at("main_pool_locked").get<bool>();
    r.events_dropped = j.value("events_dropped", uint64_t{0});
  } catch (const json::exception& e) {
    return invalid_argument(std::string("engine report: ") + e.what());
  }
  r.events = events_from_json(j.value("events", json::array()));
  return r;
}

}  // namespace rd2h::sim
