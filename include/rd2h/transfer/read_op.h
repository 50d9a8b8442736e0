// One read of the transfer engine: `length` bytes of the peer's memory at `remote` into
// local memory at `local`. What the KV layout produces and the engine consumes.
#pragma once

#include <cstddef>
#include <cstdint>

namespace rd2h::transfer {

struct ReadOp {
  uintptr_t local = 0;   // the reader's address
  uintptr_t remote = 0;  // the peer's address
  size_t length = 0;
  bool operator==(const ReadOp&) const = default;
};

}  // namespace rd2h::transfer
