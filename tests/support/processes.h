// The processes of this test's engines, found in /proc.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

namespace rd2h::testing {

// The processes `parent` started that run `rd2h worker` (an engine's TP ranks).
inline std::vector<pid_t> workers_of(pid_t parent) {
  std::vector<pid_t> out;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(entry.path() / "stat");
    std::string line;
    std::getline(stat, line);
    const size_t close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 2));
    char state = 0;
    pid_t ppid = 0;
    rest >> state >> ppid;
    std::ifstream cmd(entry.path() / "cmdline");
    std::string argv((std::istreambuf_iterator<char>(cmd)), std::istreambuf_iterator<char>());
    if (ppid == parent && argv.find(std::string("worker") + '\0') != std::string::npos) {
      out.push_back(std::stoi(name));
    }
  }
  return out;
}

}  // namespace rd2h::testing
