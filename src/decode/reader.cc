#include "decode/reader.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>

#include "decode/layer_meta.h"
#include "layout/cache.h"
#include "protocol/message_tags.h"
#include "rd2h/common/trace.h"
#include "util/log.h"

namespace rd2h::decode {
namespace {

// Prefill and Decode must run the same model: the same cache layers by name. Names the
// counts and the first layer found on one side only.
template <typename PrefillLayers>
Status check_same_layers(const PrefillLayers& prefill, const DecodeLayout& decode) {
  auto first_missing = [](const auto& from, const auto& in) -> std::optional<std::string> {
    for (const auto& entry : from) {
      if (in.count(entry.first) == 0) return entry.first;
    }
    return std::nullopt;
  };
  const auto only_prefill = first_missing(prefill, decode);
  const auto only_decode = first_missing(decode, prefill);
  if (!only_prefill && !only_decode) return Status::ok();
  std::string why = "Prefill's model has " + std::to_string(prefill.size()) +
                    " cache layers, this Decode's has " + std::to_string(decode.size());
  if (only_decode) why += "; layer '" + *only_decode + "' is not in Prefill's MF_META";
  if (only_prefill) why += "; layer '" + *only_prefill + "' is not in Decode's cache";
  return failed_precondition(why + " (another model?)");
}

}  // namespace

Expected<std::unique_ptr<Reader>> Reader::start(ReaderConfig config,
                                                std::shared_ptr<transfer::TransferEngine> engine,
                                                DecodeLayout layout,
                                                std::shared_ptr<control::Context> context) {
  if (config.d_rank < 0 || config.d_rank >= config.d_tp) {
    return invalid_argument("Decode rank " + std::to_string(config.d_rank) + " is outside 0.." +
                            std::to_string(config.d_tp - 1));
  }
  RD2H_TRY(router, control::RouterChannel::bind(std::move(context), config.host, config.port,
                                                config.security));
  router->deliver_malformed(true);  // answered where they can be (handle_undecodable)
  auto connects = std::make_shared<ConnectQueue>();
  connects->fd.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!connects->fd.valid()) return internal_error("cannot create the reader's wake-up fd");
  auto reader = std::unique_ptr<Reader>(
      new Reader(std::move(config), std::move(engine), std::move(layout), std::move(router)));
  reader->connects_ = std::move(connects);
  reader->connect_thread_ = std::thread([r = reader.get()] { r->connect_loop(); });
  reader->thread_ = std::thread([r = reader.get()] { r->run(); });
  return reader;
}

Reader::Reader(ReaderConfig config, std::shared_ptr<transfer::TransferEngine> engine,
               DecodeLayout layout, std::unique_ptr<control::RouterChannel> router)
    : config_(std::move(config)),
      engine_(std::move(engine)),
      layout_(std::move(layout)),
      router_(std::move(router)),
      links_(config_.control_link ? engine_ : nullptr) {}

Reader::~Reader() {
  stopping_.store(true);
  if (thread_.joinable()) thread_.join();
  {
    std::lock_guard lock(connects_->mu);
    connects_->stopping = true;
  }
  connects_->cv.notify_all();
  if (connect_thread_.joinable()) connect_thread_.join();  // a connect ends in connect_timeout
  // Links opened for connections that went meanwhile have no path to close them.
  for (const auto& d : connects_->done) {
    if (d.link) engine_->close_notifications(*d.link);
  }
}

void Reader::connect_loop() {
  ConnectQueue& q = *connects_;
  for (;;) {
    ConnectJob job;
    {
      std::unique_lock lock(q.mu);
      while (!q.stopping && q.jobs.empty()) q.cv.wait_for(lock, std::chrono::seconds(1));
      if (q.stopping) return;
      job = std::move(q.jobs.front());
      q.jobs.pop_front();
    }
    Connected d;
    d.job = job.job;
    d.identity = job.identity;
    d.session = engine_->connect(job.backend_metadata);
    // Before the ACK: the link is open on Prefill's side by the time its first readiness
    // goes.
    if (d.session && job.link) {
      d.link_status = engine_->open_notifications(*d.session, *job.link);
      if (d.link_status.is_ok()) d.link = job.link;
    }
    {
      std::lock_guard lock(q.mu);
      q.done.push_back(std::move(d));
    }
    uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(q.fd.get(), &one, sizeof(one));
  }
}

