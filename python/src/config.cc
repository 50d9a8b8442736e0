// The connector's settings as Python sees them: the role, the kv_transfer_config (read from
// JSON, read-only afterwards), the parallel layout and the KV cache groups.
#include "rd2h/connector/config.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "native.h"
#include "rd2h/connector/scheduler.h"

namespace rd2h::python {

void bind_config(py::module_& m) {
  py::enum_<connector::KvRole>(m, "KvRole")
      .value("PRODUCER", connector::KvRole::kProducer)
      .value("CONSUMER", connector::KvRole::kConsumer);

  py::class_<connector::ConnectorConfig>(m, "ConnectorConfig")
      .def_static(
          "from_json",
          [](const std::string& text) { return take(connector::ConnectorConfig::from_json(text)); },
          py::arg("kv_transfer_config"),
          "Reads a kv_transfer_config JSON; a bad setting raises InvalidArgument naming it.")
      .def("to_json", &connector::ConnectorConfig::to_json)
      .def_readonly("role", &connector::ConnectorConfig::role)
      .def_readonly("engine_id", &connector::ConnectorConfig::engine_id)
      .def_readonly("host", &connector::ConnectorConfig::host)
      .def_readonly("kv_port", &connector::ConnectorConfig::kv_port)
      .def_readonly("use_layerwise", &connector::ConnectorConfig::use_layerwise)
      .def_property_readonly("request_id_suffix_chars", [](const connector::ConnectorConfig& c) {
        return c.request_ids.suffix_chars;
      });

  py::class_<connector::Parallel>(m, "Parallel")
      .def(py::init([](int tp_size, int pcp_size, int dcp_size, int global_dp_rank) {
             return connector::Parallel{tp_size, pcp_size, dcp_size, global_dp_rank};
           }),
           py::arg("tp_size") = 1, py::arg("pcp_size") = 1, py::arg("dcp_size") = 1,
           py::arg("global_dp_rank") = 0)
      .def_readonly("tp_size", &connector::Parallel::tp_size)
      .def_readonly("global_dp_rank", &connector::Parallel::global_dp_rank);

  py::class_<connector::KvCacheGroup>(m, "KvCacheGroup")
      .def(py::init([](std::vector<std::string> layer_names, uint64_t block_size) {
             return connector::KvCacheGroup{std::move(layer_names), block_size};
           }),
           py::arg("layer_names"), py::arg("block_size"));
}

}  // namespace rd2h::python
