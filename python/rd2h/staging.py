"""KV caches in device memory, moved through host buffers (vLLM's ``kv_buffer_device: "cpu"``).

rd2h reads and serves host memory. When the KV caches a worker registers live on a device
(a GPU or an NPU), the connector registers host mirrors of them instead (the same shape,
strides and block layout, page-locked where the platform offers it) and copies blocks
between the two with the copy operation vLLM hands connectors (``set_host_xfer_buffer_ops``):

- Prefill copies a layer's blocks of the step device->host in ``save_kv_layer``; the
  layer's readiness goes out once that copy is complete (its completion is the layer's
  write event), never before.
- Decode reads into the host mirrors and copies a request's blocks host->device before the
  request is reported finished.

Where the device has streams and events (``torch.cuda``, ``torch.npu``, ``torch.xpu``), the
compute thread only records an event on its stream; a copy thread of the connector's makes a
side stream wait for that event, runs the copy operation there and completes the layer's
write event once the copy's own event has. vLLM's copy operations end in a host-blocking
``.cpu()``: on the copy thread that blocks nobody, and the next layer's compute goes on. Where
the device has no streams, copies run on the calling thread and are complete when they
return.

Decode may keep main KV on the host (``main_kv_on_host``): then only the indexer caches are
copied to the device, and the engine reads main KV from the host mirrors (``host_caches``), as
the design's sparse Decode offload does with its host pool.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional

import rd2h

# vLLM's CopyBlocksOp: (src caches, dst caches, src block ids, dst block ids, "h2d" | "d2h").
CopyOp = Callable[[dict, dict, list, list, str], None]


def device_module(device_type: str) -> Optional[Any]:
    """torch's module for a device type when it has streams and events and is usable (never
    the CPU's: its work is done when a call returns)."""
    import torch

    mod = None if device_type == "cpu" else getattr(torch, device_type, None)
    if mod is None or not all(hasattr(mod, a) for a in ("Stream", "Event", "current_stream")):
        return None
    available = getattr(mod, "is_available", None)
    return mod if available is None or available() else None


def device_of(value: Any) -> Optional[Any]:
    """The torch device of a KV cache value (a tensor, or a tuple or list of them)."""
    first = value[0] if isinstance(value, (tuple, list)) and value else value
    return getattr(first, "device", None)


def is_on_device(value: Any) -> bool:
    device = device_of(value)
    return device is not None and device.type != "cpu"


def host_mirror(tensor: Any) -> Any:
    """An uninitialized host tensor with the tensor's shape, strides and dtype (page-locked
    when the platform can pin memory)."""
    import torch

    def mirror(pin: bool) -> Any:
        return torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()),
                                   dtype=tensor.dtype, device="cpu", pin_memory=pin)

    if device_module(tensor.device.type) is None:
        return mirror(False)
    try:
        return mirror(True)
    except RuntimeError:  # this torch cannot pin (a CPU build): pageable memory works too
        return mirror(False)


