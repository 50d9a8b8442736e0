// A peer process for engine tests.
//
// Source (default): registers (or has the engine allocate) --blocks blocks of --block bytes,
// fills block j with the pattern of key --key + j, prints "META <hex metadata>" and
// "BASE <hex address>", then serves reads. Each stdin line is a command: "unregister"
// unregisters the region and answers "UNREGISTERED". It exits when stdin closes.
//
// Reader (--read-from <hex metadata> --remote-base <hex address>): connects and reads all
// blocks again and again, printing "READING" after the first batch that verified; it runs
// until killed, or exits 1 on the first failed batch.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "rd2h/transfer/transfer_engine.h"
#include "transfer/hex.h"
#include "util/pattern.h"

using namespace rd2h;
using namespace rd2h::transfer;

namespace {

struct Options {
  std::string transport = "shm", memory = "alloc", read_from;
  size_t block = 65536, blocks = 16;
  uint64_t key = 1, remote_base = 0;
};

int fail(const std::string& what) {
  std::cerr << "transfer_peer: " << what << "\n";
  return 1;
}

int serve(TransferEngine& engine, const Options& o) {
  const size_t size = o.block * o.blocks;
  void* base = nullptr;
  void* owned = nullptr;
  if (o.memory == "alloc") {
    auto region = engine.allocate_memory(size);
    if (!region) return fail(region.status().to_string());
    base = region->addr;
  } else {
    owned = base = std::aligned_alloc(4096, (size + 4095) / 4096 * 4096);
    if (Status st = engine.register_memory(base, size); !st) return fail(st.to_string());
  }
  for (size_t j = 0; j < o.blocks; ++j) {
    fill_pattern(static_cast<char*>(base) + j * o.block, o.block, o.key + j);
  }
  auto meta = engine.export_metadata();
  if (!meta) return fail(meta.status().to_string());
  std::printf("META %s\nBASE %llx\n", testing::to_hex(*meta).c_str(),
              static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(base)));
  std::fflush(stdout);
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line == "unregister") {
      if (Status st = engine.unregister_memory(base); !st) return fail(st.to_string());
      std::printf("UNREGISTERED\n");
      std::fflush(stdout);
    }
  }
  std::free(owned);
  return 0;
}

int read_forever(TransferEngine& engine, const Options& o) {
  auto session = engine.connect(testing::from_hex(o.read_from));
  if (!session) return fail(session.status().to_string());
  auto region = engine.allocate_memory(o.block * o.blocks);
  if (!region) return fail(region.status().to_string());
  std::vector<transfer::ReadOp> ops;
  for (size_t j = 0; j < o.blocks; ++j) {
    ops.push_back({reinterpret_cast<uintptr_t>(region->addr) + j * o.block,
                   o.remote_base + j * o.block, o.block});
  }
  for (bool first = true;; first = false) {
    if (Status st = engine.batch_read_sync(*session, ops); !st) {
      return fail(st.to_string());
    }
    if (first) {
      for (size_t j = 0; j < o.blocks; ++j) {
        if (find_pattern_mismatch(reinterpret_cast<void*>(ops[j].local), o.block, o.key + j)) {
          return fail("block " + std::to_string(j) + " arrived corrupted");
        }
      }
      std::printf("READING\n");
      std::fflush(stdout);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--transport") {
      o.transport = value;
    } else if (flag == "--memory") {
      o.memory = value;
    } else if (flag == "--block") {
      o.block = std::stoull(value);
    } else if (flag == "--blocks") {
      o.blocks = std::stoull(value);
    } else if (flag == "--key") {
      o.key = std::stoull(value);
    } else if (flag == "--read-from") {
      o.read_from = value;
    } else if (flag == "--remote-base") {
      o.remote_base = std::stoull(value, nullptr, 16);
    } else {
      return fail("unknown flag " + flag);
    }
  }
  auto transport = parse_transport(o.transport);
  if (!transport) return fail(transport.status().to_string());
  EngineConfig cfg;
  cfg.role = o.read_from.empty() ? Role::kPrefill : Role::kDecode;
  cfg.transport = *transport;
  auto engine = create_ucx_engine(cfg);
  if (!engine) return fail(engine.status().to_string());
  return o.read_from.empty() ? serve(**engine, o) : read_forever(**engine, o);
}
