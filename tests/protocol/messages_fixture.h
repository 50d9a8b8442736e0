// What the wire messages' tests share: bytes from hex text (spaces ignored) or from a list,
// and a sample MF_META of two layers with an indexer.
#pragma once

#include <cctype>
#include <cstddef>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "protocol/messages.h"

namespace rd2h::testing {

inline std::vector<std::byte> hex(std::string_view text) {
  std::vector<std::byte> out;
  std::string digits;
  for (char c : text) {
    if (std::isxdigit(static_cast<unsigned char>(c))) digits += c;
  }
  for (size_t i = 0; i + 1 < digits.size(); i += 2) {
    out.push_back(static_cast<std::byte>(std::stoi(digits.substr(i, 2), nullptr, 16)));
  }
  return out;
}

inline std::vector<std::byte> bytes(std::initializer_list<int> v) {
  std::vector<std::byte> out;
  for (int x : v) out.push_back(static_cast<std::byte>(x));
  return out;
}

// An MF_META of two layers (K, V and an indexer in two groups) with a backend's metadata.
inline protocol::MfMeta sample_meta() {
  protocol::MfMeta m;
  m.p_session = "10.0.0.1:5000";
  protocol::LayerMeta l;
  l.base_addrs = {0x7f0000000000, 0x7f0000100000, 0x7f0000200000};
  l.block_len = {4096, 512, 512};
  l.block_size_scale = {32, 32, 32};
  l.tensor_group_idx = {0, 0, 1};
  l.main_tensor_count = 2;
  l.has_indexer = true;
  m.layers = {{"model.layers.0.self_attn", l}, {"model.layers.1.self_attn", l}};
  m.backend_name = "ucx";
  m.backend_metadata = bytes({1, 2, 3});
  return m;
}

}  // namespace rd2h::testing
