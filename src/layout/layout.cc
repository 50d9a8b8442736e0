#include "layout/layout.h"

#include <algorithm>

namespace rd2h::layout {

namespace {

std::string component_name(const LayerTensors& t, size_t i) {
  if (i < t.main_tensor_count) return "main tensor " + std::to_string(i);
  if (t.has_indexer && i == t.indexer_index()) return "indexer";
  return "LIC8 scale";
}

}  // namespace

Status check_shape(const LayerTensors& t, std::string_view side) {
  const size_t expected = t.main_tensor_count + (t.has_indexer ? 1 : 0) + (t.has_scale ? 1 : 0);
  if (t.has_scale && !t.has_indexer) {
    return invalid_argument(std::string(side) + " has a LIC8 scale but no indexer");
  }
  if (t.base_addrs.size() != expected || t.bytes_per_block.size() != expected) {
    return invalid_argument(std::string(side) + " describes " +
                            std::to_string(t.base_addrs.size()) + " tensors, expected " +
                            std::to_string(expected));
  }
  return Status::ok();
}

namespace {

// base + block * bytes, or an error when it overflows 64 bits.
Expected<uint64_t> block_address(uint64_t base, int64_t block, uint64_t bytes) {
  uint64_t offset = 0, address = 0;
  if (block < 0 || __builtin_mul_overflow(static_cast<uint64_t>(block), bytes, &offset) ||
      __builtin_add_overflow(base, offset, &address)) {
    return out_of_range("block " + std::to_string(block) + " of " + std::to_string(bytes) +
                        " bytes past " + std::to_string(base) + " is not addressable");
  }
  return address;
}

// The reads of blocks [range) of one tensor, coalesced.
Status append_tensor(const LayerTensors& prefill, const LayerTensors& decode, size_t tensor,
                     std::span<const int64_t> src_blocks, std::span<const int64_t> dst_blocks,
                     int64_t dst_start, Range range, std::vector<ReadOp>& out) {
  const size_t from = out.size();
  const uint64_t bytes = prefill.bytes_per_block[tensor];
  for (size_t i = range.begin; i < range.end; ++i) {
    const uint64_t dst_index = static_cast<uint64_t>(dst_start) + i;
    if (dst_index >= dst_blocks.size()) {
      out.resize(from);
      return out_of_range(component_name(decode, tensor) + ": destination index " +
                          std::to_string(dst_index) + " is outside the request's " +
                          std::to_string(dst_blocks.size()) + " blocks");
    }
    const int64_t dst_block = dst_blocks[dst_index];
    if (dst_block < 0 ||
        (decode.num_blocks != 0 && static_cast<uint64_t>(dst_block) >= decode.num_blocks)) {
      out.resize(from);
      return out_of_range(component_name(decode, tensor) + ": destination block " +
                          std::to_string(dst_block) + " is outside the " +
                          std::to_string(decode.num_blocks) + " allocated");
    }
    auto remote = block_address(prefill.base_addrs[tensor], src_blocks[i], bytes);
    auto local = block_address(decode.base_addrs[tensor], dst_block, bytes);
    if (!remote || !local) {
      out.resize(from);
      return (!remote ? remote.status() : local.status())
          .with_context(component_name(decode, tensor));
    }
    out.push_back({*local, *remote, bytes});
  }
  coalesce(out, from);
  return Status::ok();
}

}  // namespace

Status validate_layer(int64_t layer_idx, const LayerTensors& p, const LayerTensors& d) {
  const std::string layer = "layer " + std::to_string(layer_idx) + ": ";
  RD2H_RETURN_IF_ERROR(check_shape(p, "Prefill").with_context(layer.substr(0, layer.size() - 2)));
  RD2H_RETURN_IF_ERROR(check_shape(d, "Decode").with_context(layer.substr(0, layer.size() - 2)));
  if (p.main_tensor_count != d.main_tensor_count) {
    return invalid_argument(layer + "main tensor count " + std::to_string(p.main_tensor_count) +
                            " on Prefill != " + std::to_string(d.main_tensor_count) + " on Decode");
  }
  if (p.has_indexer != d.has_indexer) {
    return invalid_argument(layer + "indexer " + (p.has_indexer ? "present" : "absent") +
                            " on Prefill but " + (d.has_indexer ? "present" : "absent") +
                            " on Decode");
  }
  if (p.has_scale != d.has_scale) {
    return invalid_argument(layer + "LIC8 scale " + (p.has_scale ? "present" : "absent") +
                            " on Prefill but " + (d.has_scale ? "present" : "absent") +
                            " on Decode");
  }
  for (size_t i = 0; i < p.bytes_per_block.size(); ++i) {
    if (p.bytes_per_block[i] != d.bytes_per_block[i]) {
      return invalid_argument(
          layer + component_name(p, i) + " block bytes " + std::to_string(p.bytes_per_block[i]) +
          " on Prefill != " + std::to_string(d.bytes_per_block[i]) + " on Decode");
    }
  }
  return Status::ok();
}

Range share(size_t index, size_t size, int64_t start, size_t n) {
  if (size == 0) return {};
  const auto s = static_cast<int64_t>(size);
  const int64_t logical = ((static_cast<int64_t>(index) - start) % s + s) % s;
  const size_t l = static_cast<size_t>(logical);
  const size_t q = n / size, r = n % size;
  const size_t begin = l * q + std::min(l, r);
  return {begin, begin + q + (l < r ? 1 : 0)};
}

Status append_request_reads(const LayerTensors& prefill, const LayerTensors& decode,
                            const RequestRead& read, const ReadRole& role,
                            std::vector<ReadOp>& out) {
  const SourceBlocks& req = read.src;
  const size_t from = out.size();
  auto fail = [&](const Status& st) {
    out.resize(from);
    return st.with_context("request " + std::string(req.ext_id));
  };
  // Main KV is replicated across a contributor group: member 0 alone pulls this rank's share.
  if (role.group_member_idx == 0) {
    const Range main = share(static_cast<size_t>(role.d_rank), static_cast<size_t>(role.d_tp),
                             req.main_start, req.main_block_ids.size());
    for (size_t t = 0; t < prefill.main_tensor_count; ++t) {
      Status st = append_tensor(prefill, decode, t, req.main_block_ids, read.dest_main_blocks,
                                req.main_start, main, out);
      if (!st) return fail(st);
    }
  }
  // Every Decode rank needs the whole indexer: the contributors split it between them.
  if (prefill.has_indexer) {
    const Range idx =
        share(static_cast<size_t>(role.group_member_idx), static_cast<size_t>(role.tp_ratio),
              req.indexer_start, req.indexer_block_ids.size());
    for (size_t t = prefill.indexer_index(); t < prefill.base_addrs.size(); ++t) {
      Status st = append_tensor(prefill, decode, t, req.indexer_block_ids, read.dest_indexer_blocks,
                                req.indexer_start, idx, out);
      if (!st) return fail(st);
    }
  }
  return Status::ok();
}

void coalesce(std::vector<ReadOp>& out, size_t from) {
  if (out.size() - from < 2) return;
  size_t w = from;
  for (size_t i = from + 1; i < out.size(); ++i) {
    ReadOp& last = out[w];
    const ReadOp& d = out[i];
    if (d.local == last.local + last.length && d.remote == last.remote + last.length) {
      last.length += d.length;
    } else {
      out[++w] = d;
    }
  }
  out.resize(w + 1);
}

}  // namespace rd2h::layout
