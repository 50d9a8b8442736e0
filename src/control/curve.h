// ZeroMQ CURVE keys and the trust they carry (ARCHITECTURE "Trust"). A key is 40 Z85
// characters. Key files use ZeroMQ's certificate format (as czmq's zcert writes it):
// `public-key = "..."` and, in the secret file only, `secret-key = "..."`.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "rd2h/common/status.h"

namespace rd2h::control {

inline constexpr size_t kCurveKeyChars = 40;

struct CurveKeyPair {
  std::string public_key;  // Z85
  std::string secret_key;  // Z85
};

// A Decode ROUTER with these keys accepts only clients whose public key is trusted.
struct ServerSecurity {
  CurveKeyPair self;
  std::vector<std::string> trusted_clients;
};

// A Prefill DEALER with these keys talks only to the server holding `server_key`.
struct ClientSecurity {
  CurveKeyPair self;
  std::string server_key;
};

bool is_curve_key(std::string_view z85);
Expected<CurveKeyPair> generate_key_pair();

// Writes `stem`.key (the public certificate) and `stem`.key_secret (mode 0600). An existing
// file is never overwritten.
Status write_key_pair(const std::string& stem, const CurveKeyPair& keys);
// The key pair of a secret certificate (the public key is derived from the secret one).
Expected<CurveKeyPair> read_secret_key_file(const std::string& path);
// Every public key of a file: certificates' `public-key = "..."` lines, or bare keys one per
// line; `#` starts a comment. A file without any key is an error.
Expected<std::vector<std::string>> read_public_keys_file(const std::string& path);

// Whether `host` names this machine's loopback (127.0.0.0/8, ::1, localhost).
bool is_loopback_host(std::string_view host);
// Whether `host` is a wildcard address (empty, 0.0.0.0, ::): one to bind on, never one a
// peer can be told to reach.
bool is_wildcard_host(std::string_view host);

}  // namespace rd2h::control
