#include "control/curve.h"
#include "metaserver/proxy_impl.h"

namespace rd2h::metaserver {

EngineAnswer ask_engine(httplib::Client& c, const std::string& method, const std::string& path,
                        const httplib::Headers& headers, const std::string& body) {
  httplib::Request req;
  req.method = method;
  req.path = path;
  req.headers = headers;
  if (method == "POST") {
    req.body = body;
    req.set_header("Content-Type", "application/json");
  }
  EngineAnswer a;
  req.response_handler = [&](const httplib::Response& r) {
    a.status = r.status;
    return true;
  };
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    if (a.body.size() + n > kMaxEngineAnswerBytes) {
      a.too_long = true;
      return false;
    }
    a.body.append(data, n);
    return true;
  };
  auto r = c.send(req);
  if (a.too_long) {
    a.error = "answered more than " + std::to_string(kMaxEngineAnswerBytes) + " bytes";
  } else if (!r) {
    a.error = "did not answer: " + httplib::to_string(r.error());
  }
  return a;
}

void set_timeouts(httplib::Client& c, std::chrono::milliseconds t) {
  c.set_connection_timeout(std::chrono::seconds(5));
  c.set_read_timeout(t);
  c.set_write_timeout(t);
}

void Proxy::Impl::handle_rendezvous(const httplib::Request& req, httplib::Response& res) {
  auto parsed = http::parse_bounded<ordered_json>(req.body);
  if (!parsed) return http::set_api_error(res, 400, parsed.status().message());
  auto body = std::move(*parsed);
  if (!body.is_object() || !body.contains("request_id") || !body["request_id"].is_string()) {
    return http::set_api_error(res, 400, "a rendezvous is a JSON object with a string request_id");
  }
  // It is kept and copied: bound the recursion.
  if (http::nests_deeper_than(body, http::kMaxBodyNesting)) {
    return http::set_api_error(res, 400,
                               "the rendezvous nests arrays and objects deeper than " +
                                   std::to_string(http::kMaxBodyNesting) + " levels");
  }
  const std::string child = body["request_id"].get<std::string>();
  std::shared_ptr<Parent> parent;
  {
    std::lock_guard lock(mu);
    auto it = by_child.find(child);
    if (it == by_child.end()) {
      ++stats.unknown_rendezvous;
      rendezvous_posts.with({"false"}).inc();
      return http::set_api_error(res, 404, "unknown request id " + child, "request_id");
    }
    ++stats.rendezvous;
    rendezvous_posts.with({"true"}).inc();
    parent = it->second;
  }
  bool complete = false;
  {
    std::lock_guard lock(parent->mu);
    parent->params[child] = body;
    if (!parent->dispatched && parent->params.size() == parent->children.size()) {
      parent->dispatched = true;
      complete = true;
    }
  }
  if (complete) {
    std::lock_guard lock(mu);
    if (stopping) return http::set_api_error(res, 502, "the proxy is stopping");
    dispatchers->run([this, parent] { dispatch_prefill(parent); });
  }
  res.set_content(R"({"status":"ok"})", "application/json");
}

std::string Proxy::Impl::prefill_payload(Parent& parent) const {
  ordered_json body = parent.body;
  body["stream"] = false;
  body.erase("stream_options");
  body["max_tokens"] = 1;
  body["min_tokens"] = 1;
  if (body.contains("max_completion_tokens")) body["max_completion_tokens"] = 1;
  std::lock_guard lock(parent.mu);
  ordered_json params = parent.params[parent.children[0]];
  if (parent.children.size() > 1) {
    ordered_json batch = ordered_json::object();
    for (const auto& c : parent.children) batch[c] = parent.params[c];
    params["batch_kv_transfer_params"] = batch;
  }
  body["kv_transfer_params"] = params;
  return body.dump();
}

void Proxy::Impl::take_out(Pool& pool, size_t i, const std::string& why) {
  if (!pool.down[i].empty()) return;
  pool.down[i] = why;
  ++stats.taken_out;
  taken_out_count.with({pool.role, pool.origins[i]}).inc();
  publish_rotation(pool);
  log::warn("proxy: {} {} is out of rotation: {}", pool.role, pool.origins[i], why);
  if (&pool != &prefills || !pool.any_up()) return;
  // Dispatches waiting on a Prefill that stopped answering (a stalled host) would wait out
  // their deadline: they are cut, and go to another Prefill as any dispatch without an
  // answer does.
  for (auto& [which, client] : dispatch_clients) {
    if (which == i) client->stop();
  }
}

void Proxy::Impl::bring_back(Pool& pool, size_t i) {
  if (pool.down[i].empty()) return;
  pool.down[i].clear();
  ++stats.brought_back;
  publish_rotation(pool);
  log::info("proxy: {} {} answers its health probe again: back in rotation", pool.role,
            pool.origins[i]);
}

