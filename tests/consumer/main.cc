// A host engine's first steps against an installed rd2h, through its public headers only:
// read a kv_transfer_config, create the scheduler role, plan a step and encode it.
#include <cstdio>
#include <cstring>
#include <memory>

#include "rd2h/connector/config.h"
#include "rd2h/connector/host_offload.h"
#include "rd2h/connector/metadata.h"
#include "rd2h/connector/multi_connector.h"
#include "rd2h/connector/scheduler.h"
#include "rd2h/connector/worker.h"
#include "rd2h/metaserver/proxy.h"
#include "rd2h/version.h"

int main() {
  if (std::strcmp(rd2h::version(), RD2H_VERSION) != 0) {
    std::fprintf(stderr, "library %s, headers %s\n", rd2h::version(), RD2H_VERSION);
    return 1;
  }
  auto config = rd2h::connector::ConnectorConfig::from_json(
      R"({"kv_connector": "rd2h", "kv_role": "kv_producer", "kv_port": 30000,)"
      R"( "engine_id": "prefill-0"})");
  if (!config) {
    std::fprintf(stderr, "config: %s\n", config.status().to_string().c_str());
    return 1;
  }
  auto scheduler = rd2h::connector::Scheduler::create(
      *config, rd2h::connector::Parallel{},
      {{{"model.layers.0.self_attn", "model.layers.0.self_attn.indexer"}, 128}});
  if (!scheduler) {
    std::fprintf(stderr, "scheduler: %s\n", scheduler.status().to_string().c_str());
    return 1;
  }
  auto bytes = (*scheduler)->build_connector_meta({});
  if (!bytes) {
    std::fprintf(stderr, "step: %s\n", bytes.status().to_string().c_str());
    return 1;
  }
  if (!rd2h::connector::decode_metadata(*bytes)) {
    std::fprintf(stderr, "metadata does not decode\n");
    return 1;
  }
  std::printf("rd2h %s: %s scheduler, %zu metadata bytes\n", rd2h::version(),
              std::string((*scheduler)->name()).c_str(), bytes->size());
  return 0;
}