void Reader::finish_connects() {
  uint64_t signalled = 0;
  [[maybe_unused]] auto n = ::read(connects_->fd.get(), &signalled, sizeof(signalled));
  std::deque<Connected> done;
  {
    std::lock_guard lock(connects_->mu);
    done.swap(connects_->done);
  }
  for (auto& d : done) {
    auto it = connecting_.find(d.identity);
    if (it == connecting_.end() || it->second.job != d.job) {
      // The connection closed, or sent MF_META again, meanwhile: this answer is no one's
      // (and the path of its link is gone).
      if (d.link) engine_->close_notifications(*d.link);
      continue;
    }
    Connecting c = std::move(it->second);
    connecting_.erase(it);
    const std::string& identity = d.identity;
    if (!d.session) {
      refuse_mf_meta(identity,
                     d.session.status().with_context("connecting to " + c.p_session).message());
    } else {
      c.peer.session = std::move(*d.session);
      if (d.link) {
        paths_of(identity).link = std::move(c.link);
        count(&Counters::links_opened);
      } else if (!d.link_status.is_ok()) {
        // The connection stays on ZeroMQ: slower, not wrong.
        log::info("decode reader {}: no transfer link to {}: {}", config_.d_rank, c.peer.session.id,
                  d.link_status.message());
      }
      const bool commits = c.peer.commits;
      if (auto old = peers_.find(identity); old != peers_.end()) {
        // MF_META again on a connection: what the old one left uncommitted never will be.
        std::lock_guard lock(mu_);
        for (const auto& [ext_id, signal] : old->second.uncommitted) tracker_.on_failed(ext_id);
      }
      peers_[identity] = std::move(c.peer);
      set_connections();
      const std::string_view ack = commits ? protocol::kAckCommitPayload : protocol::kAckPayload;
      reply(identity,
            std::vector<std::byte>(reinterpret_cast<const std::byte*>(ack.data()),
                                   reinterpret_cast<const std::byte*>(ack.data()) + ack.size()));
    }
    // What the connection sent meanwhile, in order; behind an MF_META among it that starts
    // another connect, the rest waits again.
    while (!c.waiting.empty()) {
      control::Inbound in = std::move(c.waiting.front());
      c.waiting.pop_front();
      if (auto again = connecting_.find(identity); again != connecting_.end()) {
        again->second.waiting.push_back(std::move(in));
      } else {
        handle(in);
      }
    }
  }
}

Status Reader::add_request(const std::string& ext_id, const std::string& internal_id,
                           std::vector<int64_t> main_blocks, std::vector<int64_t> indexer_blocks,
                           std::chrono::steady_clock::time_point arrival_deadline) {
  std::lock_guard lock(mu_);
  return tracker_.add_request(
      ext_id, internal_id, {std::move(main_blocks), std::move(indexer_blocks), arrival_deadline});
}

void Reader::remove_request(const std::string& ext_id) {
  std::lock_guard lock(mu_);
  tracker_.remove_request(ext_id);
}

Expected<Finished> Reader::get_finished(const AllGather& all_gather) {
  RankTerminal mine;
  {
    std::lock_guard lock(mu_);
    mine = tracker_.terminal(std::chrono::steady_clock::now());
  }
  // Gathered without the lock: the other ranks may take a while, and reads go on meanwhile.
  auto ranks = all_gather(mine);
  if (!ranks) return ranks.status().with_context("gathering completions across Decode TP ranks");
  std::lock_guard lock(mu_);
  return tracker_.finish(*ranks);
}

ReaderStats Reader::stats() const {
  const auto get = [](const auto& counter) { return counter.load(std::memory_order_relaxed); };
  const Counters& c = counters_;
  return {.layers_done = get(c.layers_done),
          .layers_failed = get(c.layers_failed),
          .messages_rejected = get(c.messages_rejected),
          .readiness_held = get(c.readiness_held),
          .held_now = get(c.held_now),
          .connections = get(c.connections),
          .reads = get(c.reads),
          .bytes_read = get(c.bytes_read),
          .read_ns = get(c.read_ns),
          .links_opened = get(c.links_opened),
          .readiness_on_link = get(c.readiness_on_link),
          .readiness_polled = get(c.readiness_polled)};
}

