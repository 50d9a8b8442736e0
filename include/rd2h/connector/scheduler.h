// The scheduler half of the connector, shaped like vLLM's KV Connector V1 scheduler role (spec
// "Request Lifecycle"): what build_connector_meta returns goes to every worker for the step.
// Not thread-safe: only the host's scheduler thread calls it.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "rd2h/common/status.h"
#include "rd2h/connector/config.h"
#include "rd2h/connector/kv_connector.h"
#include "rd2h/connector/metadata.h"
#include "rd2h/connector/stats.h"

namespace rd2h::metaserver {
class Client;
}  // namespace rd2h::metaserver

namespace rd2h::connector {

namespace testing {
struct SchedulerAccess;
}  // namespace testing

// One KV-cache group of the host engine: the layers whose blocks it allocates, and its block
// size in tokens. The main group is the one whose layers carry no "indexer" in their name,
// the indexer group the one whose layers do (in any case); a uniform group serves both.
struct KvCacheGroup {
  std::vector<std::string> layer_names;
  uint64_t block_size = 0;
};

struct Parallel {
  int tp_size = 1;
  int pcp_size = 1;
  int dcp_size = 1;
  int global_dp_rank = 0;
};

// Whether a layer holds an indexer cache: "indexer" in its name, in any case.
bool is_indexer_layer(std::string_view name);

// Which group holds main KV and which the indexer, found from layer names. No groups, or
// only indexer groups, is an error naming the problem.
struct GroupRoles {
  size_t main = 0;
  size_t indexer = 0;
};
Expected<GroupRoles> find_group_roles(const std::vector<KvCacheGroup>& groups);

class Scheduler final : public KvConnectorScheduler {
 public:
  static Expected<std::unique_ptr<Scheduler>> create(ConnectorConfig config, Parallel parallel,
                                                     std::vector<KvCacheGroup> groups);
  ~Scheduler() override;

  std::string_view name() const override { return "rd2h"; }

  MatchedTokens get_num_new_matched_tokens(const Request& request,
                                           uint64_t num_computed_tokens) override;
  // `block_ids` per group, as allocated for the request. On Decode this also clears
  // do_remote_prefill in `request.params`.
  Status update_state_after_alloc(Request& request,
                                  const std::vector<std::vector<int64_t>>& block_ids,
                                  uint64_t num_external_tokens) override;
  // The step's metadata for the workers (encode(ConnectorMetadata)).
  Expected<std::vector<std::byte>> build_connector_meta(
      const std::vector<ScheduledRequest>& scheduled) override;
  Expected<FinishedRequest> request_finished(const Request& request) override;
  // rd2h needs every block group on update_state_after_alloc, even when a composed
  // connector is the one chosen for lookup.
  bool requires_full_blocks_on_update_after_alloc() const override { return true; }

  // Decode: its metaserver posts so far (Prefill: all zero).
  MetaserverStats metaserver_stats() const;

  // Decode's advertised base port: kv_port + global_dp_rank * tp_size.
  int base_port() const { return base_port_; }

 private:
  friend struct testing::SchedulerAccess;
  struct Send {  // Prefill
    std::string ext_id;
    KvTransferParams decode;
    uint64_t num_prompt_tokens = 0;
    uint64_t transferred_tokens = 0;
    std::vector<int64_t> main_blocks, indexer_blocks;
  };
  Scheduler(ConnectorConfig config, Parallel parallel, std::vector<KvCacheGroup> groups,
            GroupRoles roles);
  Status update_decode(Request& request, const std::vector<std::vector<int64_t>>& block_ids);
  Status update_prefill(Request& request, const std::vector<std::vector<int64_t>>& block_ids);
  // build_connector_meta's steps for one request: the step's new blocks added to the
  // request's (replacing them when it resumed), then the chunk the step publishes, or none
  // when it publishes nothing.
  Status add_new_blocks(Send& s, const ScheduledRequest& step);
  Expected<ConnectorMetadata> step_metadata(const std::vector<ScheduledRequest>& scheduled);
  Expected<std::optional<prefill::SendRequest>> next_chunk(Send& s, const ScheduledRequest& step);

  ConnectorConfig config_;
  Parallel parallel_;
  std::vector<KvCacheGroup> groups_;
  GroupRoles roles_;
  int base_port_ = 0;
  std::unique_ptr<metaserver::Client> metaserver_;  // Decode
  std::map<std::string, uint64_t> computed_;        // Decode: local prefix hits at match
  std::map<std::string, std::string> recv_;         // Decode: internal id -> ext id, loading
  std::map<std::string, Send> send_;                // Prefill: by internal id
  ConnectorMetadata pending_;
};

}  // namespace rd2h::connector
