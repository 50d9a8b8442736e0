// The UCX engine against a real peer process, over shared memory and TCP on loopback.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>

#include "rd2h/common/deadline.h"
#include "rd2h/transfer/transfer_engine.h"
#include "transfer/fault_injecting_engine.h"
#include "transfer/peer_process.h"
#include "util/pattern.h"

namespace rd2h::transfer {
namespace {

using namespace std::chrono_literals;
using rd2h::testing::PeerProcess;
using rd2h::testing::start_peer;

constexpr auto kReadTimeout = 2000ms;

std::unique_ptr<TransferEngine> make_engine(Transport transport,
                                            ReadPath read_path = ReadPath::kAuto) {
  EngineConfig cfg;
  cfg.role = Role::kDecode;
  cfg.transport = transport;
  cfg.read_path = read_path;
  cfg.read_timeout = kReadTimeout;
  cfg.connect_timeout = 5000ms;
  auto e = create_ucx_engine(cfg);
  EXPECT_TRUE(e) << e.status().to_string();
  return e ? std::move(*e) : nullptr;
}

// Local destination memory, registered with the engine (caller-owned or engine-allocated).
struct Destination {
  TransferEngine* engine = nullptr;
  std::byte* base = nullptr;
  size_t size = 0;
  void* owned = nullptr;

