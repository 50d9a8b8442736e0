// A real UCX transfer engine over shared memory, for tests that run several ranks in one
// process.
#pragma once

#include <gtest/gtest.h>

#include <memory>

#include "rd2h/transfer/transfer_engine.h"

namespace rd2h::testing {

inline std::shared_ptr<transfer::TransferEngine> shm_engine(
    transfer::Role role = transfer::Role::kPrefill) {
  transfer::EngineConfig cfg;
  cfg.role = role;
  cfg.transport = transfer::Transport::kShm;
  auto e = transfer::create_ucx_engine(cfg);
  EXPECT_TRUE(e) << e.status().to_string();
  return e ? std::shared_ptr<transfer::TransferEngine>(std::move(*e)) : nullptr;
}

}  // namespace rd2h::testing
