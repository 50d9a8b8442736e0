#include "control/curve.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <regex>
#include <sstream>

#include "util/unique_fd.h"

namespace rd2h::control {

namespace {

constexpr std::string_view kZ85Alphabet =
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#";

Expected<std::string> read_file(const std::string& path, const char* what) {
  std::ifstream in(path);
  if (!in)
    return not_found(std::string("cannot read the ") + what + " " + path + ": " +
                     std::strerror(errno));
  std::ostringstream s;
  s << in.rdbuf();
  if (s.str().size() > 64 * 1024) {
    return invalid_argument(std::string("the ") + what + " " + path + " is over 64 KiB");
  }
  return s.str();
}

// The value of `name = "..."` on one line, if the line holds that setting.
std::optional<std::string> setting(const std::string& line, std::string_view name) {
  static const std::regex re(R"re(^\s*([a-z-]+)\s*=\s*"([^"]*)"\s*$)re");
  std::smatch m;
  // An empty `name` matches any setting.
  if (!std::regex_match(line, m, re) || (!name.empty() && m[1].str() != name)) {
    return std::nullopt;
  }
  return m[2].str();
}

Status write_private(const std::string& path, const std::string& text, mode_t mode) {
  UniqueFd file(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode));
  if (!file.valid() && errno == EEXIST) {
    return already_exists(path + " exists; a key file is never overwritten");
  }
  if (!file.valid()) {
    return failed_precondition("cannot create " + path + ": " + std::strerror(errno));
  }
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(file.get(), text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return internal_error("cannot write " + path + ": " + std::strerror(errno));
    done += static_cast<size_t>(n);
  }
  // Closed here, not by the owner: a write the kernel deferred may fail only now.
  if (::close(file.release()) != 0) {
    return internal_error("cannot write " + path + ": " + std::strerror(errno));
  }
  return Status::ok();
}

}  // namespace

bool is_curve_key(std::string_view z85) {
  if (z85.size() != kCurveKeyChars) return false;
  for (char c : z85) {
    if (kZ85Alphabet.find(c) == std::string_view::npos) return false;
  }
  return true;
}

Expected<CurveKeyPair> generate_key_pair() {
  char pub[kCurveKeyChars + 1] = {};
  char sec[kCurveKeyChars + 1] = {};
  if (zmq_curve_keypair(pub, sec) != 0) {
    return internal_error(std::string("cannot make a CURVE key pair (is libzmq built with "
                                      "CURVE?): ") +
                          zmq_strerror(zmq_errno()));
  }
  return CurveKeyPair{pub, sec};
}

Status write_key_pair(const std::string& stem, const CurveKeyPair& keys) {
  const std::string header =
      "#   ZeroMQ CURVE certificate written by rd2h keygen\n"
      "#   Give the public one (.key) to the peers that should trust this one.\n\n"
      "metadata\ncurve\n";
  RD2H_RETURN_IF_ERROR(write_private(
      stem + ".key", header + "    public-key = \"" + keys.public_key + "\"\n", 0644));
  return write_private(stem + ".key_secret",
                       "#   SECRET: do not give this file to anyone; keep it mode 0600.\n" +
                           header + "    public-key = \"" + keys.public_key +
                           "\"\n    secret-key = \"" + keys.secret_key + "\"\n",
                       0600);
}

Expected<CurveKeyPair> read_secret_key_file(const std::string& path) {
  RD2H_TRY(text, read_file(path, "CURVE secret key file"));
  // A secret others can read is no secret: refused, as ssh refuses such a private key.
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && (st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return failed_precondition("the CURVE secret key file " + path +
                               " can be read or written by others (mode " + mode +
                               "); make it the owner's alone: chmod 600 " + path);
  }
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    auto secret = setting(line, "secret-key");
    if (!secret) continue;
    if (!is_curve_key(*secret)) {
      return invalid_argument("the CURVE secret key file " + path +
                              " holds a secret-key that is not 40 Z85 characters");
    }
    char pub[kCurveKeyChars + 1] = {};
    if (zmq_curve_public(pub, secret->c_str()) != 0) {
      return invalid_argument("the CURVE secret key in " + path + " is not a valid key");
    }
    return CurveKeyPair{pub, *secret};
  }
  return invalid_argument("the CURVE secret key file " + path +
                          " has no secret-key line (write one with `rd2h keygen`)");
}

Expected<std::vector<std::string>> read_public_keys_file(const std::string& path) {
  RD2H_TRY(text, read_file(path, "CURVE trusted keys file"));
  std::vector<std::string> keys;
  std::istringstream lines(text);
  std::string line;
  for (int number = 1; std::getline(lines, line); ++number) {
    // Z85 has '#' in its alphabet: a comment is a line that starts with '#' and is not a
    // key, or whatever follows a blank and '#'.
    for (size_t i = 1; i < line.size(); ++i) {
      if (line[i] == '#' && (line[i - 1] == ' ' || line[i - 1] == '\t')) {
        line.resize(i);
        break;
      }
    }
    const auto first = line.find_first_not_of(" \t\r");
    if (first == std::string::npos) continue;
    const auto last = line.find_last_not_of(" \t\r");
    const std::string word = line.substr(first, last - first + 1);
    if (word[0] == '#' && !is_curve_key(word)) continue;
    std::string key;
    if (auto pub = setting(line, "public-key")) {
      key = *pub;
    } else if (word == "metadata" || word == "curve" || setting(line, "")) {
      continue;  // the rest of a certificate
    } else {
      key = word;
    }
    if (!is_curve_key(key)) {
      return invalid_argument("the CURVE trusted keys file " + path + ", line " +
                              std::to_string(number) + ": not a 40-character Z85 public key");
    }
    keys.push_back(key);
  }
  if (keys.empty()) {
    return invalid_argument("the CURVE trusted keys file " + path + " holds no public key");
  }
  return keys;
}

bool is_loopback_host(std::string_view host) {
  if (host == "localhost") return true;
  const std::string h(host);
  in_addr v4{};
  if (inet_pton(AF_INET, h.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, h.c_str(), &v6) == 1) return IN6_IS_ADDR_LOOPBACK(&v6);
  return false;
}

bool is_wildcard_host(std::string_view host) {
  return host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]";
}

}  // namespace rd2h::control
