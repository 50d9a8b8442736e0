// rd2h._native: the connector's public face for Python hosts (vLLM through rd2h.vllm).
// Every call that can block (a reuse gate, a send, a gather, memory registration, stopping
// the proxy) runs without the GIL. An rd2h error is raised as rd2h.Error (or the subclass
// for its kind) carrying the error's message; KV buffers come from any object with
// data_ptr() and a byte size (torch tensors), or from the buffer protocol, and are kept
// alive by the worker that registered them.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "rd2h/common/status.h"
#include "rd2h/connector/config.h"
#include "rd2h/connector/metadata.h"
#include "rd2h/connector/scheduler.h"
#include "rd2h/connector/worker.h"
#include "rd2h/decode/all_gather.h"
#include "rd2h/layout/cache_layer.h"
#include "rd2h/metaserver/proxy.h"
#include "rd2h/prefill/write_event.h"
#include "rd2h/version.h"

namespace py = pybind11;

namespace rd2h::python {
namespace {

// The Python exception types, by status code; created once at import.
struct Errors {
  py::object base, invalid_argument, timeout, peer;
};
Errors& errors() {
  static Errors* e = new Errors();  // lives as long as the interpreter's module
  return *e;
}

class StatusError : public std::exception {
 public:
  explicit StatusError(Status s) : status_(std::move(s)), what_(status_.to_string()) {}
  const char* what() const noexcept override { return what_.c_str(); }
  const Status& status() const { return status_; }

