#include "peers.h"

#include <unistd.h>

#include <cstdlib>
#include <sstream>

#include "util/subprocess.h"

namespace rd2h::tools {

namespace {

std::string from_env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : "";
}

}  // namespace

Expected<std::string> peers_python(const std::string& chosen) {
  if (!chosen.empty()) return chosen;
  if (std::string env = from_env("RD2H_PEERS_PYTHON"); !env.empty()) return env;
  const std::string script = std::string(RD2H_SOURCE_DIR) + "/scripts/bench-venv";
  RD2H_TRY(venv, Subprocess::spawn({script, "--path"}));
  RD2H_TRY(path, venv.read_line(std::chrono::seconds(10)));
  (void)venv.wait(std::chrono::seconds(10));
  if (::access((path + "/.rd2h-complete").c_str(), F_OK) != 0) {
    return not_found("not installed (scripts/bootstrap --bench installs the peers into " + path +
                     ")");
  }
  return path + "/bin/python";
}

Expected<HarnessOutput> run_peers_harness(const std::string& python,
                                          const std::vector<std::string>& args,
                                          std::chrono::seconds timeout) {
  std::string harness = from_env("RD2H_PEERS_HARNESS");
  if (harness.empty()) harness = std::string(RD2H_SOURCE_DIR) + "/apps/peers/bench_peers.py";
  std::vector<std::string> argv{python, harness};
  argv.insert(argv.end(), args.begin(), args.end());
  Subprocess::Options options;
  options.merge_stderr = true;
  RD2H_TRY(child, Subprocess::spawn(argv, options));
  RD2H_TRY(out, child.read_all(timeout));
  HarnessOutput result;
  RD2H_TRY(status, child.wait(std::chrono::seconds(30)));
  result.exit_status = status;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    auto j = line.rfind('{', 0) == 0
                 ? nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false)
                 : nlohmann::json();
    if (j.is_object()) {
      result.results.push_back(std::move(j));
    } else if (!line.empty()) {
      result.last_words = line;
    }
  }
  return result;
}

}  // namespace rd2h::tools
