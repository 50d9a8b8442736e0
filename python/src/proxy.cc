// rd2h.Proxy: the rd2h proxy (an OpenAI-style front and the metaserver) in this process,
// started and stopped without the GIL.
#include "rd2h/metaserver/proxy.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "native.h"

namespace rd2h::python {
namespace {

class Proxy {
 public:
  explicit Proxy(metaserver::ProxyConfig config) {
    py::gil_scoped_release release;
    auto p = metaserver::Proxy::start(std::move(config));
    if (!p) {
      py::gil_scoped_acquire acquire;
      throw StatusError(p.status());
    }
    p_ = std::move(*p);
  }
  ~Proxy() { close(); }
  void close() {
    py::gil_scoped_release release;
    p_.reset();
  }
  const metaserver::Proxy& get() const {
    if (!p_) throw StatusError(failed_precondition("the proxy is closed"));
    return *p_;
  }

 private:
  std::unique_ptr<metaserver::Proxy> p_;
};

}  // namespace

void bind_proxy(py::module_& m) {
  py::class_<Proxy>(m, "Proxy", "rd2h proxy in this process: an OpenAI-style front and metaserver.")
      .def(py::init([](std::vector<std::string> prefill, std::vector<std::string> decode,
                       std::string host, int port, int metaserver_port) {
             metaserver::ProxyConfig c;
             c.prefill = std::move(prefill);
             c.decode = std::move(decode);
             c.host = std::move(host);
             c.port = port;
             c.metaserver_port = metaserver_port;
             return std::make_unique<Proxy>(std::move(c));
           }),
           py::arg("prefill"), py::arg("decode"), py::arg("host") = "127.0.0.1",
           py::arg("port") = 0, py::arg("metaserver_port") = 0)
      .def_property_readonly("url", [](const Proxy& p) { return p.get().url(); })
      .def_property_readonly("metaserver_url",
                             [](const Proxy& p) { return p.get().metaserver_url(); })
      .def_property_readonly("port", [](const Proxy& p) { return p.get().port(); })
      .def("close", &Proxy::close);
}

}  // namespace rd2h::python
