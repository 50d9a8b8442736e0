// The Prefill side of the connector in one TP rank (spec "Layer transfer"): registers the rank's
// KV caches, publishes each layer to the step's Decode endpoints once its write completes, and
// gates slot reuse on their answers. The compute thread calls it; no wait is unbounded.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "control/channel.h"
#include "layout/cache.h"
#include "layout/storage_slots.h"
#include "prefill/sender.h"
#include "prefill/slot_gate.h"
#include "protocol/messages.h"
#include "rd2h/common/status.h"
#include "rd2h/prefill/send_request.h"
#include "rd2h/prefill/write_event.h"
#include "rd2h/transfer/transfer_engine.h"

namespace rd2h::prefill {

struct WorkerConfig {
  int p_rank = 0;
  int p_tp = 1;
  SenderConfig sender;
  // Bound on wait_for_layer_send, wait_for_save and the reuse gate of save_kv_layer.
  std::chrono::milliseconds send_timeout{60000};
  // Register the caches with the engine. False when they live in memory the engine
  // allocated (allocate_memory), which is registered already.
  bool register_memory = true;
  // With CURVE keys (sender.curve): the Decode public keys this Prefill trusts. A request
  // whose Decode gave its key must name a trusted one; one that gave none is sent to the
  // only trusted key. Without keys, only loopback Decode hosts unless `insecure`.
  std::vector<std::string> trusted_decode_keys;
  bool insecure = false;
  // A Decode's failure raises on the compute path (the design's fail-fast). Otherwise (the
  // default) it fails only what was sent to that Decode: the slots it held are released,
  // the failure is logged once per step and counted, and the Decode never completes the
  // requests (it gets no KV_COMMIT for them).
  bool raise_on_peer_failure = false;
};

struct WorkerStats {
  uint64_t layers_saved = 0;
  uint64_t readiness_queued = 0;
  uint64_t peer_failures = 0;  // slot generations a failing Decode released (not raised)
  SenderStats sender;
};

class Worker {
 public:
  static Expected<std::unique_ptr<Worker>> create(WorkerConfig config,
                                                  std::shared_ptr<transfer::TransferEngine> engine,
                                                  std::shared_ptr<control::Context> context,
                                                  std::vector<layout::CacheLayer> layers);
  // Stops the sender (what is still owed fails), then unregisters what create registered.
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // The requests this step publishes, replacing the previous step's. Checks each request's
  // topology, Decode port and block ids; on error the previous step stays bound.
  Status bind_step(std::vector<SendRequest> requests);

  // The layer's KV is written (or will be once `event` completes): waits until its slots may
  // take a new owner (raising a failure of the previous owner not raised yet), then queues
  // one readiness per Decode endpoint that has blocks or final ids in this layer.
  Status save_kv_layer(std::string_view layer_name, std::shared_ptr<WriteEvent> event = nullptr);

  // Returns once every Decode endpoint told about what the layer's physical slots hold now
  // answered: call it before overwriting a reused slot. An error names the layer and why.
  // A step raises at most one failure (by whichever of these three calls sees it first):
  // once the compute path raised for a step, later failures of that step's layers only
  // release their slots, so an aborted step's leftovers never fail the next one.
  Status wait_for_layer_send(std::string_view layer_name);
  // The same, for the layer whose index is `layer_index` (the n of "layers.<n>"): what the
  // compute path calls before it writes that layer's KV into its physical slots. An index
  // no registered layer has is an error (kInvalidArgument): nothing would guard its write.
  Status wait_for_layer_reuse(int64_t layer_index);
  // The same for every slot: the end of a forward pass.
  Status wait_for_save();

  const protocol::MfMeta& mf_meta() const { return mf_meta_; }
  const layout::StorageSlots& slots() const { return slots_; }
  WorkerStats stats() const;

 private:
  // A request's offsets and block ids, against Prefill's cache.
  Status check_request(const SendRequest& r) const;
  struct Layer {
    std::string name;
    int64_t index = 0;
    layout::LayerTensors tensors;
  };
  // The step's messages to one Decode endpoint, before the layer is filled in.
  struct Target {
    std::string url;
    std::string server_key;          // Decode's CURVE key when this Prefill has keys
    protocol::ReadReadyBatch ready;  // read_reqs, group_member_idx, tp_ratio
    std::vector<std::string> final_ids;
    // The readiness without its layer, encoded once per step: for every layer, and for
    // the last one (with final_ids as done_ext_ids).
    std::vector<std::byte> body, body_last;
  };

  Worker(WorkerConfig config, std::shared_ptr<transfer::TransferEngine> engine);
  // The steps of create. take_layers fills layers_ in ascending layer index and returns the
  // caches in that order; index_layers checks the indices are distinct and derives by_name_,
  // min_blocks_, the storage slots and their gates; register_caches registers the caches'
  // memory with the engine; describe_caches fills mf_meta_.
  Expected<std::vector<layout::CacheLayer>> take_layers(std::vector<layout::CacheLayer> layers);
  Status index_layers();
  Status register_caches(const std::vector<layout::CacheLayer>& sorted);
  Status describe_caches(const std::vector<layout::CacheLayer>& sorted);
  Expected<size_t> find_layer(std::string_view name) const;
  // The CURVE key to reach `r`'s Decode with (empty without keys), or why it may not be.
  Expected<std::string> decode_key(const SendRequest& r) const;
  // The gates of a layer's slots: main, then indexer when it has one.
  std::vector<SlotGate*> gates_of(size_t layer);
  // Waits until `gate`'s slot may be reused (SlotGate::settle); a failure of a step that already
  // raised is swallowed, any other marks its step raised. A Decode's failure is not raised unless
  // config_.raise_on_peer_failure (counted and, once per step, logged instead).
  Status wait_reusable(SlotGate& gate, const Deadline& deadline);

  WorkerConfig config_;
  std::shared_ptr<transfer::TransferEngine> engine_;
  std::vector<void*> registered_;
  std::vector<Layer> layers_;  // ascending layer index
  std::map<std::string, size_t, std::less<>> by_name_;
  layout::StorageSlots slots_;
  std::vector<std::unique_ptr<SlotGate>> main_gates_, indexer_gates_;
  uint64_t min_blocks_ = 0;  // block ids must be below it
  protocol::MfMeta mf_meta_;
  std::vector<Target> targets_;
  uint64_t step_ = 0;                // bind_step count: the tag of this step's generations
  std::set<uint64_t> raised_steps_;  // recent steps that raised a failure
  WorkerStats stats_;                // compute thread only
  std::unique_ptr<Sender> sender_;
};

}  // namespace rd2h::prefill
