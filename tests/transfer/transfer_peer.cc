// A source endpoint for engine tests, run as a separate process. It registers (or has the
// engine allocate) a region of --blocks blocks of --block bytes, fills block j with the
// pattern of key --key + j, prints "META <hex metadata>" and "BASE <hex address>", then
// serves reads until its stdin closes.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>

#include "rd2h/common/pattern.h"
#include "rd2h/transfer/transfer_engine.h"

using namespace rd2h;
using namespace rd2h::transfer;

int main(int argc, char** argv) {
  std::string transport = "shm", memory = "alloc";
  size_t block = 65536, blocks = 16;
  uint64_t key = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--transport")
      transport = value;
    else if (flag == "--memory")
      memory = value;
    else if (flag == "--block")
      block = std::stoull(value);
    else if (flag == "--blocks")
      blocks = std::stoull(value);
    else if (flag == "--key")
      key = std::stoull(value);
    else {
      std::cerr << "transfer_peer: unknown flag " << flag << "\n";
      return 2;
    }
  }
  EngineConfig cfg;
  cfg.role = Role::kPrefill;
  cfg.transport = *parse_transport(transport);
  auto engine = create_ucx_engine(cfg);
  if (!engine) {
    std::cerr << "transfer_peer: " << engine.status().to_string() << "\n";
    return 1;
  }
  size_t size = block * blocks;
  void* base = nullptr;
  if (memory == "alloc") {
    auto region = (*engine)->allocate_memory(size);
    if (!region) {
      std::cerr << "transfer_peer: " << region.status().to_string() << "\n";
      return 1;
    }
    base = region->addr;
  } else {
    base = std::aligned_alloc(4096, (size + 4095) / 4096 * 4096);
    auto st = (*engine)->register_memory(base, size);
    if (!st) {
      std::cerr << "transfer_peer: " << st.to_string() << "\n";
      return 1;
    }
  }
  for (size_t j = 0; j < blocks; ++j) {
    fill_pattern(static_cast<char*>(base) + j * block, block, key + j);
  }
  auto meta = (*engine)->export_metadata();
  std::string hex;
  static const char* digits = "0123456789abcdef";
  for (std::byte b : *meta) {
    hex += digits[std::to_integer<int>(b) >> 4];
    hex += digits[std::to_integer<int>(b) & 15];
  }
  std::printf("META %s\nBASE %llx\n", hex.c_str(),
              static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(base)));
  std::fflush(stdout);
  char c;
  while (::read(STDIN_FILENO, &c, 1) > 0) {
  }
  engine->reset();
  if (memory != "alloc") std::free(base);
  return 0;
}
