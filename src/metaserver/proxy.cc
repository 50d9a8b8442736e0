#include "rd2h/metaserver/proxy.h"

#include <httplib.h>
#include <sodium.h>

#include <cstdio>
#include <list>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "metaserver/client.h"
#include "metaserver/http_server.h"
#include "metaserver/openai_body.h"

namespace rd2h::metaserver {

using nlohmann::ordered_json;

namespace {

// A random (version 4) UUID from the operating system's cryptographic source: request ids
// name transfers, so they must not be predictable.
std::string uuid4() {
  uint64_t a, b;
  randombytes_buf(&a, sizeof(a));
  randombytes_buf(&b, sizeof(b));
  char out[37];
  std::snprintf(out, sizeof(out), "%08x-%04x-4%03x-%04x-%012llx", static_cast<unsigned>(a >> 32),
                static_cast<unsigned>((a >> 16) & 0xffff), static_cast<unsigned>(a & 0xfff),
                static_cast<unsigned>(0x8000 | ((b >> 48) & 0x3fff)),
                static_cast<unsigned long long>(b & 0xffffffffffffULL));
  return out;
}

std::string error_json(const std::string& message, int code) {
  ordered_json j;
  j["error"] = {{"message", message}, {"code", code}};
  return j.dump();
}

void set_timeouts(httplib::Client& c, std::chrono::milliseconds t) {
  c.set_connection_timeout(std::chrono::seconds(5));
  c.set_read_timeout(t);
  c.set_write_timeout(t);
}

}  // namespace

// One client request and the rendezvous of its children.
struct Parent {
  std::string id;
  std::string path;  // /v1/completions or /v1/chat/completions
  ordered_json body;
  std::vector<std::string> children;
  std::map<std::string, ordered_json> params;  // child -> Decode's rendezvous
  size_t decode = 0;
  std::mutex mu;
  bool dispatched = false;
  std::string failure;                        // set when the Prefill dispatch failed
  std::shared_ptr<httplib::Client> upstream;  // the Decode request, to close on failure

  void fail(const std::string& why) {
    std::shared_ptr<httplib::Client> up;
    {
      std::lock_guard lock(mu);
      if (failure.empty()) failure = why;
      up = upstream;
    }
    if (up) up->stop();
  }
  std::string failed() {
    std::lock_guard lock(mu);
    return failure;
  }
};

struct Proxy::Impl {
  ProxyConfig config;
  std::unique_ptr<HttpServer> api, rendezvous;
  int api_port = 0, rendezvous_port = 0;
  httplib::Headers auth;  // what the engines are sent: the bearer token, if any

  mutable std::mutex mu;
  std::map<std::string, std::shared_ptr<Parent>> by_child;
  std::vector<int> decode_load, prefill_load;
  size_t decode_cursor = 0, prefill_cursor = 0;
  ProxyStats stats;
  bool stopping = false;
  struct Dispatcher {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::list<Dispatcher> dispatchers;
  std::vector<std::shared_ptr<httplib::Client>> dispatch_clients;

  // The instance with the fewest requests in flight; ties go round, so an idle fleet is
  // used evenly. Caller holds mu.
  size_t least_loaded(std::vector<int>& load, size_t& cursor) {
    size_t best = cursor % load.size();
    for (size_t k = 1; k < load.size(); ++k) {
      const size_t i = (cursor + k) % load.size();
      if (load[i] < load[best]) best = i;
    }
    cursor = best + 1;
    ++load[best];
    return best;
  }

  std::string metaserver_url() const {
    return "http://" + config.host + ":" + std::to_string(rendezvous_port) + "/v1/metaserver";
  }

