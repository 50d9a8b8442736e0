// The Decode side of the connector in one TP rank (spec "Decode allocation", "Request
// completion", "Ports and Endpoint Identity"): registers the rank's destinations (its share
// of the TP-shared main pool and its own indexer) with the transfer engine, binds the rank
// port, and runs the rank's Reader. Requests are added as Decode's scheduler allocates
// them; get_finished gathers completion across the TP ranks and reports failed requests
// with their invalid blocks.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "control/channel.h"
#include "decode/reader.h"
#include "layout/cache.h"
#include "rd2h/common/status.h"
#include "rd2h/transfer/transfer_engine.h"

namespace rd2h::decode {

struct WorkerConfig {
  // reader.d_rank, reader.d_tp and reader.host are this rank's; reader.port is derived
  // from the fields below.
  ReaderConfig reader;
  // The Prefill TP size configured, checked against Decode's (a multiple of it); 0: none.
  // The contributor count each readiness carries is what the reader uses, so Prefill
  // instances of other TP sizes are served as well.
  int p_tp = 0;
  // The rank binds base_port + d_rank, base_port = kv_port + global_dp_rank * d_tp.
  // kv_port 0 binds any free port (tests); base_port() is then meaningless.
  int kv_port = 0;
  int global_dp_rank = 0;
  // Register the destinations with the engine. False when they live in memory the engine
  // allocated, which is registered already.
  bool register_memory = true;
};

class Worker {
 public:
  static Expected<std::unique_ptr<Worker>> create(WorkerConfig config,
                                                  std::shared_ptr<transfer::TransferEngine> engine,
                                                  std::shared_ptr<control::Context> context,
                                                  const std::vector<layout::CacheLayer>& layers);
  ~Worker();  // stops the reader, then unregisters what create registered
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  int base_port() const { return base_port_; }  // what Decode advertises to Prefill
  const std::string& url() const { return reader_->url(); }
  Reader& reader() { return *reader_; }
  const Reader& reader() const { return *reader_; }

  Status add_request(const std::string& ext_id, const std::string& internal_id,
                     std::vector<int64_t> main_blocks, std::vector<int64_t> indexer_blocks,
                     std::chrono::steady_clock::time_point arrival_deadline =
                         std::chrono::steady_clock::time_point::max()) {
    return reader_->add_request(ext_id, internal_id, std::move(main_blocks),
                                std::move(indexer_blocks), arrival_deadline);
  }
  void remove_request(const std::string& ext_id) { reader_->remove_request(ext_id); }
  Expected<Finished> get_finished(const AllGather& all_gather) {
    return reader_->get_finished(all_gather);
  }

 private:
  explicit Worker(std::shared_ptr<transfer::TransferEngine> engine) : engine_(std::move(engine)) {}

  std::shared_ptr<transfer::TransferEngine> engine_;
  std::vector<void*> registered_;
  int base_port_ = 0;
  std::unique_ptr<Reader> reader_;
};

}  // namespace rd2h::decode
