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

KV caches must be host (CPU) tensors: they are registered with the transfer engine as they
are, without copies.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import re
from typing import Any, Iterable, Optional

import rd2h

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


class Rd2hConnectorMetadata(KVConnectorMetadata):
    """One step's connector metadata: the bytes rd2h's scheduler encoded (picklable)."""

    def __init__(self, data: bytes):
        self.data = data

    def __reduce__(self):
        return (Rd2hConnectorMetadata, (self.data,))


def _kv_transfer_config_json(ktc: Any) -> str:
    extra = getattr(ktc, "kv_connector_extra_config", None) or {}
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
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = rd2h.Scheduler(
                self._config, self._parallel, self._groups(vllm_config, kv_cache_config)
            )
        else:
            self._tp_rank = self._find_tp_rank(vllm_config)
            self._worker = rd2h.Worker(self._config, self._parallel, self._tp_rank)

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
        return Rd2hConnectorMetadata(self._scheduler.build_connector_meta(scheduled))

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
        main: dict[int, tuple[str, list]] = {}
        indexer: dict[int, list] = {}
        for name, value in kv_caches.items():
            n = layer_index(name)
            if n is None:
                raise rd2h.InvalidArgument(
                    f"KV cache layer {name!r} has no 'layers.<n>' to take its index from"
                )
            tensors = list(value) if isinstance(value, (tuple, list)) else [value]
            g = group_of.get(name, 0)
            for t in tensors:
                first = tuple(getattr(t, "shape", ()))[:1]
                if num_blocks is not None and first != (num_blocks,):
                    raise rd2h.InvalidArgument(
                        f"KV cache layer {name!r}: blocks must lie along the first dimension "
                        f"({num_blocks} blocks), the tensor's shape is {tuple(t.shape)}"
                    )
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
        orphans = sorted(set(indexer) - set(main))
        if orphans:
            raise rd2h.InvalidArgument(f"indexer caches of layers {orphans} have no attention layer")
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

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        assert self._worker is not None, "a worker-role call on the scheduler role"
        super().bind_connector_metadata(connector_metadata)
        self._worker.bind_connector_metadata(connector_metadata.data)

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
        return (set(sending) or None), (set(recving) or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        return set(self._worker.get_block_ids_with_load_errors())

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
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
