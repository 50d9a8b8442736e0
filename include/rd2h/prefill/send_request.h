// What one request publishes from Prefill in a step: the save part of the connector's
// per-step metadata, which the Prefill worker binds (prefill::Worker::bind_step).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace rd2h::prefill {

// What one request publishes in this step: its Decode endpoint and the Prefill blocks that
// became complete (layout::chunk_slice), with their offsets in Decode's block lists.
struct SendRequest {
  std::string ext_id;
  std::string d_host;
  int d_base_port = 0;  // Decode's advertised base port
  int d_tp = 1;
  std::vector<int64_t> main_block_ids;
  std::vector<int64_t> indexer_block_ids;
  int64_t main_start = 0;
  int64_t indexer_start = 0;
  bool final_chunk = false;  // the last cache-bearing layer also names it in done_ext_ids
  // Decode's CURVE public key (Z85) as its rendezvous gave it; empty when it gave none.
  std::string d_public_key;
};

}  // namespace rd2h::prefill