std::optional<std::string> Proxy::Impl::probe(const std::string& origin) const {
  httplib::Client c(origin);
  c.set_connection_timeout(config.probe_timeout);
  c.set_read_timeout(config.probe_timeout);
  c.set_write_timeout(config.probe_timeout);
  const EngineAnswer a = ask_engine(c, "GET", "/health", auth);
  if (!a && a.status == 0) return "its health probe " + a.error;
  // An engine without the route (404) still serves; a 5xx says it does not.
  if (a.status >= 500) return "its health probe answered HTTP " + std::to_string(a.status);
  return std::nullopt;
}

void Proxy::Impl::probe_loop() {
  std::unique_lock lock(mu);
  // The first round after one interval: what starts the proxy says it serves before any
  // probe has a word to say.
  idle_cv.wait_for(lock, config.probe_interval, [&] { return stopping; });
  while (!stopping) {
    std::vector<std::pair<Pool*, size_t>> targets;
    std::vector<std::string> origins;
    for (Pool* pool : {&prefills, &decodes}) {
      for (size_t i : pool->members()) {
        targets.emplace_back(pool, i);
        origins.push_back(pool->origins[i]);
      }
    }
    lock.unlock();
    std::vector<std::optional<std::string>> verdicts;
    for (const auto& origin : origins) verdicts.push_back(probe(origin));
    lock.lock();
    if (stopping) break;
    for (size_t k = 0; k < targets.size(); ++k) {
      auto [pool, i] = targets[k];
      if (pool->removed[i]) continue;  // removed while it was probed
      if (verdicts[k]) {
        take_out(*pool, i, *verdicts[k]);
      } else {
        bring_back(*pool, i);
      }
    }
    idle_cv.wait_for(lock, config.probe_interval, [&] { return stopping; });
  }
}

Proxy::Impl::PrefillAttempt Proxy::Impl::attempt_prefill(const std::shared_ptr<Parent>& parent,
                                                         const std::string& payload) {
  size_t which;
  std::string origin;
  std::shared_ptr<httplib::Client> client;
  bool stopped;
  {
    std::lock_guard lock(mu);
    ++stats.prefill_dispatches;
    const auto taken = prefills.take();
    if (!taken) {
      PrefillAttempt none;
      none.why = "the proxy has no Prefill instance";
      return none;
    }
    which = *taken;
    origin = prefills.origins[which];
    dispatches.with({origin}).inc();
    upstream_in_flight.with({"prefill", origin}).add(1);
    client = std::make_shared<httplib::Client>(origin);
    set_timeouts(*client, config.upstream_timeout);
    dispatch_clients.emplace_back(which, client);  // the destructor stops it while in flight
    stopped = stopping;
  }
  {
    std::lock_guard lock(parent->mu);
    parent->prefill = client;  // a failure of the request closes it too
    stopped = stopped || !parent->failure.empty() || parent->prefill_abandoned;
  }
  // Client::stop() only cuts a request in flight: one not started must not start.
  EngineAnswer r;
  r.error = "did not answer: the request was given up";
  if (!stopped) {
    r = ask_engine(*client, "POST", parent->path, engine_headers(*parent), payload);
  }
  PrefillAttempt a;
  a.given_up = stopped || parent->prefill_given_up();  // given up meanwhile
  if (a.given_up) {
    a.why = "the request was given up before Prefill";
  } else if (!r) {
    a.why = "Prefill " + origin + " " + r.error;
    a.retry = !r.too_long;  // no answer: another try; an answer too long: none
  } else if (r.status != 200) {
    a.why = "Prefill " + origin + " answered HTTP " + std::to_string(r.status) + ": " +
            http::error_text(r.body);
    // A 4xx about the body (not the proxy's own token) is the client's to see as it is.
    const auto e = ordered_json::parse(r.body, nullptr, false);
    if (r.status >= 400 && r.status < 500 && r.status != 401 && r.status != 403 && e.is_object() &&
        e.contains("error") && e["error"].is_object()) {
      a.status = r.status;
      a.refusal = r.body;
    }
    a.retry = r.status >= 500;
  }
  bool abandoned = false;
  {
    std::lock_guard lock(parent->mu);
    abandoned = a.given_up && parent->prefill_abandoned;
  }
  std::lock_guard lock(mu);
  if (abandoned) {
    ++stats.prefill_abandoned;
    abandoned_count.with().inc();
  }
  --prefills.load[which];
  upstream_in_flight.with({"prefill", origin}).add(-1);
  std::erase_if(dispatch_clients, [&](const auto& d) { return d.second == client; });
  if (!a.why.empty() && !a.given_up) {
    ++stats.prefill_failures;
    dispatch_failures.with({origin}).inc();
    // No answer, or a 5xx: the instance leaves the rotation, so the next attempt (and every
    // other request) goes elsewhere until its health probe answers again.
    if (a.retry) take_out(prefills, which, a.why);
  }
  return a;
}

