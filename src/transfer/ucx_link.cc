#include "transfer/ucx_link.h"

#include <chrono>
#include <cstring>
#include <string>

namespace rd2h::transfer {

bool acceptable_link_message(size_t length, const ucp_am_recv_param_t* param) {
  return (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0 && length <= kMaxNotificationBytes;
}

void ServedLinks::close_all() {
  std::lock_guard lock(mu);
  for (auto& [token, link] : links_) link.ep.close();
}

Status set_am_handler(ucp_worker_h worker, uint16_t id, ucp_am_recv_callback_t cb, void* arg) {
  ucp_am_handler_param_t hp{};
  hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG;
  hp.id = id;
  hp.cb = cb;
  hp.arg = arg;
  if (ucs_status_t st = ucp_worker_set_am_recv_handler(worker, &hp); st != UCS_OK) {
    return transport_error("ucp_worker_set_am_recv_handler (active message " + std::to_string(id) +
                           "): " + ucs_status_string(st));
  }
  return Status::ok();
}

Status ServedLinks::install() {
  RD2H_RETURN_IF_ERROR(set_am_handler(worker_, kAmLinkOpen, &ServedLinks::on_open, this));
  return set_am_handler(worker_, kAmLinkMessage, &ServedLinks::on_message, this);
}

bool ServedLinks::has(uint64_t token) {
  std::lock_guard lock(mu);
  return links_.count(token) != 0;
}

Status ServedLinks::expect(uint64_t token, LinkHandler handler) {
  std::lock_guard lock(mu);
  auto [it, added] = links_.try_emplace(token);
  if (!added) return already_exists("link " + std::to_string(token) + " is expected already");
  it->second.handler = std::move(handler);
  return Status::ok();
}

void ServedLinks::close(uint64_t token) {
  std::lock_guard lock(mu);
  auto it = links_.find(token);
  if (it == links_.end()) return;
  Link& link = it->second;
  link.ep.close();
  // An endpoint with an error handler may still name its owner until the worker goes.
  if (link.owner && link.network) retired_.push_back(std::move(link.owner));
  links_.erase(it);
}

void ServedLinks::fail(Link& link) {
  if (link.closed) return;
  link.closed = true;
  link.handler(Notification::Kind::kClosed, {});
}

Status ServedLinks::send(uint64_t token, std::span<const std::byte> message) {
  std::unique_lock lock(mu, std::try_to_lock);
  if (!lock.owns_lock()) {
    // Whoever progresses the worker holds it, perhaps serving reads for a while: the
    // message waits for it in the queue, and the caller does not.
    {
      std::lock_guard queue_lock(queue_mu_);
      queued_.emplace_back(token, std::vector<std::byte>(message.begin(), message.end()));
    }
    ucp_worker_signal(worker_);
    return Status::ok();
  }
  send_queued();  // what was queued before goes first
  auto it = links_.find(token);
  if (it == links_.end() || !it->second.ep || it->second.closed) {
    return failed_precondition("link " + std::to_string(token) + " is not open");
  }
  return post(it->second, token, message);
}

void ServedLinks::send_queued() {
  std::deque<std::pair<uint64_t, std::vector<std::byte>>> queued;
  {
    std::lock_guard queue_lock(queue_mu_);
    queued.swap(queued_);
  }
  for (auto& [token, bytes] : queued) {
    auto it = links_.find(token);
    if (it == links_.end()) continue;  // closed meanwhile
    if (!it->second.ep || it->second.closed) {
      fail(it->second);  // its sender learns the message went nowhere
      continue;
    }
    (void)post(it->second, token, bytes);  // a failure closes the link
  }
}

Status ServedLinks::post(Link& link, uint64_t token, std::span<const std::byte> message) {
  // UCX may read the bytes after this returns: they are copied into what it keeps.
  InFlight& m = in_flight_.emplace_back();
  m.header.token = token;
  m.bytes.assign(message.begin(), message.end());
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_AM_SEND_FLAG_EAGER;
  p.cb.send = [](void* request, ucs_status_t, void* user_data) {
    static_cast<InFlight*>(user_data)->done = true;
    ucp_request_free(request);
  };
  p.user_data = &m;
  void* req = ucp_am_send_nbx(link.ep.get(), kAmLinkMessage, &m.header, sizeof(m.header),
                              m.bytes.data(), m.bytes.size(), &p);
  if (req == nullptr) {
    in_flight_.pop_back();
    return Status::ok();
  }
  if (UCS_PTR_IS_ERR(req)) {
    in_flight_.pop_back();
    const ucs_status_t st = UCS_PTR_STATUS(req);
    fail(link);
    return peer_dead("link " + std::to_string(token) + " failed: " + ucs_status_string(st));
  }
  // The progress thread sleeps on the worker: it has a send to finish.
  ucp_worker_signal(worker_);
  return Status::ok();
}

void ServedLinks::after_progress() {
  for (auto& o : opening_) {
    auto it = links_.find(o.token);
    if (it == links_.end()) continue;  // closed meanwhile
    Link& link = it->second;
    link.opening = false;
    link.network = o.network;
    link.owner = std::make_unique<EndpointOwner>(EndpointOwner{this, o.token});
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.address = reinterpret_cast<const ucp_address_t*>(o.address.data());
    ep.err_mode = o.network ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    if (o.network) {
      ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.err_handler.cb = on_endpoint_error;
      ep.err_handler.arg = link.owner.get();
    }
    ucp_ep_h created = nullptr;
    if (ucp_ep_create(worker_, &ep, &created) != UCS_OK) {
      fail(link);
      continue;
    }
    // A graceful close to a peer that is gone may never finish: it is not waited for.
    link.ep = UcxEndpoint(worker_, created, o.network, std::chrono::milliseconds::zero());
  }
  opening_.clear();
  send_queued();
  in_flight_.remove_if([](const InFlight& m) { return m.done; });
}

ucs_status_t ServedLinks::on_open(void* arg, const void* header, size_t header_length, void* data,
                                  size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<ServedLinks*>(arg);
  LinkOpenHeader h;
  if (header_length != sizeof(h) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0 ||
      length == 0 || length > kMaxLinkAddressBytes) {
    return UCS_OK;
  }
  std::memcpy(&h, header, sizeof(h));
  auto it = self->links_.find(h.token);
  // Only an expected link opens, and only once.
  if (it == self->links_.end() || it->second.ep || it->second.opening || it->second.closed) {
    return UCS_OK;
  }
  it->second.opening = true;
  const auto* p = static_cast<const std::byte*>(data);
  self->opening_.push_back({h.token, h.network != 0, {p, p + length}});
  // Heard now, before the messages that follow it; nobody can send on the link before
  // after_progress() gave it its endpoint, since both run under one hold of mu.
  it->second.handler(Notification::Kind::kOpened, {});
  return UCS_OK;
}

ucs_status_t ServedLinks::on_message(void* arg, const void* header, size_t header_length,
                                     void* data, size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<ServedLinks*>(arg);
  LinkMessageHeader h;
  if (header_length != sizeof(h) || !acceptable_link_message(length, param)) return UCS_OK;
  std::memcpy(&h, header, sizeof(h));
  auto it = self->links_.find(h.token);
  if (it == self->links_.end() || it->second.closed || (!it->second.ep && !it->second.opening)) {
    return UCS_OK;
  }
  it->second.handler(Notification::Kind::kMessage, {static_cast<const std::byte*>(data), length});
  return UCS_OK;
}

void ServedLinks::on_endpoint_error(void* arg, ucp_ep_h, ucs_status_t) {
  auto* owner = static_cast<EndpointOwner*>(arg);
  auto it = owner->links->links_.find(owner->token);
  if (it != owner->links->links_.end()) owner->links->fail(it->second);
}

}  // namespace rd2h::transfer
