// What the parts of rd2h._native share: an rd2h error thrown as StatusError (translated to
// rd2h.Error or its subclass at the Python boundary), the KV cache tensors and layers as the
// host hands them over, and one bind_* function per bound area, called in this order at import.
// Every part includes the same pybind11 casters (stl, functional), as pybind11 requires.
#pragma once

#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "rd2h/common/status.h"
#include "rd2h/layout/cache_layer.h"

namespace rd2h::python {

namespace py = pybind11;

class StatusError : public std::exception {
 public:
  explicit StatusError(Status s) : status_(std::move(s)), what_(status_.to_string()) {}
  const char* what() const noexcept override { return what_.c_str(); }
  const Status& status() const { return status_; }

 private:
  Status status_;
  std::string what_;
};

inline void raise_if_error(const Status& s) {
  if (!s.is_ok()) throw StatusError(s);
}
template <typename T>
T take(Expected<T> e) {
  if (!e) throw StatusError(e.status());
  return std::move(*e);
}

// A KV cache tensor as registered: its address range, and the Python object that owns the
// memory (and, for the buffer protocol, the held view), kept alive with it.
struct PyCacheTensor {
  layout::CacheTensor tensor;
  py::object owner;
  std::shared_ptr<py::buffer_info> view;
};

struct PyCacheLayer {
  std::string name;
  std::vector<PyCacheTensor> tensors;
  uint64_t main_tensor_count = 2;
  bool has_indexer = false;
};

void bind_errors(py::module_& m);     // Error and its subclasses, the translator (errors.cc)
void bind_config(py::module_& m);     // KvRole, ConnectorConfig, Parallel, KvCacheGroup (config.cc)
void bind_kv_cache(py::module_& m);   // CacheTensor, CacheLayer, HostWriteEvent (kv_cache.cc)
void bind_scheduler(py::module_& m);  // Scheduler (scheduler.cc)
void bind_worker(py::module_& m);     // Worker (worker.cc)
void bind_proxy(py::module_& m);      // Proxy (proxy.cc)

}  // namespace rd2h::python
