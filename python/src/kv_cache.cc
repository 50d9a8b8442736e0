// The KV cache as the host hands it over: tensors registered without a copy (torch tensors by
// data_ptr() and byte size, or anything with the buffer protocol), layers of them, and the
// event by which the host says a layer's KV write finished.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "native.h"
#include "rd2h/prefill/write_event.h"

namespace rd2h::python {
namespace {

// A torch tensor (or anything shaped like one): fills out's address range; returns its
// blocks along the first dimension (0 if it has no shape).
uint64_t read_torch_tensor(const py::object& obj, PyCacheTensor& out) {
  if (py::hasattr(obj, "device")) {
    const std::string device = py::str(obj.attr("device").attr("type"));
    if (device != "cpu") {
      throw StatusError(invalid_argument("rd2h registers host memory; this tensor is on device '" +
                                         device + "'"));
    }
  }
  if (py::hasattr(obj, "is_contiguous") && !obj.attr("is_contiguous")().cast<bool>()) {
    throw StatusError(invalid_argument("a KV cache tensor must be contiguous"));
  }
  out.tensor.addr = obj.attr("data_ptr")().cast<uint64_t>();
  if (py::hasattr(obj, "nbytes")) {
    out.tensor.bytes = obj.attr("nbytes").cast<uint64_t>();
  } else {
    out.tensor.bytes =
        obj.attr("numel")().cast<uint64_t>() * obj.attr("element_size")().cast<uint64_t>();
  }
  if (!py::hasattr(obj, "shape")) return 0;
  py::tuple shape = py::tuple(obj.attr("shape"));
  return shape.empty() ? 0 : shape[0].cast<uint64_t>();
}

// A C-contiguous buffer: holds its view in out and fills out's address range; returns its
// blocks along the first dimension (0 if it has none).
uint64_t read_buffer(const py::object& obj, bool writable, PyCacheTensor& out) {
  auto view =
      std::make_shared<py::buffer_info>(py::reinterpret_borrow<py::buffer>(obj).request(writable));
  ssize_t expect = view->itemsize;
  for (ssize_t d = view->ndim - 1; d >= 0; --d) {
    if (view->shape[d] > 1 && view->strides[d] != expect) {
      throw StatusError(invalid_argument("a KV cache buffer must be C-contiguous"));
    }
    expect *= view->shape[d];
  }
  out.tensor.addr = reinterpret_cast<uint64_t>(view->ptr);
  out.tensor.bytes = static_cast<uint64_t>(view->size * view->itemsize);
  const uint64_t blocks = view->ndim > 0 ? static_cast<uint64_t>(view->shape[0]) : 0;
  out.view = std::move(view);
  return blocks;
}

PyCacheTensor cache_tensor_of(const py::object& obj, std::optional<uint64_t> num_blocks,
                              uint64_t group_idx, bool writable) {
  PyCacheTensor out;
  out.owner = obj;
  out.tensor.group_idx = group_idx;
  uint64_t blocks = 0;
  if (py::hasattr(obj, "data_ptr")) {
    blocks = read_torch_tensor(obj, out);
  } else if (PyObject_CheckBuffer(obj.ptr())) {
    blocks = read_buffer(obj, writable, out);
  } else {
    throw StatusError(invalid_argument(
        "a KV cache tensor needs data_ptr() and a byte size (a torch tensor) or the buffer "
        "protocol; got " +
        std::string(py::str(py::type::of(obj).attr("__name__")))));
  }
  if (num_blocks) blocks = *num_blocks;
  if (blocks == 0 || out.tensor.bytes == 0 || out.tensor.bytes % blocks != 0) {
    throw StatusError(invalid_argument("a KV cache tensor of " + std::to_string(out.tensor.bytes) +
                                       " bytes does not split into " + std::to_string(blocks) +
                                       " blocks"));
  }
  out.tensor.block_len = out.tensor.bytes / blocks;
  return out;
}

}  // namespace

void bind_kv_cache(py::module_& m) {
  py::class_<PyCacheTensor>(m, "CacheTensor",
                            "One KV cache tensor, registered without a copy; holds its owner.")
      .def(py::init(&cache_tensor_of), py::arg("tensor"), py::arg("num_blocks") = py::none(),
           py::arg("group_idx") = 0, py::arg("writable") = true,
           "From a torch tensor (data_ptr, nbytes) or a buffer; blocks along the first "
           "dimension unless num_blocks is given.")
      .def_property_readonly("addr", [](const PyCacheTensor& t) { return t.tensor.addr; })
      .def_property_readonly("bytes", [](const PyCacheTensor& t) { return t.tensor.bytes; })
      .def_property_readonly("block_len",
                             [](const PyCacheTensor& t) { return t.tensor.block_len; });

  py::class_<PyCacheLayer>(m, "CacheLayer")
      .def(py::init([](std::string name, std::vector<PyCacheTensor> tensors,
                       uint64_t main_tensor_count, bool has_indexer) {
             return PyCacheLayer{std::move(name), std::move(tensors), main_tensor_count,
                                 has_indexer};
           }),
           py::arg("name"), py::arg("tensors"), py::arg("main_tensor_count") = 1,
           py::arg("has_indexer") = false)
      .def_readonly("name", &PyCacheLayer::name);

  py::class_<prefill::HostWriteEvent, std::shared_ptr<prefill::HostWriteEvent>>(
      m, "HostWriteEvent", "Signals that a layer's KV write finished (or failed).")
      .def(py::init<>())
      .def(
          "complete",
          [](prefill::HostWriteEvent& e, const std::optional<std::string>& error) {
            e.complete(error ? internal_error(*error) : Status::ok());
          },
          py::arg("error") = py::none());
}

}  // namespace rd2h::python