class HostStaging:
    """The device caches of a worker's main layers (and their indexers) and their host mirrors,
    as block runs (views whose first dimension is the block), and the copies between them."""

    def __init__(self, device: Any, timeout_s: float, main_on_host: bool = False):
        self._device = device
        self._module = device_module(device.type)
        self._timeout_s = timeout_s
        self._main_on_host = main_on_host
        self._copy: Optional[CopyOp] = None
        # main layer name -> ({run name: device run}, {run name: host run}) for its main KV,
        # and the same for its indexer
        self._main: dict[str, tuple[dict, dict]] = {}
        self._indexer: dict[str, tuple[dict, dict]] = {}
        self._mirrors: dict[str, list] = {}  # vLLM's layer name -> its host mirrors
        self._pending: "queue.Queue" = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    def mirror(self, name: str, tensors: list) -> list:
        """Host mirrors of a layer's device tensors, kept for ``host_caches``."""
        self._mirrors[name] = [host_mirror(t) for t in tensors]
        return self._mirrors[name]

    def host_caches(self) -> dict:
        """vLLM's layer name -> the host mirrors of its device caches."""
        return dict(self._mirrors)

    def add_layer(self, name: str, device_runs: list, host_runs: list, indexer: bool) -> None:
        runs = ({f"{name}#{i}": r for i, r in enumerate(device_runs)},
                {f"{name}#{i}": r for i, r in enumerate(host_runs)})
        (self._indexer if indexer else self._main)[name] = runs

    def set_copy_op(self, copy: CopyOp) -> None:
        self._copy = copy

    def _need_copy(self) -> CopyOp:
        if self._copy is None:
            raise rd2h.Error(
                "the KV caches are in device memory and vLLM gave no host copy operation "
                "(set_host_xfer_buffer_ops): this vLLM cannot stage KV through host buffers"
            )
        return self._copy

    def _copy_to_host(self, copy: CopyOp, main_layer: str, main_blocks: list,
                      indexer_blocks: list) -> None:
        if main_blocks:
            dev, host = self._main[main_layer]
            copy(dev, host, main_blocks, main_blocks, "d2h")
        if indexer_blocks and main_layer in self._indexer:
            dev, host = self._indexer[main_layer]
            copy(dev, host, indexer_blocks, indexer_blocks, "d2h")

    def save_layer(self, main_layer: str, main_blocks: list, indexer_blocks: list) -> "rd2h.HostWriteEvent":
        """Copies the layer's blocks device->host; the returned event completes when they are
        on the host (or with the reason the copy failed)."""
        copy = self._need_copy()
        event = rd2h.HostWriteEvent()
        if self._module is None:
            try:
                self._copy_to_host(copy, main_layer, main_blocks, indexer_blocks)
            except Exception as e:  # the layer fails with the reason, as a failed read would
                event.complete(f"copying layer {main_layer} to host memory failed: {e}")
                return event
            event.complete()
            return event
        written = self._module.Event()
        written.record(self._module.current_stream())  # the layer's KV, once computed
        self._copier().put((written, copy, main_layer, main_blocks, indexer_blocks, event))
        return event

    def _copier(self) -> "queue.Queue":
        if self._thread is None:
            self._thread = threading.Thread(target=self._copy_in_order, daemon=True,
                                            name="rd2h-d2h")
            self._thread.start()
        return self._pending

    def _copy_in_order(self) -> None:
        """The copy thread: each layer's copy on a side stream, after its KV was written, and
        its write event completed once the copy is."""
        mod = self._module
        stream = None
        while True:
            item = self._pending.get()
            if item is None:
                return
            written, copy, layer, main_blocks, indexer_blocks, event = item
            try:
                if stream is None:
                    stream = mod.Stream(device=self._device)
                stream.wait_event(written)
                with mod.stream(stream):
                    self._copy_to_host(copy, layer, main_blocks, indexer_blocks)
                    done = mod.Event()
                    done.record(stream)
                done.synchronize()
                event.complete()
            except Exception as e:
                event.complete(f"copying layer {layer} to host memory failed: {e}")

    def load(self, main_blocks: list, indexer_blocks: list) -> None:
        """Copies the blocks of every layer host->device (main KV only if it does not stay on
        the host); returns when they are on the device."""
        if self._main_on_host:
            main_blocks = []
        if not main_blocks and not indexer_blocks:
            return
        copy = self._need_copy()
        for table, blocks in ((self._main, main_blocks), (self._indexer, indexer_blocks)):
            if not blocks:
                continue
            for dev, host in table.values():
                copy(host, dev, blocks, blocks, "h2d")
        if self._module is not None:
            self._module.current_stream().synchronize()

    def close(self) -> None:
        if self._thread is not None:
            self._pending.put(None)
            self._thread.join(timeout=self._timeout_s)
            self._thread = None