size_t Reader::tracked_requests() const {
  std::lock_guard lock(mu_);
  return tracker_.tracked();
}

void Reader::run() {
  // This thread takes what the links carry off the engine itself: it sleeps on them as
  // well as on its socket, so a readiness on a link wakes it directly.
  const int link_fd = links_.available() ? links_.fd() : -1;
  const int wake_fds[] = {connects_->fd.get(), link_fd};
  // While a request read on a link is owed later layers, the links are polled, unarmed,
  // for up to busy_poll after each message: the Prefill sending the next layer finds no
  // sleeper to wake. Past that, or owed nothing, the thread sleeps again.
  using Clock = std::chrono::steady_clock;
  Clock::time_point busy_until{};
  while (!stopping_.load()) {
    // Reads in flight are driven here, between messages: the thread never sleeps on them.
    if (!in_flight_.empty()) progress_reads();
    const bool reading = !in_flight_.empty();
    const bool busy = link_fd >= 0 && Clock::now() < busy_until;
    const bool armed = link_fd < 0 || links_.poll(!busy && !reading);
    if (drain_links(busy) && link_fd >= 0 && config_.busy_poll.count() > 0) {
      std::lock_guard lock(mu_);
      busy_until = tracker_.owes_any() ? Clock::now() + config_.busy_poll : Clock::time_point{};
    }
    auto in =
        router_->receive(armed && !reading ? config_.poll_interval : std::chrono::milliseconds(0),
                         std::span(wake_fds, link_fd >= 0 ? 2 : 1));
    finish_connects();
    // Polling, it gives way to whatever else wants this CPU.
    if ((busy || reading) && in && !in->has_value()) std::this_thread::yield();
    if (!in) {
      log::warn("decode reader {}: {}", config_.d_rank, in.status().to_string());
    } else if (in->has_value()) {
      paths_of((*in)->identity).answer_on_link = false;
      if (auto wait = connecting_.find((*in)->identity); wait != connecting_.end()) {
        // Its session is being opened: the message waits for it, in order, in bounds.
        if (wait->second.waiting.size() < config_.max_held_per_peer) {
          wait->second.waiting.push_back(std::move(**in));
        } else {
          warn_limited(unknown_log_, "dropped a message of a connection still connecting",
                       "more than " + std::to_string(config_.max_held_per_peer) + " waiting");
        }
      } else {
        handle(**in);
      }
    }
    // A connection that closed takes its state along: MF_META, held readiness, and the
    // requests it had begun and not finished (a Prefill that died finishes none of them).
    for (const auto& gone : router_->take_disconnected()) {
      connecting_.erase(gone);  // its connect's answer is dropped when it comes
      if (peers_.count(gone) || held_.count(gone)) {
        drop_peer(gone, "the connection closed");
      }
      paths_.erase(gone);
      std::lock_guard lock(mu_);
      fail_owed(gone);
    }
    if (held_count_ > 0) drain_held();
  }
  // Reads still in flight end before their memory may go: answered, the rest dropped.
  while (!in_flight_.empty()) complete_read(in_flight_.begin()->first, /*replay=*/false);
}

bool Reader::destinations_known(const protocol::ReadReadyBatch& ready) const {
  for (const auto& req : ready.read_reqs) {
    if (!tracker_.known(req.ext_id) && !tracker_.aborted(req.ext_id)) return false;
  }
  return true;
}

void Reader::drain_held() {
  const auto now = std::chrono::steady_clock::now();
  for (auto it = held_.begin(); it != held_.end();) {
    auto& queue = it->second;
    // A connection with a read in flight takes its next turn after that read's answer.
    while (!queue.empty() && in_flight_.count(it->first) == 0) {
      bool ready = !queue.front().refusal.empty();
      if (!ready) {
        std::lock_guard lock(mu_);
        ready = destinations_known(queue.front().ready);
      }
      if (!ready && now - queue.front().since < config_.hold_timeout) break;
      Held h = std::move(queue.front());
      queue.pop_front();
      answer_on(it->first, h.on_link);
      --held_count_;
      set_held_now();
      if (!h.refusal.empty()) count(&Counters::layers_failed);
      if (!h.refusal.empty()) {
        reply(it->first, protocol::encode(protocol::ReadFailed{h.ready.layer_idx, h.refusal}));
      } else {
        handle_ready(it->first, h.ready);
      }
    }
    it = queue.empty() ? held_.erase(it) : std::next(it);
  }
}

