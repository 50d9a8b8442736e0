#include "decode/worker.h"

#include "topology/topology.h"

namespace rd2h::decode {

Expected<std::unique_ptr<Worker>> Worker::create(WorkerConfig config,
                                                 std::shared_ptr<transfer::TransferEngine> engine,
                                                 std::shared_ptr<control::Context> context,
                                                 const std::vector<layout::CacheLayer>& layers) {
  ReaderConfig reader = config.reader;
  if (config.p_tp > 0) {
    RD2H_RETURN_IF_ERROR(topology::make_tp_mapping(config.p_tp, reader.d_tp).status());
  }
  auto worker = std::unique_ptr<Worker>(new Worker(std::move(engine)));
  if (config.kv_port != 0) {
    RD2H_TRY(base, topology::base_port(config.kv_port, config.global_dp_rank, reader.d_tp));
    RD2H_TRY(port, topology::rank_port(base, reader.d_rank, reader.d_tp));
    worker->base_port_ = base;
    reader.port = port;
  } else {
    reader.port = 0;
  }
  DecodeLayout layout;
  for (const auto& layer : layers) {
    RD2H_TRY(tensors, layout::to_layer_tensors(layer));
    if (!layout.emplace(layer.name, std::move(tensors)).second) {
      return invalid_argument("layer '" + layer.name + "' is given twice");
    }
  }
  if (config.register_memory) {
    for (const auto& region : layout::merged_regions(layers)) {
      void* addr = reinterpret_cast<void*>(region.addr);
      RD2H_RETURN_IF_ERROR(worker->engine_->register_memory(addr, region.length)
                               .with_context("registering Decode rank " +
                                             std::to_string(reader.d_rank) + "'s destinations"));
      worker->registered_.push_back(addr);
    }
  }
  RD2H_TRY(started, Reader::start(reader, worker->engine_, std::move(layout), std::move(context)));
  worker->reader_ = std::move(started);
  return worker;
}

Worker::~Worker() {
  reader_.reset();
  for (void* addr : registered_) (void)engine_->unregister_memory(addr);
}

}  // namespace rd2h::decode
