"""Stand-ins for vLLM's KV Connector V1 base classes, with the same names and defaults.

rd2h.vllm subclasses vLLM's own classes when vLLM is importable (vLLM checks with
isinstance); without vLLM it subclasses these, so the connector can be driven and tested
the way vLLM drives it.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import Any, Iterable, Optional


class KVConnectorRole(enum.IntEnum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata(ABC):  # noqa: B024 - vLLM's is an empty abstract class too
    """What the scheduler role hands the workers each step; pickled with SchedulerOutput."""


class SupportsHMA(ABC):
    """A connector that takes one block list per KV-cache group on request completion."""

    @abstractmethod
    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, Optional[dict[str, Any]]]:
        raise NotImplementedError


class KVConnectorBase_V1(ABC):  # noqa: N801 - vLLM's name
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        self._connector_metadata: Optional[KVConnectorMetadata] = None
        self._vllm_config = vllm_config
        if vllm_config.kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set for a KV connector")
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._kv_cache_config = kv_cache_config
        self._role = role

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        return self._kv_transfer_config.is_kv_producer

    # Worker side.
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        return

    def register_cross_layers_kv_cache(self, kv_cache: Any, attn_backend: Any) -> None:
        return

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        return

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        return

    @abstractmethod
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None: ...

    @abstractmethod
    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None: ...

    @abstractmethod
    def wait_for_save(self) -> None: ...

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[Optional[set[str]], Optional[set[str]]]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def shutdown(self) -> None:
        return None

    def get_kv_connector_stats(self) -> Any:
        return None

    def get_kv_connector_kv_cache_events(self) -> Any:
        return None

    def build_connector_worker_meta(self) -> Any:
        return None

    def get_handshake_metadata(self) -> Any:
        return None

    # Scheduler side.
    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[Optional[int], bool]: ...

    @abstractmethod
    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None: ...

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata: ...

    def update_connector_output(self, connector_output: Any) -> None:
        return

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, Optional[dict[str, Any]]]:
        return False, None

    def take_events(self) -> Iterable[Any]:
        return ()

    def get_finished_count(self) -> Optional[int]:
        return None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> Optional[str]:
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return False