Reader::ConnectionPaths& Reader::paths_of(const std::string& identity) {
  return paths_.try_emplace(identity, *router_, identity).first->second;
}

bool Reader::came_on_link(const std::string& identity) const {
  auto p = paths_.find(identity);
  return p != paths_.end() && p->second.answer_on_link;
}

void Reader::answer_on(const std::string& identity, bool on_link) {
  if (auto p = paths_.find(identity); p != paths_.end()) p->second.answer_on_link = on_link;
}

void Reader::reply(const std::string& identity, const std::vector<std::byte>& payload) {
  auto p = paths_.find(identity);
  if (p == paths_.end()) return;  // its connection closed: nobody is left to answer
  ConnectionPaths& paths = p->second;
  // A link that failed closes, which drops the connection; ZeroMQ carries this answer.
  if (paths.answer_on_link && paths.link && paths.link->send(payload).is_ok()) return;
  // A peer that vanished cannot be answered; its gates fail on its own deadline.
  (void)paths.zmq.send(payload);
}

bool Reader::drain_links(bool polled) {
  // Taken first: handling a message may drop its connection, and its link with it.
  struct Came {
    std::string identity;
    uint64_t channel;
    std::vector<std::byte> payload;
  };
  std::vector<Came> came;
  std::vector<std::string> closed;
  for (auto& [identity, p] : paths_) {
    if (!p.link) continue;
    for (;;) {
      auto m = p.link->try_receive();
      if (!m || !m->has_value()) break;
      came.push_back({identity, p.link->channel(), std::move(**m)});
    }
    if (p.link->lost()) closed.push_back(identity);
  }
  for (auto& c : came) {
    auto p = paths_.find(c.identity);
    if (p == paths_.end() || !p->second.link || p->second.link->channel() != c.channel) {
      continue;  // closed meanwhile
    }
    p->second.answer_on_link = true;
    handle(control::Inbound{c.identity, std::move(c.payload), {}}, &polled);
  }
  for (const auto& identity : closed) {
    auto p = paths_.find(identity);
    if (p == paths_.end() || !p->second.link) continue;
    drop_peer(identity, "the transfer link to this Decode closed; send MF_META again");
  }
  return !came.empty();
}

void Reader::close_link(const std::string& identity) {
  if (auto p = paths_.find(identity); p != paths_.end()) p->second.link.reset();
}

void Reader::handle(const control::Inbound& in, bool* polled) {
  if (auto f = in_flight_.find(in.identity); f != in_flight_.end()) {
    // Its connection has a read in flight: in its turn, after that read's answer.
    if (f->second.behind.size() < config_.max_held_per_peer) {
      f->second.behind.emplace_back(in, came_on_link(in.identity));
      return;
    }
    // No room to keep its turn: the connection is dropped (its Prefill fails at once).
    return drop_peer(in.identity, "more than " + std::to_string(config_.max_held_per_peer) +
                                      " messages of this connection wait behind its read");
  }
  if (!in.malformed.empty()) return handle_undecodable(in, in.malformed);
  auto message = protocol::decode_message(in.payload);
  if (!message) return handle_undecodable(in, message.status().message());
  if (auto* meta = std::get_if<protocol::MfMeta>(&*message)) {
    handle_mf_meta(in.identity, *meta);
  } else if (auto* ready = std::get_if<protocol::ReadReadyBatch>(&*message)) {
    if (polled != nullptr) {
      std::lock_guard lock(mu_);
      // Polling stops once nothing is owed: a readiness taken in the same batch after the
      // message that completed the last request did not find the reader polling for it.
      *polled = *polled && tracker_.owes_any();
      count(&Counters::readiness_on_link);
      if (*polled) count(&Counters::readiness_polled);
    }
    take_readiness(in.identity, std::move(*ready));
  } else if (auto* commit = std::get_if<protocol::KvCommit>(&*message)) {
    // It answers a READ_DONE already sent, which no held readiness precedes: taken at once.
    handle_commit(in.identity, *commit);
  } else {
    count(&Counters::messages_rejected);  // replies are Prefill's to receive, not ours
  }
}

