#include "config_reference.h"

#include <sstream>

#include "rd2h/connector/config.h"

namespace rd2h::tools {

namespace {

void key_table(std::ostringstream& out, const std::string& section) {
  out << "| key | takes | default | read by | meaning |\n|---|---|---|---|---|\n";
  for (const auto& k : connector::config_reference()) {
    if (k.section != section) continue;
    out << "| `" << k.name << "` | " << k.type << " | "
        << (k.literal ? "`" + k.default_value + "`" : k.default_value) << " | " << k.who << " | "
        << k.doc << " |\n";
  }
}

void command_help(std::ostringstream& out, const CLI::App& app, const std::string& name) {
  const CLI::App* sub = app.get_subcommand(name);
  out << "\n### `rd2h " << name << "`\n\n```text\n" << sub->help("rd2h") << "```\n";
}

}  // namespace

std::string config_reference_markdown(const CLI::App& app) {
  std::ostringstream out;
  out << R"(# Configuration reference

<!-- Written by `rd2h config-reference` from the tables the code reads; a test checks that it
is current. After changing a key or an option: rd2h config-reference > docs/configuration.md -->

## kv_transfer_config

The connector reads vLLM's `kv_transfer_config` JSON (`--kv-transfer-config` of `vllm serve`
and of `rd2h prefill` and `rd2h decode`). A bad value stops the engine at start with an error
that names the key; every key inside `kv_connector_extra_config` must be one of the list
below, so a misspelt key is an error too. Top-level keys the connector does not read belong
to vLLM and are left to it. `examples/vllm/` has a Prefill and a Decode config for one host
and for several. Every `*_timeout_ms` bounds one wait: nothing in rd2h waits without a bound.

### Top-level keys

)";
  key_table(out, "");
  out << R"(
### kv_connector_extra_config

)";
  key_table(out, "kv_connector_extra_config");
  out << R"(
### Keys read by vLLM and `rd2h.vllm`

| key | where | meaning |
|---|---|---|
| `kv_connector_module_path` | top level | `"rd2h.vllm"`: the module vLLM imports the connector class from. |
| `kv_buffer_device` | top level | `"cpu"` for KV caches on a device (GPU, NPU): rd2h moves them through page-locked host buffers. Device caches without it are refused at start. |
| `kv_load_failure_policy` | top level | vLLM's: `"fail"` ends a request whose KV did not arrive with an error, `"recompute"` has Decode compute the prompt itself. |
| `main_kv_on_host` | `kv_connector_extra_config` | Decode with device caches: `true` keeps main KV in the host buffers (`Rd2hConnector.host_kv_caches()`) and copies only the indexer caches to the device. Default `false`. |

## Environment

| variable | meaning |
|---|---|
| `RD2H_LOG_LEVEL` | `trace`, `debug`, `info`, `warn`, `error`, `critical` or `off`: the log level of every rd2h process (`--log-level` wins). Any other value is refused at start. |
| `RD2H_TOKEN` | The bearer token of the proxy, the engines and Decode's rendezvous posts, where no `--token-file` or `metaserver_token_file` names one. |
| `UCX_ERROR_SIGNALS` | Unset, `rd2h` sets it empty so that a fault ends the process instead of UCX's handler; set it to keep UCX's handler. |
| `UCX_*` | UCX's own settings, read by the transfer engine as UCX documents them. |

## Command lines

The servers' options as `--help` gives them, defaults included.
)";
  for (const char* name : {"proxy", "prefill", "decode", "demo", "keygen"}) {
    command_help(out, app, name);
  }
  return out.str();
}

}  // namespace rd2h::tools
