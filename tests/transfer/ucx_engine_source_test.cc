// The UCX engine as a source: its memory registration (moved into shared memory for readers),
// reads that need no help from a stopped peer, and sources and readers killed mid-transfer.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>

#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

#include "rd2h/common/deadline.h"
#include "rd2h/transfer/transfer_engine.h"
#include "transfer/peer_process.h"
#include "transfer/ucx_engine_fixture.h"
#include "util/pattern.h"

namespace rd2h::transfer {
namespace {

using namespace std::chrono_literals;
using rd2h::testing::Destination;
using rd2h::testing::kReadTimeout;
using rd2h::testing::make_engine;
using rd2h::testing::PeerProcess;
using rd2h::testing::reads;
using rd2h::testing::start_peer;

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
    return engine_->batch_read_sync(session_, reads(local, remote, len));
  }
  bool holds_block(size_t block) const {
    return !find_pattern_mismatch(dst_->base, 4096, peer_->key + block);
  }

  std::unique_ptr<PeerProcess> peer_;
  std::unique_ptr<TransferEngine> engine_;
  transfer::SessionHandle session_;
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
  EXPECT_EQ(again->id, session_.id);
  EXPECT_NE(again->state, session_.state) << "a broken session was handed out again";
  EXPECT_TRUE(engine_->session_info(session_)->broken) << "the old handle reads as broken";
  session_ = *again;
  ASSERT_TRUE(read(2).is_ok());
  EXPECT_TRUE(holds_block(2));
  EXPECT_FALSE(engine_->session_info(session_)->broken);
}

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
    ASSERT_TRUE(engine->batch_read_sync(*session, reads(local, remote, len)).is_ok())
        << "block " << j;
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
      Status st = engine->batch_read_sync(*session, reads(local, remote, len));
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
    Status st = (*impatient)->batch_read_sync(*session, reads(local, remote, len));
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
  ASSERT_TRUE(engine->batch_read_sync(*session, reads(local, remote, len)).is_ok());
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
    Status st = reader_->batch_read_sync(*session, reads(local, remote, len));
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

// This process's shared memory pages mapped (RssShmem), in bytes: a page mapped at two
// addresses counts twice.
size_t mapped_shared_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("RssShmem:", 0) == 0) return std::stoull(line.substr(9)) * 1024;
  }
  ADD_FAILURE() << "/proc/self/status has no RssShmem";
  return 0;
}

TEST_F(SharedRegistration, AReaderMapsOnlyThePagesItReads) {
  // A KV cache the reader reads little of: connecting maps none of its pages (a whole
  // cache faulted in at connect costs seconds per GiB on a small host), and a read maps
  // the pages it touches.
  constexpr size_t kCache = 128 << 20;
  auto* kv = static_cast<std::byte*>(std::aligned_alloc(4096, kCache));
  fill_pattern(kv, kCache, 96);
  ASSERT_TRUE(prefill_->register_memory(kv, kCache).is_ok());
  const size_t before = mapped_shared_bytes();
  Destination dst(*reader_, kBytes, false);
  EXPECT_NE(read_all(kv + kCache / 2, dst).find("+mapped"), std::string::npos);
  EXPECT_EQ(std::memcmp(dst.base, kv + kCache / 2, kBytes), 0);
  const size_t grown = mapped_shared_bytes() - before;
  // UCX's own shared segments of a new connection (FIFOs) are a few MiB of it.
  EXPECT_LT(grown, kCache / 8) << "connecting and one read mapped " << grown << " bytes of a "
                               << kCache << "-byte cache";
  ASSERT_TRUE(prefill_->unregister_memory(kv).is_ok());
  std::free(kv);
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