void Reader::handle_undecodable(const control::Inbound& in, const std::string& why) {
  bool as_str = false;
  const auto tag = protocol::peek_tag(in.payload, &as_str);
  if (tag == "mf_meta") return refuse_mf_meta(in.identity, why);  // counted there
  count(&Counters::messages_rejected);
  // Answer whatever can be answered: Prefill waits for a reply to every readiness.
  if (auto layer = protocol::salvage_layer_index(in.payload)) {
    // In its turn: behind what this connection has held, so replies keep their order.
    auto queue = held_.find(in.identity);
    if (queue != held_.end() && !queue->second.empty() && held_count_ < config_.max_held) {
      protocol::ReadReadyBatch failed;
      failed.layer_idx = *layer;
      queue->second.push_back(
          {std::move(failed), std::chrono::steady_clock::now(), why, came_on_link(in.identity)});
      ++held_count_;
      set_held_now();
      return;
    }
    count(&Counters::layers_failed);
    reply(in.identity, protocol::encode(protocol::ReadFailed{*layer, why}));
    return;
  }
  if (!in.malformed.empty() || (tag && (as_str || *tag != protocol::kTagReadReadyBatch))) {
    // A message this Decode does not know (a newer peer's, or a tag sent as str), or an
    // envelope refused with nothing in it to answer for, owes no answer: it is ignored, and
    // the connection keeps its MF_META and what it has in flight.
    warn_limited(unknown_log_, "ignored a message it does not understand", why);
    return;
  }
  // A readiness without a layer to answer for, or not a tagged message at all: the
  // connection cannot be trusted to stay in step. What it owes is failed, its MF_META
  // forgotten, and it is told, so Prefill fails at once.
  drop_peer(in.identity, "message refused: " + why +
                             "; this connection's MF_META and held readiness are dropped");
}

void Reader::take_readiness(const std::string& identity, protocol::ReadReadyBatch ready) {
  trace::instant("readiness in", "reader", ready.layer_idx);
  // Behind a held message, or naming a request Decode does not know yet: hold it.
  auto queue = held_.find(identity);
  const size_t mine = queue != held_.end() ? queue->second.size() : 0;
  const bool room = held_count_ < config_.max_held && mine < config_.max_held_per_peer;
  bool hold = mine > 0;
  // A connection that never sent MF_META cannot be read from: answered at once (the
  // existing connector does not hold it either).
  if (!hold && room && peers_.count(identity) != 0) {
    std::lock_guard lock(mu_);
    hold = !destinations_known(ready);
  }
  if (hold && room) {
    held_[identity].push_back(
        {std::move(ready), std::chrono::steady_clock::now(), {}, came_on_link(identity)});
    ++held_count_;
    count(&Counters::readiness_held);
    set_held_now();
    return;
  }
  if (mine > 0) {
    // Its turn is behind held messages there is no room to join: answering now would
    // break the order of replies, so the connection is dropped.
    return drop_peer(identity,
                     "Decode rank " + std::to_string(config_.d_rank) + " holds " +
                         std::to_string(mine) + " readiness of this connection (limit " +
                         std::to_string(config_.max_held_per_peer) + " per connection, " +
                         std::to_string(config_.max_held) + " in all)",
                     &ready);
  }
  handle_ready(identity, ready);
}

void Reader::warn_limited(log::RateLimit& limit, const char* what, const std::string& why) {
  uint64_t held_back = 0;
  if (!limit.allow(&held_back)) return;
  log::warn("decode reader {}: {}: {} ({} more since the last such line)", config_.d_rank, what,
            why, held_back);
}

void Reader::refuse_mf_meta(const std::string& identity, const std::string& why) {
  count(&Counters::messages_rejected);
  // Said here too, whole: the operator of this Decode learns why its Prefill gets nothing.
  warn_limited(refused_log_, "refused a Prefill's MF_META", why);
  // MF_META has no negative answer: a READ_FAILED for layer 0 tells an rd2h Prefill why
  // no ACK comes; the existing Python Prefill times out waiting for the ACK.
  reply(identity, protocol::encode(protocol::ReadFailed{0, "MF_META refused: " + why}));
}

