#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include "rd2h/common/trace.h"
#include "sim/demo_parts.h"

namespace rd2h::sim::demo {

using nlohmann::json;

uint64_t demo_blocks(uint64_t tokens, const DemoOptions& o) {
  return (tokens + o.output_tokens + o.block_size - 1) / o.block_size;
}

std::vector<Request> workload(const DemoOptions& o) {
  std::mt19937_64 rng(o.seed);
  std::uniform_real_distribution<double> unit(0, 1);
  std::uniform_int_distribution<int64_t> token(1, 50000);
  auto length = [&](uint32_t i, uint32_t k) -> uint64_t {
    // The longest and the shortest prompt always occur; the rest are log-uniform between.
    if (i == 0 && k == 0) return o.max_tokens;
    if (i == 1 && k == 0) return o.min_tokens;
    const double lo = std::log(static_cast<double>(o.min_tokens));
    const double hi = std::log(static_cast<double>(o.max_tokens));
    return static_cast<uint64_t>(std::exp(lo + (hi - lo) * unit(rng)));
  };
  std::vector<Request> out;
  for (uint32_t i = 0; i < o.requests; ++i) {
    Request r;
    r.id = "demo-" + std::to_string(o.seed) + "-" + std::to_string(i);
    r.list = i > 1 && unit(rng) < o.prompt_list_share;
    const uint32_t n = r.list ? std::max(2u, o.prompt_list_size) : 1;
    // Decode holds a list's prompts at once: together they fit its pool (it refuses a list
    // that never could), so a later prompt is cut short where the earlier ones took room.
    uint64_t room = o.num_blocks;
    for (uint32_t k = 0; k < n; ++k) {
      uint64_t tokens = std::max<uint64_t>(1, length(i, k));
      if (r.list) {
        const uint64_t kept = (n - 1 - k) * demo_blocks(o.min_tokens, o);  // for the rest
        tokens = std::min(tokens, (room - kept) * o.block_size - o.output_tokens);
        room -= demo_blocks(tokens, o);
      }
      std::vector<int64_t> p(tokens);
      for (auto& t : p) t = token(rng);
      r.prompts.push_back(std::move(p));
    }
    out.push_back(std::move(r));
  }
  return out;
}

namespace {

// Decode's verdict in a finished stream: the verified block count of its last event, or the
// error an event carried (or why there is neither).
Expected<uint64_t> verified_blocks(const std::string& received) {
  std::optional<uint64_t> verified;
  size_t pos = 0;
  while ((pos = received.find("data: ", pos)) != std::string::npos) {
    const size_t end = received.find("\n\n", pos);
    const std::string data =
        received.substr(pos + 6, end == std::string::npos ? end : end - pos - 6);
    pos = end == std::string::npos ? received.size() : end;
    if (data == "[DONE]") continue;
    const json event = json::parse(data, nullptr, false);
    if (event.is_discarded()) continue;
    if (event.contains("error")) {
      return internal_error(event["error"].value("message", event["error"].dump()));
    }
    if (event.contains("rd2h")) verified = event["rd2h"].value("verified_blocks", uint64_t{0});
  }
  if (!verified) {
    return internal_error("the stream ended without Decode's verification: " +
                          received.substr(0, 200));
  }
  return *verified;
}

// Posts the request's body, streaming; what came back, or why nothing did (the record has
// its times).
Expected<std::string> post_streaming(const std::string& proxy, const Request& r,
                                     const DemoOptions& o, Watch& watch, ClientRecord& rec) {
  json body = {{"model", "rd2h-sim"}, {"max_tokens", o.output_tokens}, {"stream", true}};
  body["prompt"] = r.list ? json(r.prompts) : json(r.prompts.front());
  httplib::Client client(proxy);
  client.set_connection_timeout(10);
  client.set_read_timeout(static_cast<time_t>(o.timeout_s));
  if (!watch.add(&client)) return unreachable(watch.death());
  std::string received;
  rec.start_us = trace::now_us();
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.headers = {{"X-Request-Id", r.id}};
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    if (rec.first_byte_us == 0) rec.first_byte_us = trace::now_us();
    received.append(data, n);
    return true;
  };
  auto res = client.send(req);
  rec.end_us = trace::now_us();
  watch.remove(&client);
  if (const std::string death = watch.death(); !death.empty() && (!res || res->status != 200)) {
    return unreachable(death);
  }
  if (!res) return unreachable("no answer from the proxy: " + httplib::to_string(res.error()));
  if (res->status != 200) {
    return internal_error("HTTP " + std::to_string(res->status) + ": " + received.substr(0, 500));
  }
  if (const json whole = json::parse(received, nullptr, false);
      whole.is_object() && whole.contains("error")) {
    return internal_error(whole["error"].value("message", whole["error"].dump()));
  }
  return received;
}

}  // namespace

ClientRecord send(const std::string& proxy, const Request& r, const DemoOptions& o, Watch& watch) {
  ClientRecord rec;
  rec.id = r.id;
  rec.prompts = r.prompts.size();
  uint64_t blocks = 0;
  for (const auto& p : r.prompts) {
    rec.tokens += p.size();
    blocks += (p.size() + o.block_size - 1) / o.block_size;
  }
  const uint64_t expected = blocks * static_cast<uint64_t>(o.layers);
  auto received = post_streaming(proxy, r, o, watch, rec);
  if (!received) {
    rec.error = received.status().message();
    return rec;
  }
  auto verified = verified_blocks(*received);
  if (!verified) {
    rec.error = verified.status().message();
  } else if (*verified != expected) {
    rec.error = "Decode verified " + std::to_string(*verified) + " of " + std::to_string(expected) +
                " block-layers";
  } else {
    rec.ok = true;
  }
  return rec;
}

}  // namespace rd2h::sim::demo
