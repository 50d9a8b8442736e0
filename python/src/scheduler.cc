// rd2h.Scheduler: the scheduler role of the connector, over vLLM's request fields (id,
// prompt length, kv_transfer_params as JSON); closing it stops the metaserver posts in flight
// without the GIL.
#include "rd2h/connector/scheduler.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "native.h"
#include "rd2h/connector/config.h"
#include "rd2h/connector/metadata.h"

namespace rd2h::python {
namespace {

connector::Request make_request(const std::string& request_id, uint64_t num_prompt_tokens,
                                const std::optional<std::string>& params_json) {
  connector::Request r;
  r.request_id = request_id;
  r.num_prompt_tokens = num_prompt_tokens;
  if (params_json) r.params = take(connector::KvTransferParams::from_json(*params_json));
  return r;
}

class Scheduler {
 public:
  Scheduler(const connector::ConnectorConfig& config, connector::Parallel parallel,
            std::vector<connector::KvCacheGroup> groups)
      : s_(take(connector::Scheduler::create(config, parallel, std::move(groups)))) {}
  ~Scheduler() { close(); }
  // Stops the metaserver posts still in flight (bounded by their timeout).
  void close() {
    py::gil_scoped_release release;
    s_.reset();
  }
  connector::Scheduler& get() {
    if (!s_) throw StatusError(failed_precondition("the scheduler is closed"));
    return *s_;
  }

  std::pair<uint64_t, bool> get_num_new_matched_tokens(const std::string& request_id,
                                                       uint64_t num_prompt_tokens,
                                                       const std::optional<std::string>& params,
                                                       uint64_t num_computed_tokens) {
    auto m = get().get_num_new_matched_tokens(make_request(request_id, num_prompt_tokens, params),
                                              num_computed_tokens);
    return {m.tokens, m.load_async};
  }
  // Returns whether the request still asks for a remote prefill afterwards (Decode clears
  // it once the load is set up, so it happens once).
  bool update_state_after_alloc(const std::string& request_id, uint64_t num_prompt_tokens,
                                const std::optional<std::string>& params,
                                const std::vector<std::vector<int64_t>>& block_ids,
                                uint64_t num_external_tokens) {
    auto r = make_request(request_id, num_prompt_tokens, params);
    raise_if_error(get().update_state_after_alloc(r, block_ids, num_external_tokens));
    return r.params && r.params->do_remote_prefill;
  }
  // `scheduled`: (request id, new block ids per group, computed tokens after the step,
  // resumed after a preemption: the block ids replace the request's).
  py::bytes build_connector_meta(
      const std::vector<std::tuple<std::string, std::vector<std::vector<int64_t>>, uint64_t, bool>>&
          scheduled) {
    std::vector<connector::ScheduledRequest> steps;
    steps.reserve(scheduled.size());
    for (const auto& [id, blocks, computed, resumed] : scheduled) {
      steps.push_back({id, blocks, computed, resumed});
    }
    auto bytes = take(get().build_connector_meta(steps));
    return py::bytes(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  }
  void request_finished(const std::string& request_id, uint64_t num_prompt_tokens,
                        const std::optional<std::string>& params) {
    (void)take(get().request_finished(make_request(request_id, num_prompt_tokens, params)));
  }
  int base_port() { return get().base_port(); }

 private:
  std::unique_ptr<connector::Scheduler> s_;
};

}  // namespace

void bind_scheduler(py::module_& m) {
  py::class_<Scheduler>(m, "Scheduler", "The scheduler role of the connector.")
      .def(py::init<const connector::ConnectorConfig&, connector::Parallel,
                    std::vector<connector::KvCacheGroup>>(),
           py::arg("config"), py::arg("parallel"), py::arg("groups"))
      .def("get_num_new_matched_tokens", &Scheduler::get_num_new_matched_tokens,
           py::arg("request_id"), py::arg("num_prompt_tokens"), py::arg("kv_transfer_params"),
           py::arg("num_computed_tokens"))
      .def("update_state_after_alloc", &Scheduler::update_state_after_alloc, py::arg("request_id"),
           py::arg("num_prompt_tokens"), py::arg("kv_transfer_params"), py::arg("block_ids"),
           py::arg("num_external_tokens"))
      .def("build_connector_meta", &Scheduler::build_connector_meta, py::arg("scheduled"))
      .def("request_finished", &Scheduler::request_finished, py::arg("request_id"),
           py::arg("num_prompt_tokens"), py::arg("kv_transfer_params"))
      .def_property_readonly("base_port", &Scheduler::base_port)
      .def("close", &Scheduler::close);
}

}  // namespace rd2h::python