void Reader::drop_peer(const std::string& identity, const std::string& why,
                       const protocol::ReadReadyBatch* last) {
  // A read in flight is answered first, in its turn; what waited behind it goes with the
  // connection.
  complete_read(identity, /*replay=*/false);
  if (auto queue = held_.find(identity); queue != held_.end()) {
    for (auto& h : queue->second) {
      count(&Counters::layers_failed);
      {
        std::lock_guard lock(mu_);
        for (const auto& req : h.ready.read_reqs) tracker_.on_failed(req.ext_id);
        for (const auto& ext_id : h.ready.done_ext_ids) tracker_.on_failed(ext_id);
      }
      reply(identity, protocol::encode(protocol::ReadFailed{h.ready.layer_idx, why}));
    }
    held_count_ -= queue->second.size();
    held_.erase(queue);
    set_held_now();
  }
  peers_.erase(identity);
  set_connections();
  {
    std::lock_guard lock(mu_);
    // What this connection was sending, or had sent and not committed, cannot complete.
    fail_owed(identity);
  }
  if (last != nullptr) {
    count(&Counters::layers_failed);
    std::lock_guard lock(mu_);
    for (const auto& req : last->read_reqs) tracker_.on_failed(req.ext_id);
    for (const auto& ext_id : last->done_ext_ids) tracker_.on_failed(ext_id);
  }
  // Without a readiness to answer, layer 0: not a layer this connection waits on first
  // unless it is owed anyway; an rd2h Prefill fails the whole connection on an answer out
  // of turn and reconnects with MF_META.
  reply(identity, protocol::encode(protocol::ReadFailed{last ? last->layer_idx : 0, why}));
  close_link(identity);
}

void Reader::handle_mf_meta(const std::string& identity, const protocol::MfMeta& meta) {
  auto refuse = [&](const Status& why) { refuse_mf_meta(identity, why.message()); };
  if (Status st = protocol::check_compatible(meta); !st) return refuse(st);
  if (meta.backend_name != engine_->backend_name()) {
    return refuse(failed_precondition("Prefill's transfer backend is '" + meta.backend_name +
                                      "', this Decode uses '" +
                                      std::string(engine_->backend_name()) + "'"));
  }
  Peer peer;
  // check_compatible let only a Prefill of this protocol version state one.
  peer.commits = meta.protocol_version.has_value();
  for (const auto& [name, layer_meta] : meta.layers) {
    auto tensors = from_layer_meta(layer_meta);
    if (!tensors) return refuse(tensors.status().with_context(name));
    peer.layers.emplace(name, PeerLayer{std::move(*tensors), nullptr, Status::ok()});
  }
  if (Status st = check_same_layers(peer.layers, layout_); !st) return refuse(st);
  // The layouts are fixed from here on: checked once, not on every readiness.
  for (auto& [name, layer] : peer.layers) {
    const auto& mine = layout_.at(name);
    layer.decode = &mine;
    const auto index = layout::layer_index_from_name(name);
    layer.layout = layout::validate_layer(index ? *index : -1, layer.tensors, mine)
                       .with_context("Decode rank " + std::to_string(config_.d_rank));
  }
  // The session (and link) is opened on the connect thread; the ACK, and whatever the
  // connection sends meanwhile, wait for it (finish_connects). MF_META again on one
  // connection: a new link replaces the old.
  close_link(identity);
  Connecting& waiting = connecting_[identity];
  waiting.link.reset();  // an earlier MF_META's, still opening
  ConnectJob job{++next_job_, identity, meta.backend_metadata, std::nullopt};
  if (meta.control_link && links_.available()) {
    if (auto link = links_.expect(*meta.control_link)) {
      waiting.link = std::move(*link);
      job.link = *meta.control_link;
    }
  }
  waiting.job = job.job;
  waiting.peer = std::move(peer);
  waiting.p_session = meta.p_session;
  {
    std::lock_guard lock(connects_->mu);
    connects_->jobs.push_back(std::move(job));
  }
  connects_->cv.notify_one();
}

void Reader::fail_owed(const std::string& identity) {
  const size_t failed = tracker_.connection_lost(identity);
  if (failed > 0) {
    log::warn(
        "decode reader {}: a Prefill connection ended before it completed {} request(s) "
        "(their final layer or Prefill's commit had not come); they fail",
        config_.d_rank, failed);
  }
}

}  // namespace rd2h::decode