  void handle_client(const httplib::Request& req, httplib::Response& res, bool chat);
  void handle_rendezvous(const httplib::Request& req, httplib::Response& res);
  void dispatch_prefill(std::shared_ptr<Parent> parent);
  void finish(const std::shared_ptr<Parent>& parent);
};

void Proxy::Impl::handle_client(const httplib::Request& req, httplib::Response& res, bool chat) {
  auto body = ordered_json::parse(req.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object()) {
    res.status = 400;
    res.set_content(error_json("the request body is not a JSON object", 400), "application/json");
    return;
  }
  const auto prompts = check_openai_body(
      body, chat, PromptLimits{config.max_prompts, config.max_prompt_tokens});
  if (!prompts) {
    res.status = 400;
    res.set_content(error_json(prompts.status().message(), 400), "application/json");
    return;
  }
  auto parent = std::make_shared<Parent>();
  parent->id = uuid4();
  parent->path = chat ? "/v1/chat/completions" : "/v1/completions";
  if (chat) {
    parent->children.push_back("chatcmpl-" + parent->id);
  } else {
    for (size_t i = 0; i < *prompts; ++i) {
      parent->children.push_back("cmpl-" + parent->id + "-" + std::to_string(i));
    }
  }
  const auto stream_field = body.find("stream");
  const bool stream = stream_field != body.end() && stream_field->is_boolean() &&
                      stream_field->get<bool>();
  parent->body = body;
  {
    std::lock_guard lock(mu);
    if (config.decode.empty() || config.prefill.empty()) {
      res.status = 503;
      res.set_content(error_json("the proxy has no Prefill or no Decode instance", 503),
                      "application/json");
      return;
    }
    ++stats.requests;
    parent->decode = least_loaded(decode_load, decode_cursor);
    for (const auto& c : parent->children) by_child[c] = parent;
  }
  body["kv_transfer_params"] = {
      {"do_remote_decode", false}, {"do_remote_prefill", true}, {"metaserver", metaserver_url()}};
  auto upstream = std::make_shared<httplib::Client>(config.decode[parent->decode]);
  set_timeouts(*upstream, config.upstream_timeout);
  {
    std::lock_guard lock(parent->mu);
    parent->upstream = upstream;  // from here on a failure closes the Decode request
  }
  httplib::Headers headers = auth;
  headers.emplace("X-Request-Id", parent->id);
  const std::string payload = body.dump();

  if (!stream) {
    httplib::Result r{nullptr, httplib::Error::Canceled};
    if (parent->failed().empty()) {
      r = upstream->Post(parent->path, headers, payload, "application/json");
    }
    const std::string why = parent->failed();
    if (!why.empty()) {
      res.status = 502;
      res.set_content(error_json(why, 502), "application/json");
    } else if (!r) {
      res.status = 502;
      res.set_content(error_json("Decode " + config.decode[parent->decode] +
                                     " did not answer: " + httplib::to_string(r.error()),
                                 502),
                      "application/json");
    } else {
      res.status = r->status;
      res.set_content(r->body, r->get_header_value("Content-Type").empty()
                                   ? "application/json"
                                   : r->get_header_value("Content-Type"));
    }
    finish(parent);
    return;
  }
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, parent, upstream, headers, payload](size_t, httplib::DataSink& sink) {
        httplib::Request up;
        up.method = "POST";
        up.path = parent->path;
        up.headers = headers;
        up.body = payload;
        up.set_header("Content-Type", "application/json");
        bool client_gone = false;
        up.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
          if (!sink.write(data, len)) client_gone = true;
          return !client_gone;
        };
        httplib::Result r{nullptr, httplib::Error::Canceled};
        if (parent->failed().empty()) r = upstream->send(up);
        std::string why = parent->failed();
        if (why.empty() && !r && !client_gone) {
          why = "Decode " + config.decode[parent->decode] +
                " did not answer: " + httplib::to_string(r.error());
        }
        if (!why.empty() && !client_gone) {
          const std::string event = "data: " + error_json(why, 502) + "\n\n";
          sink.write(event.data(), event.size());
        }
        sink.done();
        return true;
      },
      [this, parent](bool) { finish(parent); });
}

void Proxy::Impl::finish(const std::shared_ptr<Parent>& parent) {
  std::lock_guard lock(mu);
  for (const auto& c : parent->children) {
    auto it = by_child.find(c);
    if (it != by_child.end() && it->second == parent) by_child.erase(it);
  }
  --decode_load[parent->decode];
}

