// rd2h.Worker: the worker role of the connector, one per TP rank. Its calls run without the
// GIL; the KV caches it registered are kept alive until shutdown() or until it is gone.
#include "rd2h/connector/worker.h"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "native.h"
#include "rd2h/connector/config.h"
#include "rd2h/connector/stats.h"
#include "rd2h/decode/all_gather.h"
#include "rd2h/prefill/write_event.h"

namespace rd2h::python {
namespace {

// `all_gather(mine) -> [per rank]` over the TP group, called with the GIL; None: this rank is
// the only one. What it raises, or a result of the wrong shape, is the gather's error.
decode::AllGather tp_all_gather(const std::optional<py::function>& all_gather) {
  if (!all_gather) {
    return [](const decode::RankTerminal& mine) -> Expected<std::vector<decode::RankTerminal>> {
      return std::vector{mine};
    };
  }
  py::function fn = *all_gather;
  return [fn](const decode::RankTerminal& mine) -> Expected<std::vector<decode::RankTerminal>> {
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
    decode::AllGather gather = tp_all_gather(all_gather);
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
  // What this rank's reads did so far (Decode): cumulative counters.
  connector::TransferStats transfer_stats() {
    connector::TransferStats out;
    call([&](connector::ConnectorWorker& w) {
      out = w.transfer_stats();
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
  using Blocks = std::pair<std::vector<int64_t>, std::vector<int64_t>>;
  Blocks step_blocks() {
    return blocks([](connector::ConnectorWorker& w) { return w.step_blocks(); });
  }
  Blocks take_loaded_blocks() {
    return blocks([](connector::ConnectorWorker& w) { return w.take_loaded_blocks(); });
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

  // (main, indexer) block ids of one of ConnectorWorker's BlockIds getters.
  template <typename F>
  Blocks blocks(F get) {
    Blocks out;
    call([&](connector::ConnectorWorker& w) {
      auto b = get(w);
      out = {std::move(b.main), std::move(b.indexer)};
      return Status::ok();
    });
    return out;
  }

  std::mutex mu_;
  std::unique_ptr<connector::ConnectorWorker> w_;
  std::vector<PyCacheTensor> registered_;  // touched with the GIL held only
};

}  // namespace

void bind_worker(py::module_& m) {
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
      .def("step_blocks", &Worker::step_blocks,
           "Prefill: (main, indexer) block ids the bound step publishes, sorted, distinct.")
      .def("take_loaded_blocks", &Worker::take_loaded_blocks,
           "Decode: (main, indexer) destination blocks of the requests the last get_finished "
           "reported finished, sorted, distinct; taken once.")
      .def(
          "transfer_stats",
          [](Worker& w) {
            const connector::TransferStats s = w.transfer_stats();
            py::dict d;
            d["layers_done"] = s.layers_done;
            d["layers_failed"] = s.layers_failed;
            d["reads"] = s.reads;
            d["bytes_read"] = s.bytes_read;
            d["read_seconds"] = s.read_seconds_sum;
            d["readiness_sent"] = s.readiness_sent;
            d["peer_failures"] = s.peer_failures;
            return d;
          },
          "This rank's transfers so far, cumulative: on Decode layers_done, layers_failed, "
          "reads, bytes_read, read_seconds; on Prefill readiness_sent, peer_failures.")
      .def("shutdown", &Worker::shutdown)
      .def("_time_layer_loop", &Worker::time_layer_loop, py::arg("metadata"), py::arg("layers"),
           py::arg("steps"));
}

}  // namespace rd2h::python
