// rd2h._native: the connector's public face for Python hosts (vLLM through rd2h.vllm).
// Every call that can block (a reuse gate, a send, a gather, memory registration, stopping
// the proxy) runs without the GIL. An rd2h error is raised as rd2h.Error (or the subclass
// for its kind) carrying the error's message; KV buffers come from any object with
// data_ptr() and a byte size (torch tensors), or from the buffer protocol, and are kept
// alive by the worker that registered them. Each bound area lives in its own file (native.h).
#include "native.h"

#include "rd2h/version.h"

PYBIND11_MODULE(_native, m) {
  namespace python = rd2h::python;
  m.doc() = "rd2h: layerwise KV-cache transfer for prefill/decode disaggregated serving";
  m.attr("__version__") = RD2H_VERSION;
  // In this order: a signature names a bound type only once the type is bound.
  python::bind_errors(m);
  python::bind_config(m);
  python::bind_kv_cache(m);
  python::bind_scheduler(m);
  python::bind_worker(m);
  python::bind_proxy(m);
}
