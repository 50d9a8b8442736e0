// Runs the real rd2h binary as a user does and returns its exit code and output.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <string>
#include <vector>

#include "util/subprocess.h"

namespace rd2h {

struct ToolRun {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

// `prefix` goes before the binary (a command looked up on PATH, e.g. "ip netns exec ns").
inline ToolRun run_rd2h(std::vector<std::string> args,
                        std::chrono::seconds timeout = std::chrono::seconds(120),
                        std::vector<std::string> prefix = {}) {
  args.insert(args.begin(), RD2H_BINARY);
  if (!prefix.empty()) {
    prefix.insert(prefix.begin(), "/usr/bin/env");
    args.insert(args.begin(), prefix.begin(), prefix.end());
  }
  Subprocess::Options options;
  options.merge_stderr = true;
  auto p = Subprocess::spawn(args, options);
  EXPECT_TRUE(p) << p.status().to_string();
  if (!p) return {};
  ToolRun r;
  auto out = p->read_all(timeout);
  EXPECT_TRUE(out) << out.status().to_string();
  if (out) r.output = *out;
  auto status = p->wait(std::chrono::seconds(30));
  EXPECT_TRUE(status) << status.status().to_string();
  if (status && WIFEXITED(*status)) r.exit_code = WEXITSTATUS(*status);
  return r;
}

}  // namespace rd2h
