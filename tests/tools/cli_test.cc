// The rd2h command line as a user meets it: a mistyped command is named, and a bad log
// level in the environment is refused, not ignored.
#include <gtest/gtest.h>

#include "support/rd2h_run.h"

namespace rd2h {
namespace {

TEST(Cli, AnUnknownCommandIsNamedWithTheCommandsThereAre) {
  const ToolRun r = run_rd2h({"bogus"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("unknown command 'bogus'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("proxy"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("A subcommand is required"), std::string::npos) << r.output;
}

TEST(Cli, ABadLogLevelInTheEnvironmentIsRefusedNamingIt) {
  const ToolRun r = run_rd2h({"keygen", "/nonexistent/dir/key"}, std::chrono::seconds(30),
                             {"RD2H_LOG_LEVEL=loud"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("RD2H_LOG_LEVEL: log level 'loud' is not one of trace, debug"),
            std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace rd2h