void Proxy::Impl::dispatch_prefill(std::shared_ptr<Parent> parent) {
  const std::string payload = prefill_payload(*parent);
  const int attempts = std::max(1, config.prefill_attempts);
  PrefillAttempt a;
  for (int attempt = 1;; ++attempt) {
    a = attempt_prefill(parent, payload);
    if (!a.retry || attempt >= attempts) break;
    // Exponential backoff before the next attempt, cut short if the proxy stops.
    const auto backoff = std::min<std::chrono::milliseconds>(
        config.prefill_retry_backoff * (1 << std::min(attempt - 1, 10)), std::chrono::seconds(5));
    log::info("proxy: request {}: {}; attempt {} of {} in {} ms", parent->id, a.why, attempt + 1,
              attempts, static_cast<long long>(backoff.count()));
    std::unique_lock lock(mu);
    if (idle_cv.wait_for(lock, backoff, [&] { return stopping; })) break;
  }
  if (!a.why.empty() && !a.given_up) {
    log::warn("proxy: request {}: {}", parent->id, a.why);
    parent->fail(a.status, a.refusal.empty() ? http::api_error_json(502, a.why) : a.refusal);
  }
}

void Proxy::Impl::handle_health(httplib::Response& res) {
  Pool pools[2];
  {
    std::lock_guard lock(mu);
    if (stopping || draining) return http::set_api_error(res, 503, "the proxy is shutting down");
    pools[0] = prefills;
    pools[1] = decodes;
  }
  if (config.probe_interval.count() == 0) {
    // No prober: each engine is asked now.
    for (Pool& pool : pools) {
      for (size_t i : pool.members()) pool.down[i] = probe(pool.origins[i]).value_or("");
    }
  }
  // Serving while one of each role is in rotation; what is out is named.
  ordered_json out = {{"status", "ok"}};
  std::vector<std::string> down;
  bool serving = true;
  for (const Pool& pool : pools) {
    ordered_json instances = ordered_json::array();
    for (size_t i : pool.members()) {
      ordered_json one = {{"url", pool.origins[i]}, {"healthy", pool.down[i].empty()}};
      if (!pool.down[i].empty()) {
        one["reason"] = pool.down[i];
        down.push_back(pool.role + " " + pool.origins[i]);
      }
      instances.push_back(std::move(one));
    }
    out[pool.role] = std::move(instances);
    serving = serving && pool.any_up();
  }
  if (!serving && down.empty()) down.emplace_back("no instance");
  if (!down.empty()) {
    std::string names;
    for (const auto& d : down) names += (names.empty() ? "" : ", ") + d;
    out["status"] = serving ? "degraded" : "unhealthy";
    out["error"] = {{"message", "out of rotation: " + names}, {"type", "server_error"}};
  }
  if (!serving) res.status = 503;
  res.set_content(out.dump(), "application/json");
}

bool Proxy::Impl::admin_allowed(httplib::Response& res) const {
  // With a token, the route checked it already. Without one, only a proxy that nobody
  // off this host can reach lets its pools be changed.
  if (!config.token.empty() || control::is_loopback_host(config.host)) return true;
  http::set_api_error(res, 403,
                      "the admin routes need the proxy's token (--token-file) on a proxy bound "
                      "to a non-loopback address");
  return false;
}

ordered_json Proxy::Impl::instances_json() const {
  ordered_json out = ordered_json::object();
  for (const Pool* pool : {&prefills, &decodes}) {
    ordered_json list = ordered_json::array();
    for (size_t i = 0; i < pool->origins.size(); ++i) {
      if (pool->removed[i] && pool->load[i] == 0) continue;  // gone
      const char* state = pool->removed[i]        ? "leaving"
                          : pool->down[i].empty() ? "serving"
                                                  : "out of rotation";
      ordered_json one = {
          {"url", pool->origins[i]}, {"state", state}, {"in_flight", pool->load[i]}};
      if (!pool->removed[i] && !pool->down[i].empty()) one["reason"] = pool->down[i];
      list.push_back(std::move(one));
    }
    out[pool->role] = std::move(list);
  }
  return out;
}

void Proxy::Impl::set_instances(Pool& pool, const std::vector<std::string>& wanted,
                                const std::vector<std::optional<std::string>>& verdicts) {
  for (size_t i : pool.members()) {
    if (std::find(wanted.begin(), wanted.end(), pool.origins[i]) != wanted.end()) continue;
    pool.removed[i] = true;
    log::info("proxy: {} {} leaves the pool ({} requests in flight finish there)", pool.role,
              pool.origins[i], pool.load[i]);
  }
  for (size_t k = 0; k < wanted.size(); ++k) {
    const size_t before = pool.members().size();
    const size_t i = pool.add(wanted[k]);
    if (pool.members().size() == before) continue;  // one of the pool already
    pool.down[i] = verdicts[k].value_or("");
    log::info("proxy: {} {} joins the pool{}", pool.role, wanted[k],
              verdicts[k] ? " out of rotation: " + *verdicts[k] : "");
  }
  publish_rotation(pool);
}

