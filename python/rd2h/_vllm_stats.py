"""rd2h's transfer counters in vLLM's own metrics: the KV connector stats a Decode worker
reports each step, summed over the workers and exported on the engine's `/metrics`.

- `rd2h_kv_bytes_read_total`: KV bytes Decode pulled from Prefill;
- `rd2h_kv_reads_total`: batched reads (one per layer and Prefill rank);
- `rd2h_kv_layers_total{outcome="done"|"failed"}`: layer readiness read or failed (one layer
  of one Prefill step's requests from one Prefill rank);
- `rd2h_kv_read_seconds_total`: time spent in those reads.

Imported only where vLLM is (its base classes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # type: ignore
    KVConnectorPromMetrics,
    KVConnectorStats,
)

FIELDS = ("bytes_read", "reads", "layers_done", "layers_failed", "read_seconds")


@dataclass
class Rd2hKVConnectorStats(KVConnectorStats):
    """Counts of one interval (a step on a worker, or their sum)."""

    def __post_init__(self) -> None:
        for f in FIELDS:
            self.data.setdefault(f, 0)

    def reset(self) -> None:
        self.data = {f: 0 for f in FIELDS}

    def aggregate(self, other: KVConnectorStats) -> "Rd2hKVConnectorStats":
        for f in FIELDS:
            self.data[f] += other.data.get(f, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {f: self.data[f] for f in FIELDS}
        seconds = self.data["read_seconds"]
        out["read_GBps"] = round(self.data["bytes_read"] / seconds / 1e9, 3) if seconds else 0
        return out

    def is_empty(self) -> bool:
        return self.data["reads"] == 0 and self.data["layers_failed"] == 0


def since(now: dict[str, Any], before: dict[str, Any]) -> Rd2hKVConnectorStats:
    return Rd2hKVConnectorStats(data={f: now[f] - before.get(f, 0) for f in FIELDS})


class Rd2hPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def counter(name: str, doc: str, extra: tuple = ()):
            return self._counter_cls(name=name, documentation=doc,
                                     labelnames=labelnames + list(extra))

        bytes_read = counter("rd2h_kv_bytes_read", "KV bytes Decode pulled from Prefill.")
        reads = counter("rd2h_kv_reads", "Batched KV reads (one per layer and Prefill rank).")
        seconds = counter("rd2h_kv_read_seconds", "Seconds spent in batched KV reads.")
        layers = counter("rd2h_kv_layers",
                         "Layer readiness (a layer of a Prefill step, from one rank) read or failed.",
                         ("outcome",))
        self._per_engine = {
            idx: {
                "bytes_read": bytes_read.labels(*values),
                "reads": reads.labels(*values),
                "read_seconds": seconds.labels(*values),
                "layers_done": layers.labels(*values, "done"),
                "layers_failed": layers.labels(*values, "failed"),
            }
            for idx, values in per_engine_labelvalues.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for f, c in self._per_engine[engine_idx].items():
            value = transfer_stats_data.get(f, 0)
            if value:
                c.inc(value)
