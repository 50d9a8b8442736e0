// KV layout arithmetic (docs/wire-format.md "Arithmetic both sides share"): a layer's tensors
// on each side, whether the sides agree, the share of a request each Decode rank and
// contributor pulls, and its read descriptors. Pure functions over plain structs.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "rd2h/common/status.h"
#include "rd2h/transfer/read_op.h"

namespace rd2h::layout {

// One layer's tensors on one side: K, V (the main tensors), then the indexer, then the
// optional LIC8 scale. Addresses and sizes in bytes.
struct LayerTensors {
  std::vector<uint64_t> base_addrs;
  std::vector<uint64_t> bytes_per_block;
  size_t main_tensor_count = 2;
  bool has_indexer = false;
  bool has_scale = false;  // LIC8 scale, follows the indexer layout
  // Blocks allocated per tensor; destination block ids must be below it (0: not checked,
  // as for Prefill, whose ranges the transfer engine checks against its regions).
  uint64_t num_blocks = 0;

  size_t indexer_index() const { return main_tensor_count; }
  size_t scale_index() const { return main_tensor_count + 1; }
};

// Checks a layer's shape: as many base addresses and block sizes as its main tensors,
// indexer and scale make, and a scale only with an indexer. The error names `side`.
Status check_shape(const LayerTensors& t, std::string_view side);

// Checks that Prefill's and Decode's tensors of a layer agree: main tensor count and bytes,
// indexer presence and bytes, scale presence and bytes. The error names the layer, the
// component and both values.
Status validate_layer(int64_t layer_idx, const LayerTensors& prefill, const LayerTensors& decode);

// The half-open range [begin, end) of `n` items that participant `index` of `size` owns,
// rotated by `start` so that small requests do not always land on participant 0:
// logical = (index - start) mod size; q, r = n / size, n % size;
// begin = logical*q + min(logical, r), length q + (logical < r).
struct Range {
  size_t begin = 0;
  size_t end = 0;
  size_t size() const { return end - begin; }
};
Range share(size_t index, size_t size, int64_t start, size_t n);

// A read of one contiguous run: Decode's address (local), Prefill's (remote), its length.
using transfer::ReadOp;

// A request's blocks on Prefill for one layer, as its readiness publishes them: the
// block ids, and where in Decode's block lists they start.
struct SourceBlocks {
  std::string_view ext_id;
  std::span<const int64_t> main_block_ids;
  std::span<const int64_t> indexer_block_ids;
  int64_t main_start = 0;
  int64_t indexer_start = 0;
};

// What one Decode rank reads for one request of one layer.
struct RequestRead {
  SourceBlocks src;
  // Decode's destination block lists for the request; src's starts index into them.
  std::span<const int64_t> dest_main_blocks;
  std::span<const int64_t> dest_indexer_blocks;
};

struct ReadRole {
  int d_rank = 0;            // this Decode rank
  int d_tp = 1;              // Decode TP size: main KV is split across its ranks
  int group_member_idx = 0;  // the contributor that sent the readiness
  int tp_ratio = 1;          // contributors per Decode rank: the indexer is split across them
};

// Appends the descriptors of one request: the main share of this Decode rank (pulled only
// by contributor member 0) and this contributor's range of the indexer (and scale). Checks
// that every destination index lies inside Decode's block list; on error nothing is added.
Status append_request_reads(const LayerTensors& prefill, const LayerTensors& decode,
                            const RequestRead& read, const ReadRole& role,
                            std::vector<ReadOp>& out);

// Merges neighbours whose Prefill and Decode addresses both continue the previous run.
// Reads are merged only within [from, out.size()), so callers keep tensors and
// requests apart by coalescing each group on its own.
void coalesce(std::vector<ReadOp>& out, size_t from = 0);

}  // namespace rd2h::layout