 private:
  Status status_;
  std::string what_;
};

void raise_if_error(const Status& s) {
  if (!s.is_ok()) throw StatusError(s);
}
template <typename T>
T take(Expected<T> e) {
  if (!e) throw StatusError(e.status());
  return std::move(*e);
}

void translate(const StatusError& e) {
  const Errors& err = errors();
  const py::object* type = &err.base;
  switch (e.status().code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
    case StatusCode::kInvalidMetadata:
      type = &err.invalid_argument;
      break;
    case StatusCode::kTimeout:
      type = &err.timeout;
      break;
    case StatusCode::kPeerDead:
    case StatusCode::kUnreachable:
      type = &err.peer;
      break;
    default:
      break;
  }
  py::object exc = (*type)(e.status().message());
  exc.attr("code") = std::string(to_string(e.status().code()));
  PyErr_SetObject(type->ptr(), exc.ptr());
}

// A KV cache tensor as registered: its address range, and the Python object that owns the
// memory (and, for the buffer protocol, the held view), kept alive with it.
struct PyCacheTensor {
  layout::CacheTensor tensor;
  py::object owner;
  std::shared_ptr<py::buffer_info> view;
};

PyCacheTensor cache_tensor_of(const py::object& obj, std::optional<uint64_t> num_blocks,
                              uint64_t group_idx, bool writable) {
  PyCacheTensor out;
  out.owner = obj;
  out.tensor.group_idx = group_idx;
  uint64_t blocks = 0;
  if (py::hasattr(obj, "data_ptr")) {
    if (py::hasattr(obj, "device")) {
      const std::string device = py::str(obj.attr("device").attr("type"));
      if (device != "cpu") {
        throw StatusError(invalid_argument(
            "rd2h registers host memory; this tensor is on device '" + device + "'"));
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
    if (py::hasattr(obj, "shape")) {
      py::tuple shape = py::tuple(obj.attr("shape"));
      if (!shape.empty()) blocks = shape[0].cast<uint64_t>();
    }
  } else if (PyObject_CheckBuffer(obj.ptr())) {
    auto view = std::make_shared<py::buffer_info>(
        py::reinterpret_borrow<py::buffer>(obj).request(writable));
    ssize_t expect = view->itemsize;
    for (ssize_t d = view->ndim - 1; d >= 0; --d) {
      if (view->shape[d] > 1 && view->strides[d] != expect) {
        throw StatusError(invalid_argument("a KV cache buffer must be C-contiguous"));
      }
      expect *= view->shape[d];
    }
    out.tensor.addr = reinterpret_cast<uint64_t>(view->ptr);
    out.tensor.bytes = static_cast<uint64_t>(view->size * view->itemsize);
    if (view->ndim > 0) blocks = static_cast<uint64_t>(view->shape[0]);
    out.view = std::move(view);
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

struct PyCacheLayer {
  std::string name;
  std::vector<PyCacheTensor> tensors;
  uint64_t main_tensor_count = 2;
  bool has_indexer = false;
};

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
    auto bytes = take(get().build_metadata(steps));
    return py::bytes(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  }
  void request_finished(const std::string& request_id, uint64_t num_prompt_tokens,
                        const std::optional<std::string>& params) {
    (void)get().request_finished(make_request(request_id, num_prompt_tokens, params));
  }
  int base_port() { return get().base_port(); }

 private:
  std::unique_ptr<connector::Scheduler> s_;
};

// One ConnectorWorker behind a mutex: its calls come from one host thread, but they run
// without the GIL, so another Python thread's shutdown() waits for a blocked call instead of
// freeing what it uses. The mutex is taken only with the GIL released (the all-gather
// callback takes the GIL while the mutex is held).
class Worker {
 public:
  Worker(const connector::ConnectorConfig& config, connector::Parallel parallel, int tp_rank)
      : w_(take(connector::ConnectorWorker::create(config, parallel, tp_rank))) {}
  ~Worker() {
    py::gil_scoped_release release;
    std::lock_guard lock(mu_);
    w_.reset();
  }

  void register_kv_caches(const std::vector<PyCacheLayer>& layers, bool engine_allocated) {
    std::vector<layout::CacheLayer> out;
    std::vector<PyCacheTensor> keep;
    for (const auto& l : layers) {
      layout::CacheLayer c;
      c.name = l.name;
      c.main_tensor_count = l.main_tensor_count;
      c.has_indexer = l.has_indexer;
      for (const auto& t : l.tensors) {
        c.tensors.push_back(t.tensor);
        keep.push_back(t);
      }
      out.push_back(std::move(c));
    }
    call([&](connector::ConnectorWorker& w) {
      return w.register_kv_caches(std::move(out), engine_allocated);
    });
    registered_ = std::move(keep);
  }
  void bind_connector_metadata(const py::bytes& metadata) {
    const std::string_view v = metadata;  // the bytes object outlives the call
    call([&](connector::ConnectorWorker& w) {
      return w.bind_connector_metadata(
          std::span<const std::byte>(reinterpret_cast<const std::byte*>(v.data()), v.size()));
    });
  }
  void clear_connector_metadata() {
    call([](connector::ConnectorWorker& w) {
      w.clear_connector_metadata();
      return Status::ok();
    });
  }
  void start_load_kv() {
    call([](connector::ConnectorWorker& w) { return w.start_load_kv(); });
  }
  void wait_for_layer_load(const std::string& layer) {
    call([&](connector::ConnectorWorker& w) { return w.wait_for_layer_load(layer); });
  }
  void save_kv_layer(const std::string& layer, std::shared_ptr<prefill::HostWriteEvent> event) {
    call([&](connector::ConnectorWorker& w) { return w.save_kv_layer(layer, std::move(event)); });
  }
  void wait_for_layer_send(const std::string& layer) {
    call([&](connector::ConnectorWorker& w) { return w.wait_for_layer_send(layer); });
  }
  void wait_for_save() {
    call([](connector::ConnectorWorker& w) { return w.wait_for_save(); });
  }

  // `all_gather(mine) -> [per rank]` over the TP group; None: this rank is the only one.
  std::pair<std::vector<std::string>, std::vector<std::string>> get_finished(
      const std::optional<py::function>& all_gather) {
    decode::AllGather gather =
        [](const decode::RankTerminal& mine) -> Expected<std::vector<decode::RankTerminal>> {
      return std::vector{mine};
    };
    if (all_gather) {
      py::function fn = *all_gather;
      gather =
          [fn](const decode::RankTerminal& mine) -> Expected<std::vector<decode::RankTerminal>> {
        py::gil_scoped_acquire acquire;
        try {
          return fn(mine).cast<std::vector<decode::RankTerminal>>();
        } catch (py::error_already_set& e) {
          return internal_error("the TP all-gather raised: " + std::string(e.what()));
        } catch (py::cast_error& e) {
          return invalid_argument(
              "the TP all-gather must return a list of {request id: failed} per rank: " +
              std::string(e.what()));
        }
      };
    }
    connector::FinishedTransfers out;
    call([&](connector::ConnectorWorker& w) {
      RD2H_TRY(done, w.get_finished(gather));
      out = std::move(done);
      return Status::ok();
    });
    return {std::move(out.sending), std::move(out.recving)};
  }
  // The per-layer loop of a forward pass, run in C++ on this worker, for the benchmark that
  // tells what the Python class adds: per step bind, start_load_kv, per layer
  // wait_for_layer_load + save_kv_layer (timed), wait_for_save, clear. Nanoseconds per layer.
  std::vector<int64_t> time_layer_loop(const py::bytes& metadata,
                                       const std::vector<std::string>& layers, int steps) {
    const std::string_view v = metadata;
    const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(v.data()), v.size());
    std::vector<int64_t> out;
    out.reserve(static_cast<size_t>(steps) * layers.size());
    call([&](connector::ConnectorWorker& w) {
      for (int step = 0; step < steps; ++step) {
        RD2H_RETURN_IF_ERROR(w.bind_connector_metadata(bytes));
        RD2H_RETURN_IF_ERROR(w.start_load_kv());
        for (const auto& layer : layers) {
          const auto t0 = std::chrono::steady_clock::now();
          RD2H_RETURN_IF_ERROR(w.wait_for_layer_load(layer));
          RD2H_RETURN_IF_ERROR(w.save_kv_layer(layer, nullptr));
          out.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now() - t0)
                            .count());
        }
        RD2H_RETURN_IF_ERROR(w.wait_for_save());
        w.clear_connector_metadata();
      }
      return Status::ok();
    });
    return out;
  }
  std::vector<int64_t> get_block_ids_with_load_errors() {
    std::vector<int64_t> out;
    call([&](connector::ConnectorWorker& w) {
      out = w.get_block_ids_with_load_errors();
      return Status::ok();
    });
    return out;
  }
  // Stops the connector's threads and unregisters its memory (after any call in flight
  // returned); later calls raise. Idempotent.
  void shutdown() {
    {
      py::gil_scoped_release release;
      std::lock_guard lock(mu_);
      if (w_) w_->shutdown();
      w_.reset();
    }
    registered_.clear();
  }

 private:
  // Runs f(worker) without the GIL, under the mutex; raises its error.
  template <typename F>
  void call(F&& f) {
    Status s;
    {
      py::gil_scoped_release release;
      std::lock_guard lock(mu_);
      s = w_ ? f(*w_) : failed_precondition("the connector worker is shut down");
    }
    raise_if_error(s);
  }

  std::mutex mu_;
  std::unique_ptr<connector::ConnectorWorker> w_;
  std::vector<PyCacheTensor> registered_;  // touched with the GIL held only
};

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
}  // namespace rd2h::python

PYBIND11_MODULE(_native, m) {
  using namespace rd2h;
  using namespace rd2h::python;
  m.doc() = "rd2h: layerwise KV-cache transfer for prefill/decode disaggregated serving";
  m.attr("__version__") = RD2H_VERSION;

  Errors& err = errors();
  err.base = py::reinterpret_steal<py::object>(PyErr_NewExceptionWithDoc(
      "rd2h.Error", "An rd2h call failed; .code names the kind.", PyExc_RuntimeError, nullptr));
  auto sub = [&](const char* name, const char* doc, PyObject* also) {
    py::tuple bases = py::make_tuple(err.base, py::handle(also));
    return py::reinterpret_steal<py::object>(
        PyErr_NewExceptionWithDoc(name, doc, bases.ptr(), nullptr));
  };
  err.invalid_argument =
      sub("rd2h.InvalidArgument", "A malformed argument, setting or message.", PyExc_ValueError);
  err.timeout = sub("rd2h.Timeout", "A bounded wait ran out.", PyExc_TimeoutError);
  err.peer = sub("rd2h.PeerError", "A peer is gone or cannot be reached.", PyExc_ConnectionError);
  m.attr("Error") = err.base;
  m.attr("InvalidArgument") = err.invalid_argument;
  m.attr("Timeout") = err.timeout;
  m.attr("PeerError") = err.peer;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      translate(e);
    }
  });

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

  py::class_<Worker>(m, "Worker", "The worker role of the connector, one per TP rank.")
      .def(py::init<const connector::ConnectorConfig&, connector::Parallel, int>(),
           py::arg("config"), py::arg("parallel"), py::arg("tp_rank"))
      .def("register_kv_caches", &Worker::register_kv_caches, py::arg("layers"),
           py::arg("engine_allocated") = false)
      .def("bind_connector_metadata", &Worker::bind_connector_metadata, py::arg("metadata"))
      .def("clear_connector_metadata", &Worker::clear_connector_metadata)
      .def("start_load_kv", &Worker::start_load_kv)
      .def("wait_for_layer_load", &Worker::wait_for_layer_load, py::arg("layer_name"))
      .def("save_kv_layer", &Worker::save_kv_layer, py::arg("layer_name"),
           py::arg("event") = nullptr)
      .def("wait_for_layer_send", &Worker::wait_for_layer_send, py::arg("layer_name"))
      .def("wait_for_save", &Worker::wait_for_save)
      .def("get_finished", &Worker::get_finished, py::arg("all_gather") = py::none())
      .def("get_block_ids_with_load_errors", &Worker::get_block_ids_with_load_errors)
      .def("shutdown", &Worker::shutdown)
      .def("_time_layer_loop", &Worker::time_layer_loop, py::arg("metadata"), py::arg("layers"),
           py::arg("steps"));

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