void Proxy::Impl::handle_instances(const httplib::Request& req, httplib::Response& res) {
  if (!admin_allowed(res)) return;
  if (req.method == "GET") {
    std::lock_guard lock(mu);
    return res.set_content(instances_json().dump(), "application/json");
  }
  auto parsed = http::parse_bounded<ordered_json>(req.body);
  if (!parsed) return http::set_api_error(res, 400, parsed.status().message());
  const auto body = std::move(*parsed);
  if (!body.is_object()) {
    return http::set_api_error(res, 400, "the body is not a JSON object");
  }
  // Each list given is checked whole before anything changes.
  std::map<std::string, std::vector<std::string>> lists;
  for (const auto& [key, value] : body.items()) {
    if (key != "prefill" && key != "decode") {
      return http::set_api_error(res, 400,
                                 "unknown key '" + key + "': the keys are prefill and decode", key);
    }
    if (!value.is_array() || value.empty() || value.size() > kMaxInstances) {
      return http::set_api_error(
          res, 400,
          key + " must be a list of 1 to " + std::to_string(kMaxInstances) + " engine origins",
          key);
    }
    auto& list = lists[key];
    for (const auto& origin : value) {
      const std::string text = origin.is_string() ? origin.get<std::string>() : origin.dump();
      if (!origin.is_string()) {
        return http::set_api_error(res, 400, key + ": " + text + " is not a string", key);
      }
      if (const auto u = parse_origin(text); !u) {
        return http::set_api_error(res, 400, key + ": " + u.status().message(), key);
      }
      if (std::find(list.begin(), list.end(), origin.get<std::string>()) != list.end()) {
        return http::set_api_error(
            res, 400, key + ": " + origin.get<std::string>() + " is listed twice", key);
      }
      list.push_back(origin.get<std::string>());
    }
  }
  // Instances that join are probed first (not under the lock): one that does not answer
  // joins out of rotation, and its probes bring it in.
  std::map<std::string, std::vector<std::optional<std::string>>> verdicts;
  for (const auto& [key, list] : lists) {
    for (const auto& origin : list) {
      verdicts[key].push_back(config.probe_interval.count() > 0 ? probe(origin) : std::nullopt);
    }
  }
  std::lock_guard lock(mu);
  if (stopping || draining) return http::set_api_error(res, 503, "the proxy is shutting down");
  for (const auto& [key, list] : lists) {
    set_instances(key == "prefill" ? prefills : decodes, list, verdicts[key]);
  }
  res.set_content(instances_json().dump(), "application/json");
}

std::vector<std::string> Proxy::Impl::member_origins(const Pool& pool) const {
  std::lock_guard lock(mu);
  std::vector<std::string> out;
  for (size_t i : pool.members()) out.push_back(pool.origins[i]);
  return out;
}

void Proxy::Impl::handle_reset_prefix_cache(const httplib::Request& req, httplib::Response& res) {
  // Its query (vLLM's reset_running_requests, reset_external) goes to every engine.
  const std::string path = httplib::append_query_params("/reset_prefix_cache", req.params);
  std::vector<std::string> failed;
  for (const Pool* pool : {&prefills, &decodes}) {
    for (const auto& origin : member_origins(*pool)) {
      httplib::Client c(origin);
      set_timeouts(c, std::chrono::seconds(10));
      const auto r = ask_engine(c, "POST", path, auth);
      if (!r || r.status != 200) {
        failed.push_back(origin +
                         (r ? " (HTTP " + std::to_string(r.status) + ")" : " (" + r.error + ")"));
      }
    }
  }
  if (failed.empty()) return res.set_content(R"({"status":"ok"})", "application/json");
  std::string names;
  for (const auto& f : failed) names += (names.empty() ? "" : ", ") + f;
  http::set_api_error(res, 500, "the prefix cache was not reset on " + names);
}

void Proxy::Impl::handle_models(httplib::Response& res) {
  std::string last = "no Decode instance";
  for (const auto& origin : member_origins(decodes)) {
    httplib::Client c(origin);
    set_timeouts(c, std::chrono::seconds(5));
    const auto r = ask_engine(c, "GET", "/v1/models", auth);
    if (r && r.status == 200) return res.set_content(r.body, "application/json");
    last = "Decode " + origin + (r ? " answered HTTP " + std::to_string(r.status) : " " + r.error);
  }
  http::set_api_error(res, 502, last);
}

}  // namespace rd2h::metaserver
