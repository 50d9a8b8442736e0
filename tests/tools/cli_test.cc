// The rd2h command line as a user meets it: a mistyped command is named, a bad log level in
// the environment is refused, not ignored, and the configuration reference is current.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

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

// docs/configuration.md is what the code's tables say: a key or an option added, renamed or
// given another default without the document written again fails here.
TEST(Cli, TheConfigurationReferenceIsCurrent) {
  const ToolRun r = run_rd2h({"config-reference"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::filesystem::path path =
      std::filesystem::path(RD2H_SOURCE_DIR) / "docs" / "configuration.md";
  std::ifstream in(path);
  ASSERT_TRUE(in) << "docs/configuration.md is missing";
  std::ostringstream doc;
  doc << in.rdbuf();
  // Every key the connector reads is in it, with its default.
  const std::string arrival =
      "| `kv_arrival_timeout_ms` | milliseconds, 1 to 86400000 | `120000` |";
  EXPECT_NE(r.output.find(arrival), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--advertise-host"), std::string::npos) << r.output;
  EXPECT_EQ(doc.str(), r.output)
      << "docs/configuration.md is not current: rd2h config-reference > docs/configuration.md";
}

}  // namespace
}  // namespace rd2h