void Proxy::Impl::handle_rendezvous(const httplib::Request& req, httplib::Response& res) {
  auto body = ordered_json::parse(req.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object() || !body.contains("request_id") ||
      !body["request_id"].is_string()) {
    res.status = 400;
    res.set_content(error_json("a rendezvous is a JSON object with a string request_id", 400),
                    "application/json");
    return;
  }
  if (nests_deeper_than(body, kMaxBodyNesting)) {  // it is kept and copied: bound the recursion
    res.status = 400;
    res.set_content(error_json("the rendezvous nests arrays and objects deeper than " +
                                   std::to_string(kMaxBodyNesting) + " levels",
                               400),
                    "application/json");
    return;
  }
  const std::string child = body["request_id"].get<std::string>();
  std::shared_ptr<Parent> parent;
  {
    std::lock_guard lock(mu);
    auto it = by_child.find(child);
    if (it == by_child.end()) {
      ++stats.unknown_rendezvous;
      res.status = 404;
      res.set_content(error_json("unknown request id " + child, 404), "application/json");
      return;
    }
    ++stats.rendezvous;
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
    if (stopping) {
      res.status = 502;
      res.set_content(error_json("the proxy is stopping", 502), "application/json");
      return;
    }
    // Reap the dispatchers that ended, so a long-lived proxy does not collect threads.
    for (auto it = dispatchers.begin(); it != dispatchers.end();) {
      if (it->done->load()) {
        it->thread.join();
        it = dispatchers.erase(it);
      } else {
        ++it;
      }
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    dispatchers.push_back({std::thread([this, parent, done] {
                             dispatch_prefill(parent);
                             done->store(true);
                           }),
                           done});
  }
  res.set_content(R"({"status":"ok"})", "application/json");
}

void Proxy::Impl::dispatch_prefill(std::shared_ptr<Parent> parent) {
  ordered_json body = parent->body;
  body["stream"] = false;
  body.erase("stream_options");
  body["max_tokens"] = 1;
  body["min_tokens"] = 1;
  {
    std::lock_guard lock(parent->mu);
    ordered_json params = parent->params[parent->children[0]];
    if (parent->children.size() > 1) {
      ordered_json batch = ordered_json::object();
      for (const auto& c : parent->children) batch[c] = parent->params[c];
      params["batch_kv_transfer_params"] = batch;
    }
    body["kv_transfer_params"] = params;
  }
  size_t which;
  std::shared_ptr<httplib::Client> client;
  bool stopped;
  {
    std::lock_guard lock(mu);
    ++stats.prefill_dispatches;
    which = least_loaded(prefill_load, prefill_cursor);
    client = std::make_shared<httplib::Client>(config.prefill[which]);
    set_timeouts(*client, config.upstream_timeout);
    dispatch_clients.push_back(client);  // the destructor stops it while in flight
    stopped = stopping;
  }
  // Client::stop() only cuts a request in flight: one not started must not start.
  httplib::Result r{nullptr, httplib::Error::Canceled};
  if (!stopped) {
    httplib::Headers headers = auth;
    headers.emplace("X-Request-Id", parent->id);
    r = client->Post(parent->path, headers, body.dump(), "application/json");
  }
  std::string why;
  if (stopped) {
    why = "the proxy is stopping";
  } else if (!r) {
    why = "Prefill " + config.prefill[which] + " did not answer: " + httplib::to_string(r.error());
  } else if (r->status != 200) {
    why = "Prefill " + config.prefill[which] + " answered HTTP " + std::to_string(r->status) +
          ": " + r->body.substr(0, 200);
  }
  {
    std::lock_guard lock(mu);
    --prefill_load[which];
    for (auto it = dispatch_clients.begin(); it != dispatch_clients.end(); ++it) {
      if (*it == client) {
        dispatch_clients.erase(it);
        break;
      }
    }
    if (!why.empty()) ++stats.prefill_failures;
  }
  if (!why.empty()) {
    std::fprintf(stderr, "rd2h proxy: request %s: %s\n", parent->id.c_str(), why.c_str());
    parent->fail(why);
  }
}

Expected<std::unique_ptr<Proxy>> Proxy::start(ProxyConfig config) {
  for (const auto* list : {&config.prefill, &config.decode}) {
    for (const auto& origin : *list) {
      auto u = parse_url(origin);
      if (!u || u->path != "/") {
        return invalid_argument("engine address '" + origin + "' is not http://host:port");
      }
    }
  }
  if (sodium_init() < 0) return internal_error("libsodium could not be initialised");
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  impl->decode_load.assign(config.decode.size(), 0);
  impl->prefill_load.assign(config.prefill.size(), 0);
  if (!config.token.empty()) impl->auth.emplace("Authorization", bearer(config.token));
  Impl* p = impl.get();
  HttpServerConfig api;
  api.host = config.host;
  api.port = config.port;
  api.name = "client API";
  api.max_body_bytes = config.max_body_bytes;
  api.max_connections = config.max_concurrent == 0 ? 1 : config.max_concurrent;
  api.token = config.token;
  HttpServerConfig meta = api;
  meta.port = config.metaserver_port;
  meta.name = "metaserver";
  meta.max_connections = HttpServerConfig{}.max_connections;
  p->api = std::make_unique<HttpServer>(api);
  p->rendezvous = std::make_unique<HttpServer>(meta);
  for (HttpServer* s : {p->api.get(), p->rendezvous.get()}) {
    s->post("/v1/metaserver", HttpServer::Auth::kToken,
            [p](const httplib::Request& req, httplib::Response& res) {
              p->handle_rendezvous(req, res);
            });
  }
  // The client-facing routes take no engine token.
  p->api->post("/v1/completions", HttpServer::Auth::kNone,
               [p](const httplib::Request& req, httplib::Response& res) {
                 p->handle_client(req, res, false);
               });
  p->api->post("/v1/chat/completions", HttpServer::Auth::kNone,
               [p](const httplib::Request& req, httplib::Response& res) {
                 p->handle_client(req, res, true);
               });
  RD2H_RETURN_IF_ERROR(p->api->start());
  RD2H_RETURN_IF_ERROR(p->rendezvous->start());
  p->api_port = p->api->port();
  p->rendezvous_port = p->rendezvous->port();
  return std::unique_ptr<Proxy>(new Proxy(std::move(impl)));
}

Proxy::Proxy(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Proxy::~Proxy() {
  Impl& p = *impl_;
  {
    std::lock_guard lock(p.mu);
    p.stopping = true;
    for (auto& c : p.dispatch_clients) c->stop();
    for (auto& [child, parent] : p.by_child) parent->fail("the proxy is stopping");
  }
  p.api->stop();
  p.rendezvous->stop();
  std::list<Impl::Dispatcher> dispatchers;
  {
    std::lock_guard lock(p.mu);
    dispatchers.swap(p.dispatchers);
  }
  for (auto& d : dispatchers) d.thread.join();
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
