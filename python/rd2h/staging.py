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
Prefill copy runs on a side stream after the compute stream's work so far, and a thread
completes the write event when the copy's event has. Elsewhere copies run on the calling
thread and are complete when they return.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional

import rd2h

# vLLM's CopyBlocksOp: (src caches, dst caches, src block ids, dst block ids, "h2d" | "d2h").
CopyOp = Callable[[dict, dict, list, list, str], None]


def device_module(device_type: str) -> Optional[Any]:
    """torch's module for a device type when it has streams and events and is usable."""
    import torch

    mod = getattr(torch, device_type, None)
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

    def __init__(self, device_type: str, timeout_s: float):
        self._module = device_module(device_type)
        self._timeout_s = timeout_s
        self._copy: Optional[CopyOp] = None
        # main layer name -> ({run name: device run}, {run name: host run}) for its main KV,
        # and the same for its indexer
        self._main: dict[str, tuple[dict, dict]] = {}
        self._indexer: dict[str, tuple[dict, dict]] = {}
        self._stream = None
        self._pending: "queue.Queue" = queue.Queue()
        self._thread: Optional[threading.Thread] = None

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

    def save_layer(self, main_layer: str, main_blocks: list, indexer_blocks: list) -> "rd2h.HostWriteEvent":
        """Copies the layer's blocks device->host; the returned event completes when they are
        on the host."""
        copy = self._need_copy()
        event = rd2h.HostWriteEvent()

        def copies() -> None:
            if main_blocks:
                dev, host = self._main[main_layer]
                copy(dev, host, main_blocks, main_blocks, "d2h")
            if indexer_blocks and main_layer in self._indexer:
                dev, host = self._indexer[main_layer]
                copy(dev, host, indexer_blocks, indexer_blocks, "d2h")

        if self._module is None:
            try:
                copies()
            except Exception as e:  # the layer fails with the reason, as a failed read would
                event.complete(f"copying layer {main_layer} to host memory failed: {e}")
                return event
            event.complete()
            return event
        mod = self._module
        if self._stream is None:
            self._stream = mod.Stream()
        self._stream.wait_stream(mod.current_stream())  # after the layer's KV is written
        with mod.stream(self._stream):
            copies()
            done = mod.Event()
            done.record(self._stream)
        self._completer().put((done, event, main_layer))
        return event

    def _completer(self) -> "queue.Queue":
        if self._thread is None:
            self._thread = threading.Thread(target=self._complete_in_order, daemon=True,
                                            name="rd2h-d2h")
            self._thread.start()
        return self._pending

    def _complete_in_order(self) -> None:
        while True:
            item = self._pending.get()
            if item is None:
                return
            done, event, layer = item
            try:
                done.synchronize()
                event.complete()
            except Exception as e:
                event.complete(f"copying layer {layer} to host memory failed: {e}")

    def load(self, main_blocks: list, indexer_blocks: list) -> None:
        """Copies the blocks of every layer host->device; returns when they are on the device."""
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
