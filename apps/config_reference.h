// docs/configuration.md, written from the tables the code reads: the connector's
// kv_transfer_config keys and the command lines' options.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

namespace rd2h::tools {

// The reference document; `app` is the rd2h command line, its servers' options included.
std::string config_reference_markdown(const CLI::App& app);

}  // namespace rd2h::tools
