"""Stand-ins for the vLLM objects a KV connector sees (spec/vllm-connector-v1.md, section 4),
with vLLM's field names, so rd2h.vllm can be driven in vLLM's call order without vLLM."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class KVTransferConfig:
    kv_connector: Optional[str] = None
    kv_connector_module_path: Optional[str] = None
    kv_role: Optional[str] = None
    kv_rank: Optional[int] = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    engine_id: Optional[str] = None
    kv_buffer_device: str = "cpu"
    kv_buffer_size: float = 1e9
    kv_connector_extra_config: dict = field(default_factory=dict)
    enable_permute_local_kv: bool = False
    kv_load_failure_policy: str = "fail"

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    rank: int = 0


@dataclass
class CacheConfig:
    block_size: int = 16


@dataclass
class ModelConfig:
    use_mla: bool = True


@dataclass
class SchedulerConfig:
    disable_hybrid_kv_cache_manager: bool = False
    max_num_batched_tokens: int = 2048


@dataclass
class VllmConfig:
    kv_transfer_config: Optional[KVTransferConfig]
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    model_config: ModelConfig = field(default_factory=ModelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)


@dataclass
class MLAAttentionSpec:
    block_size: int
    num_kv_heads: int = 1
    head_size: int = 576
    dtype: str = "uint8"


@dataclass
class KVCacheTensor:
    size: int
    shared_by: list[str]


@dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: MLAAttentionSpec
    is_eagle_group: bool = False


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status >= RequestStatus.FINISHED_STOPPED


@dataclass
class SamplingParams:
    max_tokens: int = 16
    extra_args: Optional[dict] = None


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_external_computed_tokens = 0
        self.num_preemptions = 0
        self.block_hashes: list[int] = []
        self.status = RequestStatus.WAITING
        extra = sampling_params.extra_args or {}
        self.kv_transfer_params: Optional[dict] = extra.get("kv_transfer_params")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class KVCacheBlock:
    block_id: int
    block_hash: Optional[int] = None
    is_null: bool = False


@dataclass
class KVCacheBlocks:
    blocks: tuple  # one sequence of KVCacheBlock per group

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        assert len(self.blocks) == 1, "only one group"
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return [[b.block_id for b in g if not b.is_null and b.block_hash is None] for g in self.blocks]


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_token_ids: list[list[int]] = field(default_factory=list)
    all_token_ids: dict[str, list[int]] = field(default_factory=dict)
    new_block_ids: list[Optional[tuple[list[int], ...]]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: Any = None


@dataclass
class KVConnectorOutput:
    finished_sending: Optional[set[str]] = None
    finished_recving: Optional[set[str]] = None
    invalid_block_ids: set[int] = field(default_factory=set)
    kv_connector_stats: Any = None
    kv_cache_events: Any = None
    kv_connector_worker_meta: Any = None
    expected_finished_count: int = 0


@dataclass
class ForwardContext:
    attn_metadata: Optional[dict] = None
    no_compile_layers: dict = field(default_factory=dict)
    virtual_engine: int = 0