  Destination(TransferEngine& e, size_t bytes, bool allocate) : engine(&e), size(bytes) {
    if (allocate) {
      auto r = e.allocate_memory(bytes);
      EXPECT_TRUE(r) << r.status().to_string();
      base = static_cast<std::byte*>(r->addr);
    } else {
      owned = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
      base = static_cast<std::byte*>(owned);
      EXPECT_TRUE(e.register_memory(base, bytes).is_ok());
    }
    std::memset(base, 0xab, bytes);
  }
  ~Destination() {
    EXPECT_TRUE(engine->unregister_memory(base).is_ok());
    std::free(owned);
  }
  bool untouched() const {
    return std::all_of(base, base + size, [](std::byte b) { return b == std::byte{0xab}; });
  }
};

// Reads source blocks `src[i]` into destination blocks `dst[i]`.
Status read_blocks(TransferEngine& e, const std::string& session, const PeerProcess& peer,
                   const Destination& dst, const std::vector<size_t>& src_blocks,
                   const std::vector<size_t>& dst_blocks) {
  std::vector<uintptr_t> local, remote;
  std::vector<size_t> len;
  for (size_t i = 0; i < src_blocks.size(); ++i) {
    local.push_back(reinterpret_cast<uintptr_t>(dst.base) + dst_blocks[i] * peer.block);
    remote.push_back(peer.base + src_blocks[i] * peer.block);
    len.push_back(peer.block);
  }
  return e.batch_read_sync(session, local, remote, len);
}

struct Case {
  Transport transport;
  const char* memory;  // how the source holds its region: "alloc" or "register"
  bool allocate_destination;
  ReadPath read_path = ReadPath::kAuto;
};

class EndToEnd : public ::testing::TestWithParam<Case> {};

TEST_P(EndToEnd, RandomNonContiguousBlocksArriveByteExact) {
  const Case c = GetParam();
  const std::string transport(to_string(c.transport));
  auto peer = start_peer(transport, c.memory, 64 * 1024 + 24, 48, 1000);
  ASSERT_TRUE(peer) << peer.status().to_string();
  auto engine = make_engine(c.transport, c.read_path);
  ASSERT_TRUE(engine);
  auto session = engine->connect(peer->metadata);
  ASSERT_TRUE(session) << session.status().to_string();

  auto info = engine->session_info(*session);
  ASSERT_TRUE(info);
  EXPECT_TRUE(info->colocated);
  if (c.transport == Transport::kTcp) {
    EXPECT_EQ(info->transport, "tcp");
  } else {
    EXPECT_EQ(info->transport.find("tcp"), std::string::npos)
        << "shared-memory session fell back to " << info->transport;
  }

  Destination dst(*engine, peer->block * 32, c.allocate_destination);
  std::mt19937 rng(7);
  for (int round = 0; round < 4; ++round) {
    std::vector<size_t> src(peer->blocks), dst_blocks(32);
    std::iota(src.begin(), src.end(), 0);
    std::shuffle(src.begin(), src.end(), rng);
    src.resize(12);
    std::iota(dst_blocks.begin(), dst_blocks.end(), 0);
    std::shuffle(dst_blocks.begin(), dst_blocks.end(), rng);
    dst_blocks.resize(12);
    std::memset(dst.base, 0xab, dst.size);
    ASSERT_TRUE(read_blocks(*engine, *session, *peer, dst, src, dst_blocks).is_ok());
    for (size_t i = 0; i < src.size(); ++i) {
      auto bad = find_pattern_mismatch(dst.base + dst_blocks[i] * peer->block, peer->block,
                                       peer->key + src[i]);
      ASSERT_FALSE(bad) << "source block " << src[i] << " byte " << *bad;
    }
    // Blocks not read into keep their old bytes.
    for (size_t b = 0; b < 32; ++b) {
      if (std::find(dst_blocks.begin(), dst_blocks.end(), b) != dst_blocks.end()) continue;
      const std::byte* p = dst.base + b * peer->block;
      ASSERT_TRUE(std::all_of(p, p + peer->block, [](std::byte x) { return x == std::byte{0xab}; }))
          << "destination block " << b << " was written";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, EndToEnd,
                         ::testing::Values(Case{Transport::kShm, "alloc", false},
                                           Case{Transport::kShm, "register", true},
                                           Case{Transport::kTcp, "alloc", true},
                                           Case{Transport::kTcp, "register", false},
                                           Case{Transport::kAuto, "alloc", false},
                                           // ucp_get, which the automatic choice keeps for
                                           // RDMA, here over UCX's emulation
                                           Case{Transport::kShm, "register", false, ReadPath::kRma},
                                           Case{Transport::kTcp, "register", true, ReadPath::kRma}),
                         [](const auto& info) {
                           return std::string(to_string(info.param.transport)) + "_" +
                                  info.param.memory + "_into_" +
                                  (info.param.allocate_destination ? "allocated" : "registered") +
                                  (info.param.read_path == ReadPath::kRma ? "_rma" : "");
                         });

class Engine : public ::testing::TestWithParam<Transport> {
 protected:
  void SetUp() override {
    auto p = start_peer(std::string(to_string(GetParam())), "alloc", 4096, 16, 1);
    ASSERT_TRUE(p) << p.status().to_string();
    peer_ = std::make_unique<PeerProcess>(std::move(*p));
    engine_ = make_engine(GetParam());
    ASSERT_TRUE(engine_);
    auto s = engine_->connect(peer_->metadata);
    ASSERT_TRUE(s) << s.status().to_string();
    session_ = *s;
  }

  std::unique_ptr<PeerProcess> peer_;
  std::unique_ptr<TransferEngine> engine_;
  std::string session_;
};

TEST_P(Engine, RemoteRangePastTheRegionIsRejectedAndNothingIsRead) {
  Destination dst(*engine_, 8192, false);
  const uintptr_t end = peer_->base + peer_->block * peer_->blocks;
  std::vector<uintptr_t> local{reinterpret_cast<uintptr_t>(dst.base),
                               reinterpret_cast<uintptr_t>(dst.base) + 4096};
  std::vector<uintptr_t> remote{peer_->base, end - 4095};  // the second runs one byte past
  std::vector<size_t> len{4096, 4096};
  Status st = engine_->batch_read_sync(session_, local, remote, len);
  ASSERT_EQ(st.code(), StatusCode::kOutOfRange) << st.to_string();
  char want[32];
  std::snprintf(want, sizeof(want), "0x%llx", static_cast<unsigned long long>(end - 4095));
  EXPECT_NE(st.message().find("read 1"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find(want), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("remote range"), std::string::npos) << st.message();
  EXPECT_TRUE(dst.untouched());
  // A rejected batch does not break the session.
  EXPECT_TRUE(engine_
                  ->batch_read_sync(session_, std::span(local).first(1), std::span(remote).first(1),
                                    std::span(len).first(1))
                  .is_ok());
  EXPECT_FALSE(find_pattern_mismatch(dst.base, 4096, peer_->key));
}

TEST_P(Engine, LocalRangeOutsideRegistrationsIsRejectedAndNothingIsRead) {
  Destination dst(*engine_, 8192, true);
  std::vector<uintptr_t> local{reinterpret_cast<uintptr_t>(dst.base),
                               reinterpret_cast<uintptr_t>(dst.base) + 8192 - 100};
  std::vector<uintptr_t> remote{peer_->base, peer_->base + 4096};
  std::vector<size_t> len{4096, 4096};
  Status st = engine_->batch_read_sync(session_, local, remote, len);
  ASSERT_EQ(st.code(), StatusCode::kOutOfRange) << st.to_string();
  EXPECT_NE(st.message().find("local range"), std::string::npos) << st.message();
  EXPECT_TRUE(dst.untouched());
}

TEST_P(Engine, MismatchedArraysAreRejected) {
  Destination dst(*engine_, 4096, false);
  std::vector<uintptr_t> local{reinterpret_cast<uintptr_t>(dst.base)};
  std::vector<uintptr_t> remote{peer_->base, peer_->base + 8};
  std::vector<size_t> len{8};
  Status st = engine_->batch_read_sync(session_, local, remote, len);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_TRUE(dst.untouched());
}

TEST_P(Engine, UnknownSessionIsNotFound) {
  std::vector<uintptr_t> a{0};
  std::vector<size_t> l{8};
  EXPECT_EQ(engine_->batch_read_sync("ucx:nobody:1:0", a, a, l).code(), StatusCode::kNotFound);
}

TEST_P(Engine, ADisconnectedSessionIsGone) {
  ASSERT_TRUE(engine_->disconnect(session_).is_ok());
  std::vector<uintptr_t> a{peer_->base};
  std::vector<size_t> l{8};
  EXPECT_EQ(engine_->batch_read_sync(session_, a, a, l).code(), StatusCode::kNotFound);
  EXPECT_EQ(engine_->disconnect(session_).code(), StatusCode::kNotFound);
  // and can be connected again
  auto again = engine_->connect(peer_->metadata);
  ASSERT_TRUE(again) << again.status().to_string();
  Destination dst(*engine_, 4096, false);
  std::vector<uintptr_t> local{reinterpret_cast<uintptr_t>(dst.base)};
  std::vector<size_t> len{4096};
  ASSERT_TRUE(engine_->batch_read_sync(*again, local, a, len).is_ok());
  EXPECT_FALSE(find_pattern_mismatch(dst.base, 4096, peer_->key));
}

TEST_P(Engine, ReconnectingALiveSessionReturnsTheSameId) {
  auto again = engine_->connect(peer_->metadata);
  ASSERT_TRUE(again);
  EXPECT_EQ(*again, session_);
}

TEST_P(Engine, PeerKilledBetweenReadsFailsTheNextReadWithinTheTimeout) {
  Destination dst(*engine_, 4096, false);
  std::vector<uintptr_t> local{reinterpret_cast<uintptr_t>(dst.base)};
  std::vector<uintptr_t> remote{peer_->base};
  std::vector<size_t> len{4096};
  ASSERT_TRUE(engine_->batch_read_sync(session_, local, remote, len).is_ok());

  peer_->process.kill(SIGKILL);
  ASSERT_TRUE(peer_->process.wait(10s));
  auto started = Deadline::Clock::now();
  Status st = engine_->batch_read_sync(session_, local, remote, len);
  auto took = Deadline::Clock::now() - started;
  EXPECT_FALSE(st.is_ok());
  EXPECT_TRUE(st.code() == StatusCode::kPeerDead || st.code() == StatusCode::kTimeout)
      << st.to_string();
  EXPECT_LE(took, kReadTimeout + 1s);

  auto info = engine_->session_info(session_);
  ASSERT_TRUE(info);
  EXPECT_TRUE(info->broken);
  EXPECT_EQ(engine_->batch_read_sync(session_, local, remote, len).code(),
            StatusCode::kFailedPrecondition);

  // The engine still serves other sessions.
  auto other = start_peer(std::string(to_string(GetParam())), "alloc", 4096, 4, 500);
  ASSERT_TRUE(other) << other.status().to_string();
  auto s2 = engine_->connect(other->metadata);
  ASSERT_TRUE(s2) << s2.status().to_string();
  remote[0] = other->base + 4096;
  ASSERT_TRUE(engine_->batch_read_sync(*s2, local, remote, len).is_ok());
  EXPECT_FALSE(find_pattern_mismatch(dst.base, 4096, 501));
}

TEST_P(Engine, ConnectingToAnExitedPeerFails) {
  auto meta = peer_->metadata;
  ASSERT_TRUE(engine_->disconnect(session_).is_ok());
  peer_->process.kill(SIGKILL);
  ASSERT_TRUE(peer_->process.wait(10s));
  auto s = engine_->connect(meta);
  ASSERT_FALSE(s);
  EXPECT_TRUE(s.status().code() == StatusCode::kPeerDead ||
              s.status().code() == StatusCode::kUnreachable)
      << s.status().to_string();
}

// Reads the source serves itself (TCP; shared memory from caller-registered memory) are
// checked against its registrations again when they arrive.
TEST(Refusal, ARangeThePeerNoLongerServesFailsTheRead) {
  for (const char* transport : {"tcp", "shm"}) {
    SCOPED_TRACE(transport);
    auto peer = start_peer(transport, "register", 4096, 4, 80);
    ASSERT_TRUE(peer) << peer.status().to_string();
    auto engine = make_engine(*parse_transport(transport));
    auto session = engine->connect(peer->metadata);
    ASSERT_TRUE(session) << session.status().to_string();
    Destination dst(*engine, 4096, false);
    std::vector<uintptr_t> local{reinterpret_cast<uintptr_t>(dst.base)};
    std::vector<uintptr_t> remote{peer->base + 4096};
    std::vector<size_t> len{4096};
    ASSERT_TRUE(engine->batch_read_sync(*session, local, remote, len).is_ok());

    ASSERT_TRUE(peer->process.write_line("unregister").is_ok());
    auto ack = peer->process.read_line(10s);
    ASSERT_TRUE(ack) << ack.status().to_string();
    ASSERT_EQ(*ack, "UNREGISTERED");
    std::memset(dst.base, 0xab, 4096);
    Status st = engine->batch_read_sync(*session, local, remote, len);
    EXPECT_EQ(st.code(), StatusCode::kOutOfRange) << st.to_string();
    EXPECT_NE(st.message().find("not registered"), std::string::npos) << st.message();
    EXPECT_TRUE(dst.untouched());
  }
}

TEST(Concurrency, ThreadsReadingDifferentSessionsDoNotInterfere) {
  constexpr int kThreads = 3;
  auto engine = make_engine(Transport::kTcp);
  std::vector<std::unique_ptr<PeerProcess>> peers;
  std::vector<std::string> sessions;
  for (int t = 0; t < kThreads; ++t) {
    auto p = start_peer(t % 2 == 0 ? "tcp" : "auto", "alloc", 16384, 16, 1000 * (t + 1));
    ASSERT_TRUE(p) << p.status().to_string();
    peers.push_back(std::make_unique<PeerProcess>(std::move(*p)));
  }
  // One engine per transport family: the tcp engine reads the tcp peers, an auto engine
  // reads the others, each from its own threads.
  auto auto_engine = make_engine(Transport::kAuto);
  std::vector<TransferEngine*> engines;
  for (int t = 0; t < kThreads; ++t) {
    TransferEngine* e = t % 2 == 0 ? engine.get() : auto_engine.get();
    auto s = e->connect(peers[t]->metadata);
    ASSERT_TRUE(s) << s.status().to_string();
    sessions.push_back(*s);
    engines.push_back(e);
  }
  std::vector<std::unique_ptr<Destination>> dst;
  for (int t = 0; t < kThreads; ++t) {
    dst.push_back(std::make_unique<Destination>(*engines[t], 16384 * 16, t == 0));
  }
  std::vector<std::string> errors(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<uintptr_t> local, remote;
      std::vector<size_t> len;
      for (size_t j = 0; j < 16; ++j) {
        local.push_back(reinterpret_cast<uintptr_t>(dst[t]->base) + j * 16384);
        remote.push_back(peers[t]->base + ((j * 5) % 16) * 16384);
        len.push_back(16384);
      }
      for (int round = 0; round < 50 && errors[t].empty(); ++round) {
        Status st = engines[t]->batch_read_sync(sessions[t], local, remote, len);
        if (!st) errors[t] = st.to_string();
        for (size_t j = 0; j < 16 && errors[t].empty(); ++j) {
          if (find_pattern_mismatch(dst[t]->base + j * 16384, 16384,
                                    peers[t]->key + (j * 5) % 16)) {
            errors[t] =
                "block " + std::to_string(j) + " corrupted in round " + std::to_string(round);
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(errors[t], "") << "thread " << t;
}

TEST_P(Engine, FaultInjectedFailureReadsNothingThenReadsResume) {
  auto shared = std::shared_ptr<TransferEngine>(std::move(engine_));
  FaultInjectingEngine faulty(shared);
  Destination dst(faulty, 4096, false);
  std::vector<uintptr_t> local{reinterpret_cast<uintptr_t>(dst.base)};
  std::vector<uintptr_t> remote{peer_->base + 3 * 4096};
  std::vector<size_t> len{4096};
  faulty.fail_next_reads(1, transport_error("link down"));
  Status st = faulty.batch_read_sync(session_, local, remote, len);
  EXPECT_EQ(st.code(), StatusCode::kTransport);
  EXPECT_EQ(st.message(), "link down");
  EXPECT_TRUE(dst.untouched());
  EXPECT_EQ(faulty.injected_failures(), 1);
  ASSERT_TRUE(faulty.batch_read_sync(session_, local, remote, len).is_ok());
  EXPECT_FALSE(find_pattern_mismatch(dst.base, 4096, peer_->key + 3));
}

// A peer with 8 blocks of 4096 bytes, an engine connected to it, and one-block reads.
class OneBlock : public ::testing::Test {
 protected:
  void start(Transport transport, uint64_t key, const char* memory = "alloc") {
    auto p = start_peer(std::string(to_string(transport)), memory, 4096, 8, key);
    ASSERT_TRUE(p) << p.status().to_string();
    peer_ = std::make_unique<PeerProcess>(std::move(*p));
    engine_ = make_engine(transport);
    auto s = engine_->connect(peer_->metadata);
    ASSERT_TRUE(s) << s.status().to_string();
    session_ = *s;
    dst_ = std::make_unique<Destination>(*engine_, 4096, false);
  }
  Status read(size_t block) {
    std::vector<uintptr_t> local{reinterpret_cast<uintptr_t>(dst_->base)};
    std::vector<uintptr_t> remote{peer_->base + block * 4096};
    std::vector<size_t> len{4096};
    return engine_->batch_read_sync(session_, local, remote, len);
  }
  bool holds_block(size_t block) const {
    return !find_pattern_mismatch(dst_->base, 4096, peer_->key + block);
  }

  std::unique_ptr<PeerProcess> peer_;
  std::unique_ptr<TransferEngine> engine_;
  std::string session_;
  std::unique_ptr<Destination> dst_;
};

TEST_F(OneBlock, ShmReadsOfEngineAllocatedMemoryNeedNoHelpFromThePeer) {
  ASSERT_NO_FATAL_FAILURE(start(Transport::kShm, 40));
  // A stopped process runs no thread at all, its progress thread included.
  ASSERT_TRUE(peer_->process.stop(10s).is_ok());
  Status st = read(5);
  peer_->process.kill(SIGCONT);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_TRUE(holds_block(5));
}

TEST_F(OneBlock, ShmReadsOfCallerRegisteredMemoryNeedNoHelpFromThePeer) {
  // A Prefill's own KV memory (registered, not allocated by the engine): its pages were
  // moved into shared memory this reader maps, so the stopped peer need not answer.
  ASSERT_NO_FATAL_FAILURE(start(Transport::kShm, 70, "register"));
  auto info = engine_->session_info(session_);
  ASSERT_TRUE(info);
  EXPECT_NE(info->transport.find("+mapped"), std::string::npos) << info->transport;
  ASSERT_TRUE(peer_->process.stop(10s).is_ok());
  Status st = read(6);
  peer_->process.kill(SIGCONT);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_TRUE(holds_block(6));
}

TEST_F(OneBlock, SilentTcpPeerTimesOutAndAnExplicitReconnectRecovers) {
  ASSERT_NO_FATAL_FAILURE(start(Transport::kTcp, 60));
  // Over TCP the peer's progress thread answers every read: a stopped peer cannot.
  ASSERT_TRUE(peer_->process.stop(10s).is_ok());
  Status st = read(2);
  peer_->process.kill(SIGCONT);
  ASSERT_EQ(st.code(), StatusCode::kTimeout) << st.to_string();
  EXPECT_TRUE(dst_->untouched());
  auto info = engine_->session_info(session_);
  ASSERT_TRUE(info);
  EXPECT_TRUE(info->broken);
  EXPECT_NE(info->broken_reason.find("took longer than"), std::string::npos) << info->broken_reason;
  // Broken stays broken until the caller reconnects.
  EXPECT_EQ(read(2).code(), StatusCode::kFailedPrecondition);

  auto again = engine_->connect(peer_->metadata);
  ASSERT_TRUE(again) << again.status().to_string();
  EXPECT_EQ(*again, session_);
  ASSERT_TRUE(read(2).is_ok());
  EXPECT_TRUE(holds_block(2));
  EXPECT_FALSE(engine_->session_info(session_)->broken);
}

INSTANTIATE_TEST_SUITE_P(Transports, Engine, ::testing::Values(Transport::kShm, Transport::kTcp),
                         [](const auto& info) { return std::string(to_string(info.param)); });

// A new reader connects to `peer` and reads every block of it, one at a time, intact.
void a_new_session_reads_every_block(Transport transport, const PeerProcess& peer) {
  auto engine = make_engine(transport);
  auto session = engine->connect(peer.metadata);
  ASSERT_TRUE(session) << session.status().to_string();
  Destination dst(*engine, peer.block, false);
  std::vector<uintptr_t> local{reinterpret_cast<uintptr_t>(dst.base)};
  std::vector<uintptr_t> remote{peer.base};
  std::vector<size_t> len{peer.block};
  for (size_t j = 0; j < peer.blocks; ++j) {
    remote[0] = peer.base + j * peer.block;
    ASSERT_TRUE(engine->batch_read_sync(*session, local, remote, len).is_ok()) << "block " << j;
    ASSERT_FALSE(find_pattern_mismatch(dst.base, peer.block, peer.key + j)) << "block " << j;
  }
}

// A reader loops over large batches while the peer is killed under it.
class KilledDuringReads : public ::testing::TestWithParam<Transport> {};
void reader_gets_an_error_within_the_timeout(Transport transport, const char* memory);

TEST_P(KilledDuringReads, ReaderGetsAnErrorWithinTheTimeout) {
  for (const char* memory : {"alloc", "register"}) {
    SCOPED_TRACE(memory);
    ASSERT_NO_FATAL_FAILURE(reader_gets_an_error_within_the_timeout(GetParam(), memory));
  }
}

void reader_gets_an_error_within_the_timeout(Transport transport, const char* memory) {
  const size_t block = 1 << 20, blocks = 64;
  auto peer = start_peer(std::string(to_string(transport)), memory, block, blocks, 3);
  ASSERT_TRUE(peer) << peer.status().to_string();
  auto engine = make_engine(transport);
  ASSERT_TRUE(engine);
  auto session = engine->connect(peer->metadata);
  ASSERT_TRUE(session) << session.status().to_string();
  Destination dst(*engine, block * blocks, true);

  std::vector<uintptr_t> local, remote;
  std::vector<size_t> len;
  for (size_t i = 0; i < blocks; ++i) {
    local.push_back(reinterpret_cast<uintptr_t>(dst.base) + i * block);
    remote.push_back(peer->base + ((i * 7) % blocks) * block);
    len.push_back(block);
  }

  std::mutex mu;
  std::condition_variable cv;
  int successes = 0;
  Status last;
  Deadline::Clock::time_point failed_at;
  std::thread reader([&] {
    Deadline give_up(60s);
    while (!give_up.expired()) {
      Status st = engine->batch_read_sync(*session, local, remote, len);
      std::lock_guard lock(mu);
      if (!st.is_ok()) {
        last = st;
        failed_at = Deadline::Clock::now();
        break;
      }
      ++successes;
      cv.notify_all();
    }
    cv.notify_all();
  });
  {
    std::unique_lock lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, 30s, [&] { return successes > 0 || !last.is_ok(); }));
  }
  peer->process.kill(SIGKILL);
  auto killed_at = Deadline::Clock::now();
  reader.join();
  ASSERT_FALSE(last.is_ok()) << "reads kept succeeding after the peer was killed";
  EXPECT_TRUE(last.code() == StatusCode::kPeerDead || last.code() == StatusCode::kTimeout ||
              last.code() == StatusCode::kTransport)
      << last.to_string();
  EXPECT_LE(failed_at - killed_at, kReadTimeout + 1s) << last.to_string();
  auto info = engine->session_info(*session);
  ASSERT_TRUE(info);
  EXPECT_TRUE(info->broken);
}

// The reader's side fails: its batch times out mid-transfer and it tears down the session
// while the source is still sending. The source must survive and serve the next reader.
TEST_P(KilledDuringReads, SourceSurvivesAReaderThatGivesUpMidTransfer) {
  const size_t block = 1 << 20, blocks = 64;
  auto peer = start_peer(std::string(to_string(GetParam())), "register", block, blocks, 11);
  ASSERT_TRUE(peer) << peer.status().to_string();
  std::vector<uintptr_t> local, remote;
  std::vector<size_t> len;
  {
    EngineConfig cfg;
    cfg.role = Role::kDecode;
    cfg.transport = GetParam();
    cfg.read_timeout = 1ms;  // far shorter than 64 MiB takes over TCP
    auto impatient = create_ucx_engine(cfg);
    ASSERT_TRUE(impatient) << impatient.status().to_string();
    auto session = (*impatient)->connect(peer->metadata);
    ASSERT_TRUE(session) << session.status().to_string();
    Destination dst(**impatient, block * blocks, true);
    for (size_t i = 0; i < blocks; ++i) {
      local.push_back(reinterpret_cast<uintptr_t>(dst.base) + i * block);
      remote.push_back(peer->base + i * block);
      len.push_back(block);
    }
    Status st = (*impatient)->batch_read_sync(*session, local, remote, len);
    if (GetParam() == Transport::kTcp) {
      EXPECT_EQ(st.code(), StatusCode::kTimeout) << st.to_string();
    }
  }  // the impatient reader's engine is destroyed here, mid-transfer or just after

  auto alive = peer->process.wait(200ms);
  ASSERT_FALSE(alive) << "the source exited with status " << *alive;
  auto engine = make_engine(GetParam());
  auto session = engine->connect(peer->metadata);
  ASSERT_TRUE(session) << session.status().to_string();
  Destination dst(*engine, block * blocks, true);
  for (size_t i = 0; i < blocks; ++i) local[i] = reinterpret_cast<uintptr_t>(dst.base) + i * block;
  ASSERT_TRUE(engine->batch_read_sync(*session, local, remote, len).is_ok());
  for (size_t i = 0; i < blocks; ++i) {
    ASSERT_FALSE(find_pattern_mismatch(dst.base + i * block, block, 11 + i)) << "block " << i;
  }
}

// A reader process is killed while its reads are in flight. The source, like a Prefill
// whose Decode crashed, must survive and keep serving. Over TCP the source serves every
// read (caller-registered memory); over shared memory its engine-allocated region is read
// without its help.
TEST_P(KilledDuringReads, SourceSurvivesAKilledReaderProcess) {
  const bool tcp = GetParam() == Transport::kTcp;
  auto peer =
      start_peer(std::string(to_string(GetParam())), tcp ? "register" : "alloc", 1 << 20, 32, 21);
  ASSERT_TRUE(peer) << peer.status().to_string();
  for (int round = 0; round < 3; ++round) {
    auto reader = rd2h::testing::start_reader(std::string(to_string(GetParam())), *peer);
    ASSERT_TRUE(reader) << reader.status().to_string();
    reader->kill(SIGKILL);
    ASSERT_TRUE(reader->wait(10s));
  }
  ASSERT_NO_FATAL_FAILURE(a_new_session_reads_every_block(GetParam(), *peer));
  auto exited = peer->process.wait(0ms);
  EXPECT_FALSE(exited) << "the source exited with status " << *exited;
}

// The same over shared memory from caller-registered memory, which readers map: killed
// readers never leave the source unable to take new sessions.
TEST(KilledReaders, ASourceOfRegisteredMemoryKeepsTakingNewSessions) {
  auto peer = start_peer("shm", "register", 1 << 20, 32, 23);
  ASSERT_TRUE(peer) << peer.status().to_string();
  for (int round = 0; round < 5; ++round) {
    auto reader = rd2h::testing::start_reader("shm", *peer);
    ASSERT_TRUE(reader) << reader.status().to_string();
    reader->kill(SIGKILL);
    ASSERT_TRUE(reader->wait(10s));
  }
  ASSERT_NO_FATAL_FAILURE(a_new_session_reads_every_block(Transport::kShm, *peer));
}

INSTANTIATE_TEST_SUITE_P(Transports, KilledDuringReads,
                         ::testing::Values(Transport::kShm, Transport::kTcp),
                         [](const auto& info) { return std::string(to_string(info.param)); });

class Registration : public ::testing::Test {
 protected:
  std::unique_ptr<TransferEngine> engine_ = make_engine(Transport::kShm);
};

TEST_F(Registration, ZeroLengthIsRejected) {
  char buf[64];
  Status st = engine_->register_memory(buf, 0);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("zero-length"), std::string::npos);
  EXPECT_FALSE(engine_->allocate_memory(0));
}

TEST_F(Registration, OverlappingRangesAreRejected) {
  std::vector<char> buf(16384);
  ASSERT_TRUE(engine_->register_memory(buf.data() + 4096, 4096).is_ok());
  for (auto [offset, length] :
       {std::pair<size_t, size_t>{0, 4097}, {8191, 10}, {4096, 1}, {5000, 100}, {0, 16384}}) {
    Status st = engine_->register_memory(buf.data() + offset, length);
    EXPECT_EQ(st.code(), StatusCode::kAlreadyExists) << offset << "+" << length;
    EXPECT_NE(st.message().find("overlaps"), std::string::npos) << st.message();
  }
  EXPECT_TRUE(engine_->register_memory(buf.data(), 4096).is_ok());         // adjacent below
  EXPECT_TRUE(engine_->register_memory(buf.data() + 8192, 4096).is_ok());  // adjacent above
  EXPECT_TRUE(engine_->unregister_memory(buf.data()).is_ok());
  EXPECT_TRUE(engine_->unregister_memory(buf.data() + 4096).is_ok());
  EXPECT_TRUE(engine_->unregister_memory(buf.data() + 8192).is_ok());
}

TEST_F(Registration, UnregisteringAnUnknownAddressIsNotFound) {
  char buf[64];
  EXPECT_EQ(engine_->unregister_memory(buf).code(), StatusCode::kNotFound);
}

TEST_F(Registration, ExportedMetadataListsRegions) {
  auto a = engine_->allocate_memory(1 << 20);
  ASSERT_TRUE(a);
  auto meta = engine_->export_metadata();
  ASSERT_TRUE(meta);
  EXPECT_GT(meta->size(), 64u);
  EXPECT_TRUE(engine_->unregister_memory(a->addr).is_ok());
}

TEST_F(Registration, GarbageAndTruncatedMetadataAreConnectErrors) {
  std::vector<std::byte> garbage(100, std::byte{7});
  auto s = engine_->connect(garbage);
  ASSERT_FALSE(s);
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidMetadata);

  auto a = engine_->allocate_memory(4096);
  ASSERT_TRUE(a);
  auto meta = engine_->export_metadata();
  ASSERT_TRUE(meta);
  for (size_t n : {size_t{0}, size_t{7}, size_t{20}, meta->size() / 2, meta->size() - 1}) {
    auto t = engine_->connect(std::span(meta->data(), n));
    ASSERT_FALSE(t) << "prefix of " << n;
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidMetadata);
  }
  EXPECT_TRUE(engine_->unregister_memory(a->addr).is_ok());
}

// A Prefill engine's registration moves the caller's pages into shared memory in place:
// the caller keeps its addresses and bytes, what it writes afterwards is what readers get,
// and memory that cannot move (shared already) stays as it was and is still served.
class SharedRegistration : public ::testing::Test {
 protected:
  static constexpr size_t kBytes = 3 * 4096 + 100;  // not a whole number of pages
  std::unique_ptr<TransferEngine> prefill_ = [] {
    EngineConfig cfg;
    cfg.role = Role::kPrefill;
    cfg.transport = Transport::kShm;
    auto e = create_ucx_engine(cfg);
    EXPECT_TRUE(e) << e.status().to_string();
    return e ? std::move(*e) : nullptr;
  }();
  std::unique_ptr<TransferEngine> reader_ = make_engine(Transport::kShm);

  // Reads [base, base+kBytes) from the Prefill engine; the session's transport.
  std::string read_all(const std::byte* base, Destination& dst) {
    auto meta = prefill_->export_metadata();
    EXPECT_TRUE(meta);
    auto session = reader_->connect(*meta);
    EXPECT_TRUE(session) << session.status().to_string();
    if (!session) return "";
    std::vector<uintptr_t> local{reinterpret_cast<uintptr_t>(dst.base)};
    std::vector<uintptr_t> remote{reinterpret_cast<uintptr_t>(base)};
    std::vector<size_t> len{kBytes};
    Status st = reader_->batch_read_sync(*session, local, remote, len);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    return reader_->session_info(*session)->transport;
  }
};

TEST_F(SharedRegistration, TheCallerKeepsItsAddressAndBytesAndReadersSeeItsLaterWrites) {
  // Private memory with neighbours on its first and last pages.
  auto* pages = static_cast<std::byte*>(std::aligned_alloc(4096, 5 * 4096));
  std::byte* kv = pages + 1000;
  fill_pattern(pages, 5 * 4096, 91);
  ASSERT_TRUE(prefill_->register_memory(kv, kBytes).is_ok());
  EXPECT_FALSE(find_pattern_mismatch(pages, 5 * 4096, 91))
      << "the range or its neighbours changed when it registered";
  fill_pattern(kv, kBytes, 92);  // the caller computes into its memory
  Destination dst(*reader_, kBytes, false);
  EXPECT_NE(read_all(kv, dst).find("+mapped"), std::string::npos);
  EXPECT_FALSE(find_pattern_mismatch(dst.base, kBytes, 92));
  ASSERT_TRUE(prefill_->unregister_memory(kv).is_ok());
  fill_pattern(pages, 5 * 4096, 93);  // still ordinary memory of the caller's
  EXPECT_FALSE(find_pattern_mismatch(pages, 5 * 4096, 93));
  std::free(pages);
}

TEST_F(SharedRegistration, MemoryAlreadySharedStaysAsItWasAndIsServedByThePeer) {
  void* shared =
      ::mmap(nullptr, 4 * 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(shared, MAP_FAILED);
  auto* kv = static_cast<std::byte*>(shared);
  fill_pattern(kv, kBytes, 94);
  ASSERT_TRUE(prefill_->register_memory(kv, kBytes).is_ok());
  Destination dst(*reader_, kBytes, false);
  EXPECT_EQ(read_all(kv, dst).find("+mapped"), std::string::npos);
  EXPECT_FALSE(find_pattern_mismatch(dst.base, kBytes, 94));
  ASSERT_TRUE(prefill_->unregister_memory(kv).is_ok());
  ::munmap(shared, 4 * 4096);
}

TEST_F(SharedRegistration, WithTheOptOutMemoryStaysPrivate) {
  EngineConfig cfg;
  cfg.role = Role::kPrefill;
  cfg.transport = Transport::kShm;
  cfg.share_registered = false;
  auto kept = create_ucx_engine(cfg);
  ASSERT_TRUE(kept) << kept.status().to_string();
  auto* kv = static_cast<std::byte*>(std::aligned_alloc(4096, 4 * 4096));
  fill_pattern(kv, kBytes, 95);
  ASSERT_TRUE((*kept)->register_memory(kv, kBytes).is_ok());
  auto meta = (*kept)->export_metadata();
  ASSERT_TRUE(meta);
  auto session = reader_->connect(*meta);
  ASSERT_TRUE(session) << session.status().to_string();
  EXPECT_EQ(reader_->session_info(*session)->transport.find("+mapped"), std::string::npos);
  ASSERT_TRUE((*kept)->unregister_memory(kv).is_ok());
  std::free(kv);
}

TEST(EngineConfig, BadValuesAreRejected) {
  EngineConfig cfg;
  cfg.read_timeout = 0ms;
  auto e = create_ucx_engine(cfg);
  ASSERT_FALSE(e);
  EXPECT_NE(e.status().message().find("read_timeout"), std::string::npos);
  EXPECT_FALSE(parse_transport("rdma"));
  EXPECT_NE(parse_transport("rdma").status().message().find("rdma"), std::string::npos);
  EXPECT_FALSE(parse_role("router"));
}

}  // namespace
}  // namespace rd2h::transfer
