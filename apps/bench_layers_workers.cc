// rd2h bench layers, its workers: a Prefill and a Decode worker over shared memory with the step
// they run, the layers they publish and read, and where each layer's round trip goes.
#include "bench_layers_workers.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>

#include "rd2h/common/trace.h"

namespace rd2h::tools::bench_layers {

namespace {

using Clock = std::chrono::steady_clock;

std::shared_ptr<transfer::TransferEngine> make_engine(transfer::Role role, uint32_t timeout_ms) {
  transfer::EngineConfig cfg;
  cfg.role = role;
  cfg.transport = transfer::Transport::kShm;
  cfg.read_timeout = std::chrono::milliseconds(timeout_ms);
  cfg.listen_host = "127.0.0.1";
  auto e = transfer::create_ucx_engine(cfg);
  if (!e) {
    std::fprintf(stderr, "rd2h bench layers: %s\n", e.status().to_string().c_str());
    return nullptr;
  }
  return std::shared_ptr<transfer::TransferEngine>(std::move(*e));
}

// Every layer name of the model aliases one physical slot of `blocks` blocks per tensor, or
// (`o.distinct_layers`) has its own.
Expected<std::vector<layout::CacheLayer>> slot_layers(transfer::TransferEngine& engine,
                                                      const BenchLayersOptions& o, uint32_t names,
                                                      bool fill) {
  std::vector<uint64_t> bytes = o.main_bytes;
  if (o.indexer_bytes) bytes.push_back(o.indexer_bytes);
  uint64_t per_layer = 0;
  for (auto b : bytes) per_layer += b * o.blocks;
  const uint64_t total = per_layer * (o.distinct_layers ? names : 1);
  RD2H_TRY(region, engine.allocate_memory(total));
  std::memset(region.addr, fill ? 0x5a : 0, total);
  std::vector<layout::CacheLayer> layers;
  for (uint32_t l = 0; l < names; ++l) {
    layout::CacheLayer layer{"model.layers." + std::to_string(l) + ".self_attn",
                             {},
                             o.main_bytes.size(),
                             o.indexer_bytes != 0};
    uint64_t addr =
        reinterpret_cast<uint64_t>(region.addr) + (o.distinct_layers ? l * per_layer : 0);
    for (size_t t = 0; t < bytes.size(); ++t) {
      layer.tensors.push_back(
          {addr, bytes[t] * o.blocks, bytes[t], 1, t < o.main_bytes.size() ? 0u : 1u});
      addr += bytes[t] * o.blocks;
    }
    layers.push_back(std::move(layer));
  }
  return layers;
}

Expected<std::unique_ptr<Setup>> make_setup(const BenchLayersOptions& o, uint32_t requests,
                                            bool link) {
  auto p_engine = make_engine(transfer::Role::kPrefill, o.timeout_ms);
  auto d_engine = make_engine(transfer::Role::kDecode, o.timeout_ms);
  if (!p_engine || !d_engine) return internal_error("no transfer engine");
  RD2H_TRY(p_layers, slot_layers(*p_engine, o, kModelLayers, true));
  RD2H_TRY(d_layers, slot_layers(*d_engine, o, kModelLayers, false));

  auto setup = std::make_unique<Setup>();
  setup->requests = requests;
  setup->link = link;
  decode::WorkerConfig dc;
  dc.register_memory = false;
  // Prefill and Decode each with their own ZeroMQ context, as in two processes.
  RD2H_TRY(decode, decode::Worker::create(dc, d_engine, control::Context::create(), d_layers));
  setup->decode = std::move(decode);
  prefill::WorkerConfig pc;
  pc.register_memory = false;
  pc.send_timeout = std::chrono::milliseconds(o.timeout_ms);
  pc.sender.control_link = link;
  RD2H_TRY(prefill, prefill::Worker::create(pc, p_engine, control::Context::create(), p_layers));
  setup->prefill = std::move(prefill);
  const std::string url = setup->decode->url();
  const int port = std::stoi(url.substr(url.rfind(':') + 1));

  std::vector<prefill::SendRequest> step;
  const uint32_t per = o.blocks / requests;
  for (uint32_t r = 0; r < requests; ++r) {
    prefill::SendRequest s;
    s.ext_id = "bench-" + std::to_string(r);
    s.d_host = "127.0.0.1";
    s.d_base_port = port;
    for (uint32_t b = r * per; b < (r + 1) * per; ++b) s.main_block_ids.push_back(b);
    s.indexer_block_ids = s.main_block_ids;  // Decode's destinations mirror them
    RD2H_RETURN_IF_ERROR(
        setup->decode->add_request(s.ext_id, s.ext_id, s.main_block_ids, s.indexer_block_ids));
    step.push_back(std::move(s));
  }
  RD2H_RETURN_IF_ERROR(setup->prefill->bind_step(step));
  uint64_t per_block = o.indexer_bytes;
  for (auto b : o.main_bytes) per_block += b;
  setup->layer_bytes = per_block * per * requests;
  return setup;
}

}  // namespace

Status run_layers(Setup& s, uint32_t count, bool record) {
  for (uint32_t i = 0; i < count; ++i) {
    const std::string name =
        "model.layers." + std::to_string(s.next_layer++ % kModelLayers) + ".self_attn";
    const uint64_t read_ns_before = s.decode->reader().stats().read_ns;
    const int64_t start_us = trace::now_us();
    const auto start = Clock::now();
    RD2H_RETURN_IF_ERROR(s.prefill->save_kv_layer(name));
    RD2H_RETURN_IF_ERROR(s.prefill->wait_for_layer_send(name));
    const auto end = Clock::now();
    const int64_t end_us = trace::now_us();
    // The reader counts a read before it answers, so the answer implies the count.
    const uint64_t read_ns = s.decode->reader().stats().read_ns - read_ns_before;
    if (record) {
      s.samples.push_back({std::chrono::duration<double, std::micro>(end - start).count(),
                           static_cast<double>(read_ns) / 1e3, start_us, end_us});
    }
  }
  return Status::ok();
}

std::vector<std::vector<double>> stage_times(Setup& s, uint32_t count) {
  std::vector<std::vector<double>> stages(kStageCount);
  s.samples.clear();
  (void)trace::drain();
  trace::set_enabled(true);
  const Status st = run_layers(s, count, true);
  trace::set_enabled(false);
  auto events = trace::drain();
  if (!st) return stages;
  std::sort(events.begin(), events.end(),
            [](const trace::Event& a, const trace::Event& b) { return a.ts_us < b.ts_us; });
  auto first = [&](int64_t from, int64_t to, const char* name) -> std::optional<int64_t> {
    auto it = std::lower_bound(events.begin(), events.end(), from,
                               [](const trace::Event& e, int64_t t) { return e.ts_us < t; });
    for (; it != events.end() && it->ts_us <= to; ++it) {
      if (it->name == name) return it->ts_us;
    }
    return std::nullopt;
  };
  for (const auto& x : s.samples) {
    const auto sent = first(x.start_us, x.end_us, "readiness");
    const auto in = first(x.start_us, x.end_us, "readiness in");
    const auto read = first(x.start_us, x.end_us, "read");
    const auto out = first(x.start_us, x.end_us, "answer out");
    const auto answer = first(x.start_us, x.end_us, "answer");
    if (!sent || !in || !read || !out || !answer) continue;
    const int64_t read_end = *read + static_cast<int64_t>(x.read_us);
    const int64_t points[] = {x.start_us, *sent, *in, *read, read_end, *out, *answer, x.end_us};
    for (size_t k = 0; k < kStageCount; ++k) {
      stages[k].push_back(static_cast<double>(std::max<int64_t>(0, points[k + 1] - points[k])));
    }
  }
  return stages;
}

Expected<std::vector<std::unique_ptr<Setup>>> make_setups(const BenchLayersOptions& o) {
  std::vector<std::unique_ptr<Setup>> setups;
  for (uint32_t requests : o.requests) {
    for (const bool link : {false, true}) {
      auto s = make_setup(o, requests, link);
      if (!s) return s.status().with_context(std::to_string(requests) + " requests");
      setups.push_back(std::move(*s));
    }
  }
  return setups;
}

Status warm_up(std::vector<std::unique_ptr<Setup>>& setups, const BenchLayersOptions& o) {
  for (auto& s : setups) {
    RD2H_RETURN_IF_ERROR(run_layers(*s, o.warmup, false));
    for (int extra = 0;
         extra < 1000 && s->link && s->prefill->stats().sender.readiness_on_link == 0; ++extra) {
      RD2H_RETURN_IF_ERROR(run_layers(*s, 1, false));
    }
    if (s->link && s->prefill->stats().sender.readiness_on_link == 0) {
      return internal_error("no readiness went on the link in " + std::to_string(o.warmup + 1000) +
                            " layers");
    }
  }
  return Status::ok();
}

}  // namespace rd2h::tools::bench_layers
