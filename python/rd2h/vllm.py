"""rd2h as a vLLM KV Connector V1.

vLLM loads it with::

    --kv-transfer-config '{"kv_connector": "Rd2hConnector",
                           "kv_connector_module_path": "rd2h.vllm",
                           "kv_role": "kv_producer" | "kv_consumer", "kv_port": 30000, ...}'

The class maps vLLM's objects (requests, block lists, scheduler output, layer tensors)
onto rd2h's scheduler-role and worker-role facades; no transfer logic lives here.

- Decode (kv_consumer) pulls each request's KV asynchronously: ``get_num_new_matched_tokens``
  returns the remaining prompt tokens with ``load_async=True``, ``get_finished`` reports the
  request once every TP rank holds its KV (or its read failed: its blocks then come back
  from ``get_block_ids_with_load_errors``, and vLLM applies ``kv_load_failure_policy``).
- Prefill (kv_producer) publishes each layer from ``save_kv_layer``. vLLM calls
  ``wait_for_layer_load`` before an attention layer writes its KV and never calls
  ``wait_for_layer_send``, so on Prefill ``wait_for_layer_load`` waits until Decode has read
  what the layer's physical buffers held before.

KV caches in host (CPU) memory are registered with the transfer engine as they are, without
copies. KV caches on a device (GPU, NPU) move through host buffers with the copy operation
vLLM hands the connector, when ``kv_buffer_device`` is ``"cpu"`` (``rd2h.staging``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import os
import re
import time
from typing import Any, Iterable, Optional

import rd2h
from rd2h import staging

if importlib.util.find_spec("vllm") is not None:
    # Real vLLM: subclass its own classes (vLLM checks with isinstance). A broken vLLM
    # install raises here rather than silently loading the stand-ins.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )

    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA  # type: ignore
    except ImportError:  # older layouts keep it next to the base
        from vllm.distributed.kv_transfer.kv_connector.v1 import SupportsHMA  # type: ignore
    USING_VLLM = True
else:
    from rd2h._vllm_standin import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        SupportsHMA,
    )

    USING_VLLM = False

__all__ = ["Rd2hConnector", "Rd2hConnectorMetadata", "USING_VLLM"]

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def layer_index(name: str) -> Optional[int]:
    """The n of "layers.<n>" in a layer name, or None."""
    m = _LAYER_INDEX.search(name)
    return int(m.group(1)) if m else None


def is_indexer_layer(name: str) -> bool:
    return "indexer" in name.lower()


def _dense(shape: tuple, strides: tuple, dims: list) -> int:
    """The elements dims span if they pack densely (innermost stride 1), else 0."""
    span = 1
    for d in sorted(dims, key=lambda d: strides[d]):
        if strides[d] != span:
            return 0
        span *= shape[d]
    return span


def block_runs(name: str, tensor: Any, num_blocks: int) -> list:
    """A layer's KV cache tensor as views of ``[num_blocks, block_elems]``, one per run of blocks.

    The block dimension is the one of ``num_blocks`` entries with the largest stride, found
    from the tensor's own shape and strides (the attention backend's layout, as allocated).
    Each block must be one dense run of memory; a dimension outside the block (K and V of a
    ``[2, num_blocks, ...]`` layout) gives a view per entry. Anything else is refused by name.
    """
    if not hasattr(tensor, "stride"):  # a plain buffer: blocks along its first dimension
        return [tensor]
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    dims = [d for d, n in enumerate(shape) if n == num_blocks]
    if not dims:
        raise rd2h.InvalidArgument(
            f"KV cache layer {name!r}: no dimension of {num_blocks} blocks in shape {shape}"
        )
    b = max(dims, key=lambda d: strides[d])
    live = [d for d in range(len(shape)) if d != b and shape[d] > 1]
    inner = [d for d in live if strides[d] < strides[b]]
    outer = sorted((d for d in live if strides[d] >= strides[b]), key=lambda d: -strides[d])
    block_elems = _dense(shape, strides, inner)
    if block_elems == 0 or block_elems != strides[b]:
        raise rd2h.InvalidArgument(
            f"KV cache layer {name!r}: a block is not one contiguous run of memory "
            f"(shape {shape}, strides {strides}); rd2h reads each block as one range"
        )
    if outer:
        d = outer[0]
        return [v for i in range(shape[d]) for v in block_runs(name, tensor.select(d, i), num_blocks)]
    return [tensor.as_strided((num_blocks, block_elems), (strides[b], 1))]


def _check_layout(name: Optional[str]) -> None:
    """Refuses a vLLM KV cache layout whose per-layer blocks are not outermost."""
    if name is None or not USING_VLLM:
        return
    from vllm.v1.kv_cache_layout import KVCacheLayout  # type: ignore

    layout = KVCacheLayout[name]
    if layout.value[:2] != (0, 1):  # [L, B, ...]: a layer's blocks, each one run
        raise rd2h.InvalidArgument(
            f"KV cache layout {name} interleaves layers within a block; rd2h reads one "
            "layer's blocks as ranges: use a layout with the layer, then the block, "
            "outermost (VLLM_KV_CACHE_LAYOUT=LBHNC or LBNHC)"
        )


class Rd2hConnectorMetadata(KVConnectorMetadata):
    """One step's connector metadata: the bytes rd2h's scheduler encoded (picklable).

    ``corrupt`` is for tests only (``TEST_CORRUPT_SETTING``): request id -> the block of it
    the Decode worker overwrites once the request's KV arrived. ``digests`` is for tests
    only (``TEST_DIGEST_SETTING``): request id -> (prompt key, the prompt's block ids).
    """

    def __init__(self, data: bytes, corrupt: Optional[dict] = None, num_requests: int = 0,
                 digests: Optional[dict] = None):
        self.data = data
        self.corrupt = corrupt or {}
        self.num_requests = num_requests  # scheduled in the step
        self.digests = digests or {}

    def __reduce__(self):
        return (Rd2hConnectorMetadata,
                (self.data, self.corrupt, self.num_requests, self.digests))


# A test-only setting of kv_connector_extra_config: a Decode worker negates one block of the
# first layer's KV (the first block it pulled) of each request whose KV arrived, before the
# request is reported finished. It exists to show that a check of the answers sees wrong
# KV; it is never for serving.
TEST_CORRUPT_SETTING = "test_corrupt_pulled_block"

# A test-only setting of kv_connector_extra_config: a directory into which the worker writes,
# per request, the SHA-256 of its prompt's KV blocks (every main layer in layer order, every
# tensor run of the layer, every block of the prompt in order) in "<prefill|decode>-<key>",
# the key being the SHA-256 of the prompt's token ids. Prefill writes it when the step that
# computes the prompt's last token saves its last layer (before any Decode is told of that
# layer, so the file is there before the request can finish); Decode once the KV arrived.
# Equal files on both sides say Decode holds the bytes Prefill computed, where the answers
# cannot be compared with a single instance's (vLLM's CPU MLA). Never for serving.
TEST_DIGEST_SETTING = "test_kv_digest_dir"

# A test-only setting of kv_connector_extra_config: KV caches in host memory take the path of
# device caches (host mirrors, and vLLM's copy operation between them and the caches), so
# that the staging path runs inside a real vLLM engine on a machine without a device. It
# only adds copies; never for serving.
TEST_STAGE_SETTING = "test_stage_host_caches"
TEST_SETTINGS = (TEST_CORRUPT_SETTING, TEST_DIGEST_SETTING, TEST_STAGE_SETTING)

# A setting of kv_connector_extra_config read here, not by rd2h's core: on a Decode whose KV
# caches are on a device, main KV stays in the host buffers it was read into and only the
# indexer caches are copied to the device; the engine reads main KV from
# ``Rd2hConnector.host_kv_caches()`` (the design's sparse Decode offload keeps main KV in a
# host pool). False by default: every cache is copied to the device.
MAIN_KV_ON_HOST_SETTING = "main_kv_on_host"
VLLM_LAYER_SETTINGS = TEST_SETTINGS + (MAIN_KV_ON_HOST_SETTING,)


def prompt_key(token_ids: Iterable[int]) -> str:
    """The name a prompt's KV digest is filed under (TEST_DIGEST_SETTING)."""
    return hashlib.sha256(json.dumps(list(token_ids)).encode()).hexdigest()[:32]


def _kv_transfer_config_json(ktc: Any) -> str:
    extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
    for setting in VLLM_LAYER_SETTINGS:
        extra.pop(setting, None)
    config = {
        "kv_connector": ktc.kv_connector,
        "kv_role": ktc.kv_role,
        "kv_port": ktc.kv_port,
        "engine_id": getattr(ktc, "engine_id", None),
        "kv_ip": getattr(ktc, "kv_ip", None),
        "kv_connector_extra_config": dict(extra),
    }
    return json.dumps(config)


def _parallel(vllm_config: Any) -> "rd2h.Parallel":
    pc = vllm_config.parallel_config
    return rd2h.Parallel(
        tp_size=int(getattr(pc, "tensor_parallel_size", 1)),
        pcp_size=int(getattr(pc, "prefill_context_parallel_size", 1) or 1),
        dcp_size=int(getattr(pc, "decode_context_parallel_size", 1) or 1),
        global_dp_rank=int(getattr(pc, "data_parallel_rank", 0) or 0),
    )


def _params_json(params: Optional[dict]) -> Optional[str]:
    return None if params is None else json.dumps(params)


# For benchmarks: a directory into which each worker appends, per step, the step's number of
# requests and, for each layer, the nanoseconds its per-layer calls (wait_for_layer_load +
# save_kv_layer) took, as "wall/cpu": wall-clock time, and the calling thread's CPU time (what
# the connector itself costs, without the time the thread was preempted by other processes).
LAYER_TIMES_ENV = "RD2H_VLLM_LAYER_TIMES"


def _time_layers(connector: "Rd2hConnector", directory: str) -> None:
    """Wraps the connector's per-layer calls (on the instance only) to record their time."""
    log = open(os.path.join(directory, f"layer-times-{os.getpid()}.txt"), "a")
    load, save = connector.wait_for_layer_load, connector.save_kv_layer
    bind, clear = connector.bind_connector_metadata, connector.clear_connector_metadata
    per_layer: dict[str, list[int]] = {}
    step = {"requests": 0}

    def add(layer_name: str, wall: int, cpu: int) -> None:
        times = per_layer.setdefault(layer_name, [0, 0])
        times[0] += wall
        times[1] += cpu

    def timed_bind(metadata: Any) -> None:
        step["requests"] = getattr(metadata, "num_requests", 0)
        bind(metadata)

    def timed_load(layer_name: str) -> None:
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        load(layer_name)
        add(layer_name, time.perf_counter_ns() - t0, time.thread_time_ns() - c0)

    def timed_save(layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        save(layer_name, kv_layer, attn_metadata, **kwargs)
        add(layer_name, time.perf_counter_ns() - t0, time.thread_time_ns() - c0)

    def timed_clear() -> None:
        if per_layer and step["requests"]:
            log.write(f"{step['requests']} "
                      f"{' '.join(f'{w}/{c}' for w, c in per_layer.values())}\n")
            log.flush()
        per_layer.clear()
        clear()

    connector.bind_connector_metadata = timed_bind  # type: ignore[method-assign]
    connector.wait_for_layer_load = timed_load  # type: ignore[method-assign]
    connector.save_kv_layer = timed_save  # type: ignore[method-assign]
    connector.clear_connector_metadata = timed_clear  # type: ignore[method-assign]


class Rd2hConnector(KVConnectorBase_V1, SupportsHMA):
    """rd2h's KV Connector V1: the scheduler role or the worker role, per ``role``."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        base_init = KVConnectorBase_V1.__init__
        if "kv_cache_config" in inspect.signature(base_init).parameters:
            base_init(self, vllm_config, role, kv_cache_config)
        else:
            base_init(self, vllm_config, role)
        self._kv_cache_config = kv_cache_config
        ktc = vllm_config.kv_transfer_config
        self._config = rd2h.ConnectorConfig.from_json(_kv_transfer_config_json(ktc))
        self._parallel = _parallel(vllm_config)
        self._scheduler: Optional[rd2h.Scheduler] = None
        self._worker: Optional[rd2h.Worker] = None
        self._main_layers: set[str] = set()
        extra = getattr(ktc, "kv_connector_extra_config", None) or {}
        self._test_corrupt = bool(extra.get(TEST_CORRUPT_SETTING, False))
        if self._test_corrupt and self._config.role != rd2h.KvRole.CONSUMER:
            raise rd2h.InvalidArgument(
                f"kv_connector_extra_config.{TEST_CORRUPT_SETTING} is for a Decode (kv_consumer)"
            )
        self._digest_dir = extra.get(TEST_DIGEST_SETTING) or None
        if self._digest_dir:
            os.makedirs(self._digest_dir, exist_ok=True)
        self._stage_host = bool(extra.get(TEST_STAGE_SETTING, False))
        self._main_on_host = extra.get(MAIN_KV_ON_HOST_SETTING, False)
        if not isinstance(self._main_on_host, bool):
            raise rd2h.InvalidArgument(
                f"kv_connector_extra_config.{MAIN_KV_ON_HOST_SETTING} is "
                f"{self._main_on_host!r}; expected true or false")
        if self._main_on_host and self._config.role != rd2h.KvRole.CONSUMER:
            raise rd2h.InvalidArgument(
                f"kv_connector_extra_config.{MAIN_KV_ON_HOST_SETTING} is for a Decode "
                "(kv_consumer): Prefill's main KV is read from its host buffers anyway")
        self._digest_next: dict[str, tuple] = {}  # scheduler: for the next metadata
        self._digest_blocks: dict[str, tuple] = {}  # scheduler (Prefill): key, tokens, blocks
        self._digest_pending: dict[str, tuple] = {}  # worker: until the KV is complete
        self._main_runs: list = []  # worker: each main layer's block runs the engine
        # computes with (the device caches when staged), in layer order
        self._last_main_layer: Optional[str] = None
        self._corrupt_next: dict[str, int] = {}  # scheduler: for the next metadata
        self._corrupt_pending: dict[str, int] = {}  # worker: until the KV arrived
        self._corrupt_target: list = []  # worker: the first layer's block runs
        self._block_size = int(vllm_config.cache_config.block_size)
        self._stats_reported: dict = {}  # worker: the transfer counters last reported
        self._kv_buffer_device = str(getattr(ktc, "kv_buffer_device", "cpu") or "cpu")
        self._staging: Optional[staging.HostStaging] = None  # worker: device caches only
        self._host_copy: Optional[staging.CopyOp] = None
        self._step_blocks: tuple = ([], [])  # worker, staged: the bound step's blocks
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = rd2h.Scheduler(
                self._config, self._parallel, self._groups(vllm_config, kv_cache_config)
            )
        else:
            self._tp_rank = self._find_tp_rank(vllm_config)
            self._worker = rd2h.Worker(self._config, self._parallel, self._tp_rank)
            times = os.environ.get(LAYER_TIMES_ENV)
            if times:
                _time_layers(self, times)

    # ---- configuration -------------------------------------------------------------------

    @staticmethod
    def _groups(vllm_config: Any, kv_cache_config: Any) -> list:
        if kv_cache_config is not None and getattr(kv_cache_config, "kv_cache_groups", None):
            return [
                rd2h.KvCacheGroup(list(g.layer_names), int(g.kv_cache_spec.block_size))
                for g in kv_cache_config.kv_cache_groups
            ]
        # No kv_cache_config (older vLLM): one group serves main KV and the indexer.
        return [rd2h.KvCacheGroup(["model.layers.0.self_attn"], int(vllm_config.cache_config.block_size))]

    def _find_tp_rank(self, vllm_config: Any) -> int:
        if USING_VLLM:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank  # type: ignore

            return int(get_tensor_model_parallel_rank())
        return int(getattr(vllm_config.parallel_config, "rank", 0)) % self._parallel.tp_size

    def _group_of_layer(self) -> dict[str, int]:
        groups = getattr(self._kv_cache_config, "kv_cache_groups", None) or []
        return {name: g for g, group in enumerate(groups) for name in group.layer_names}

    # ---- scheduler role ------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[Optional[int], bool]:
        assert self._scheduler is not None, "a scheduler-role call on the worker role"
        tokens, load_async = self._scheduler.get_num_new_matched_tokens(
            request.request_id,
            request.num_prompt_tokens,
            _params_json(request.kv_transfer_params),
            num_computed_tokens,
        )
        return tokens, load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None, "a scheduler-role call on the worker role"
        params = request.kv_transfer_params
        block_ids = [list(group) for group in blocks.get_block_ids()]
        still_remote = self._scheduler.update_state_after_alloc(
            request.request_id,
            request.num_prompt_tokens,
            _params_json(params),
            block_ids,
            num_external_tokens,
        )
        if self._test_corrupt and num_external_tokens > 0 and block_ids and block_ids[0]:
            first_pulled = request.num_computed_tokens // self._block_size
            self._corrupt_next[request.request_id] = block_ids[0][first_pulled]
        if self._digest_dir and num_external_tokens > 0 and block_ids and block_ids[0]:
            self._digest_next[request.request_id] = (
                prompt_key(request.prompt_token_ids),
                block_ids[0][: self._prompt_blocks(request.num_prompt_tokens)],
            )
        # Decode sets up the pull once: a second call (or a recompute after a failed load)
        # must not pull again.
        if params is not None and params.get("do_remote_prefill") and not still_remote:
            params["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None, "a scheduler-role call on the worker role"
        scheduled = []
        # Speculative tokens are scheduled but not computed until they are accepted: they
        # do not count.
        spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
        plain = dict(scheduler_output.num_scheduled_tokens)
        counts = {r: n - len(spec.get(r, ())) for r, n in plain.items()}
        # New requests: their blocks reached update_state_after_alloc already.
        for r in scheduler_output.scheduled_new_reqs:
            scheduled.append((r.req_id, [], r.num_computed_tokens + counts.get(r.req_id, 0), False))
        cached = scheduler_output.scheduled_cached_reqs
        # A resumed request's block list replaces the one it lost when preempted.
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            groups = [list(g) for g in new_blocks] if new_blocks else []
            computed = cached.num_computed_tokens[i] + counts.get(req_id, 0)
            scheduled.append((req_id, groups, computed, req_id in resumed))
        if self._digest_dir and self._config.role == rd2h.KvRole.PRODUCER:
            self._track_prompt_blocks(scheduler_output, scheduled)
        corrupt, self._corrupt_next = self._corrupt_next, {}
        digests, self._digest_next = self._digest_next, {}
        return Rd2hConnectorMetadata(self._scheduler.build_connector_meta(scheduled), corrupt,
                                     len(scheduled), digests)

    def _prompt_blocks(self, num_prompt_tokens: int) -> int:
        return -(-num_prompt_tokens // self._block_size)

    def _track_prompt_blocks(self, scheduler_output: Any, scheduled: list) -> None:
        """TEST_DIGEST_SETTING on Prefill: each request's blocks, until the step that computes
        its prompt's last token, whose metadata asks the worker for the digest."""
        for r in scheduler_output.scheduled_new_reqs:
            groups = r.block_ids or ([],)
            self._digest_blocks[r.req_id] = (
                prompt_key(r.prompt_token_ids), len(r.prompt_token_ids), list(groups[0]))
        for req_id, groups, computed, resumed in scheduled:
            known = self._digest_blocks.get(req_id)
            if known is None:
                continue
            key, prompt_tokens, blocks = known
            if groups:
                blocks = list(groups[0]) if resumed else blocks + list(groups[0])
                self._digest_blocks[req_id] = (key, prompt_tokens, blocks)
            if computed >= prompt_tokens:
                self._digest_next[req_id] = (key, blocks[: self._prompt_blocks(prompt_tokens)])
                del self._digest_blocks[req_id]

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, Optional[dict[str, Any]]]:
        assert self._scheduler is not None, "a scheduler-role call on the worker role"
        # rd2h never holds blocks past the request: Prefill's are free once wait_for_save
        # returned, and Decode's belong to the request it is about to decode.
        self._scheduler.request_finished(
            request.request_id, request.num_prompt_tokens, _params_json(request.kv_transfer_params)
        )
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, Optional[dict[str, Any]]]:
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def update_connector_output(self, connector_output: Any) -> None:
        return

    def take_events(self) -> Iterable[Any]:
        return ()

    def get_finished_count(self) -> Optional[int]:
        return None  # every worker rank reports every id

    # ---- worker role ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None, "a worker-role call on the scheduler role"
        group_of = self._group_of_layer()
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        _check_layout(getattr(self._kv_cache_config, "kv_cache_layout", None))
        main: dict[int, tuple[str, list]] = {}
        indexer: dict[int, list] = {}
        main_runs: dict[int, list] = {}  # layer -> its main tensors' block runs
        self._staging = self._host_staging(kv_caches)
        # (layer, is indexer) -> the device caches' block runs and their host mirrors' runs
        staged: dict[tuple[int, bool], tuple[list, list]] = {}

        def runs_of(name: str, given: list) -> list:
            if num_blocks is None:
                return list(given)
            return [r for t in given for r in block_runs(name, t, num_blocks)]

        for name, value in kv_caches.items():
            n = layer_index(name)
            if n is None:
                raise rd2h.InvalidArgument(
                    f"KV cache layer {name!r} has no 'layers.<n>' to take its index from"
                )
            given = list(value) if isinstance(value, (tuple, list)) else [value]
            g = group_of.get(name, 0)
            device_runs = None
            if self._staging is not None:
                device_runs = runs_of(name, given)
                given = self._staging.mirror(name, given)
            tensors = runs_of(name, given)
            engine_runs = tensors
            if device_runs is not None:
                staged[(n, is_indexer_layer(name))] = (device_runs, tensors)
                if not self._main_on_host or is_indexer_layer(name):
                    engine_runs = device_runs
            wrapped = [rd2h.CacheTensor(t, num_blocks=num_blocks, group_idx=g) for t in tensors]
            if is_indexer_layer(name):
                if n in indexer:
                    raise rd2h.InvalidArgument(f"layer {n} has two indexer caches ({name!r})")
                indexer[n] = wrapped
            elif n in main:
                raise rd2h.InvalidArgument(
                    f"layer {n} has two attention caches: {main[n][0]!r} and {name!r}"
                )
            else:
                main[n] = (name, wrapped)
                main_runs[n] = engine_runs
        orphans = sorted(set(indexer) - set(main))
        if orphans:
            raise rd2h.InvalidArgument(f"indexer caches of layers {orphans} have no attention layer")
        for (n, is_indexer), (device_runs, host_runs) in staged.items():
            # An indexer is staged with its layer's attention cache, as it is published.
            self._staging.add_layer(main[n][0], device_runs, host_runs, is_indexer)
        layers = []
        for n in sorted(main):
            name, tensors = main[n]
            layers.append(
                rd2h.CacheLayer(
                    name,
                    tensors + indexer.get(n, []),
                    main_tensor_count=len(tensors),
                    has_indexer=n in indexer,
                )
            )
        if (
            self._config.role == rd2h.KvRole.CONSUMER
            and self._parallel.tp_size > 1
            and self._all_gather_group() is None
        ):
            raise rd2h.Error(
                f"Decode TP {self._parallel.tp_size} gathers request states over the TP group: "
                "torch.distributed must be initialized"
            )
        self._worker.register_kv_caches(layers)
        self._main_layers = {name for name, _ in main.values()}
        self._main_runs = [main_runs[n] for n in sorted(main)]
        self._last_main_layer = main[max(main)][0] if main else None
        if self._test_corrupt and main:
            self._corrupt_target = main_runs[min(main)]

    def _host_staging(self, kv_caches: dict[str, Any]) -> Optional[staging.HostStaging]:
        """Staging through host buffers when the caches are on a device, else None."""
        on_device = [name for name, value in kv_caches.items() if staging.is_on_device(value)]
        if not on_device:
            if not self._stage_host or not kv_caches:
                return None
            on_device = list(kv_caches)  # TEST_STAGE_SETTING: host caches staged as well
        device = staging.device_of(kv_caches[on_device[0]])
        if len(on_device) != len(kv_caches):
            raise rd2h.InvalidArgument(
                f"KV cache layer {on_device[0]!r} is in {device} memory and others are in host "
                "memory; rd2h takes one or the other")
        if self._kv_buffer_device != "cpu":
            raise rd2h.InvalidArgument(
                f"KV cache layer {on_device[0]!r} is in {device} memory and "
                f"kv_transfer_config.kv_buffer_device is {self._kv_buffer_device!r}: rd2h moves "
                'device KV through host buffers; set "kv_buffer_device": "cpu"')
        out = staging.HostStaging(device, timeout_s=60.0, main_on_host=self._main_on_host)
        if self._host_copy is not None:
            out.set_copy_op(self._host_copy)
        return out

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        """vLLM's block copy between device caches and host buffers (kv_buffer_device "cpu")."""
        self._host_copy = copy_operation
        if self._staging is not None:
            self._staging.set_copy_op(copy_operation)

    def host_kv_caches(self) -> dict[str, list]:
        """Where KV caches on a device are staged: vLLM's layer name -> the host buffers rd2h
        reads into (or serves from), one per tensor of the layer. With ``main_kv_on_host``,
        Decode's main KV is there and only there. Empty where nothing is staged."""
        return {} if self._staging is None else self._staging.host_caches()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        assert self._worker is not None, "a worker-role call on the scheduler role"
        super().bind_connector_metadata(connector_metadata)
        self._worker.bind_connector_metadata(connector_metadata.data)
        if self._staging is not None:
            # What every layer of the step copies to the host: found once per step.
            self._step_blocks = self._worker.step_blocks()
        if self._test_corrupt:
            self._corrupt_pending.update(getattr(connector_metadata, "corrupt", {}))
        if self._digest_dir:
            self._digest_pending.update(getattr(connector_metadata, "digests", {}))

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None, "a worker-role call on the scheduler role"
        if self.has_connector_metadata():
            self._worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None, "a worker-role call on the scheduler role"
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        assert self._worker is not None, "a worker-role call on the scheduler role"
        # An indexer cache is published with its layer's attention cache.
        if not self.has_connector_metadata() or layer_name not in self._main_layers:
            return
        if (self._digest_dir and self._config.role == rd2h.KvRole.PRODUCER
                and layer_name == self._last_main_layer):
            # Every layer of the step is written, and no Decode has the last one yet.
            self._write_digests(list(self._digest_pending))
        if self._staging is not None:
            event = self._staging.save_layer(layer_name, *self._step_blocks)
            self._worker.save_kv_layer(layer_name, event)
            return
        self._worker.save_kv_layer(layer_name)

    def wait_for_layer_send(self, layer_name: str) -> None:
        assert self._worker is not None, "a worker-role call on the scheduler role"
        self._worker.wait_for_layer_send(layer_name)

    def wait_for_save(self) -> None:
        assert self._worker is not None, "a worker-role call on the scheduler role"
        self._worker.wait_for_save()

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[Optional[set[str]], Optional[set[str]]]:
        assert self._worker is not None, "a worker-role call on the scheduler role"
        sending, recving = self._worker.get_finished(self._all_gather_fn())
        if self._staging is not None:
            # Their KV is in the host buffers: on the device before vLLM is told.
            self._staging.load(*self._worker.take_loaded_blocks())
        if self._test_corrupt:
            self._corrupt_arrived(recving)
        if self._digest_dir:
            self._write_digests(recving)
        return (set(sending) or None), (set(recving) or None)

    def _write_digests(self, req_ids: Iterable[str]) -> None:
        """TEST_DIGEST_SETTING: files the digest of each request's prompt KV."""
        import torch

        role = "prefill" if self._config.role == rd2h.KvRole.PRODUCER else "decode"
        for req_id in req_ids:
            entry = self._digest_pending.pop(req_id, None)
            if entry is None:
                continue
            key, blocks = entry
            h = hashlib.sha256()
            for runs in self._main_runs:
                for run in runs:
                    for block in blocks:
                        h.update(run[block].cpu().contiguous().view(-1).view(torch.uint8).numpy())
            path = os.path.join(self._digest_dir, f"{role}-{key}")
            with open(path + ".tmp", "w") as f:
                f.write(f"{len(blocks)} {h.hexdigest()}\n")
            os.replace(path + ".tmp", path)

    def _corrupt_arrived(self, recving: Iterable[str]) -> None:
        """TEST_CORRUPT_SETTING: negates one pulled block of each arrived request."""
        for req_id in recving:
            block = self._corrupt_pending.pop(req_id, None)
            if block is None:
                continue
            for run in self._corrupt_target:
                if run.is_floating_point():
                    run[block].neg_()
                else:
                    run[block].bitwise_not_()

    def get_kv_connector_stats(self) -> Any:
        """What this Decode rank's reads did since the last call (None if nothing)."""
        if self._worker is None or self._config.role != rd2h.KvRole.CONSUMER or not USING_VLLM:
            return None
        from rd2h._vllm_stats import since

        now = self._worker.transfer_stats()
        stats, self._stats_reported = since(now, self._stats_reported), now
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict] = None) -> Any:
        from rd2h._vllm_stats import Rd2hKVConnectorStats

        return Rd2hKVConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list,
                           per_engine_labelvalues: dict) -> Any:
        from rd2h._vllm_stats import Rd2hPromMetrics

        return Rd2hPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        return set(self._worker.get_block_ids_with_load_errors())

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._staging is not None:
            self._staging.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # ---- the Decode TP group's CPU all-gather ----------------------------------------------

    def _all_gather_group(self) -> Any:
        """The CPU process group of this rank's TP group, or None if there is none."""
        import torch.distributed as dist

        if USING_VLLM:
            from vllm.distributed.parallel_state import get_tp_group  # type: ignore

            return get_tp_group().cpu_group
        if dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        return None

    def _all_gather_fn(self):
        if self._config.role != rd2h.KvRole.CONSUMER or self._parallel.tp_size == 1:
            return None
        import torch.distributed as dist

        group = self._all_gather_group()

        def gather(mine: dict[str, bool]) -> list[dict[str, bool]]:
            out: list = [None] * self._parallel.tp_size
            dist.all_gather_object(out, mine, group=group)
            return out

        return gather

    # ---- class-level answers ----------------------------------------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> Optional[str]:
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # wait_for_layer_load and save_kv_layer block on the host between layers.
        return True
