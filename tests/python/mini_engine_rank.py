"""The worker side of mini_engine.py: one process per TP rank.

The model's shape (Model) and its layer names, the KVCacheConfig and VllmConfig both sides
build, the bytes the model writes for a position (expected_kv), and Rank: a worker-role
connector over CPU tensors as KV caches, stepped in vLLM's order. rank_main is the process's
entry point; it answers the engine core's "step", "verify", "poison" and "stop" over a pipe.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from dataclasses import dataclass

import torch

import vllm_standin as V


@dataclass
class Model:
    layers: int = 4
    block_size: int = 16
    num_blocks: int = 256
    main_bytes: int = 64  # per token: the MLA latent
    indexer_bytes: int = 16  # per token: the lightning indexer's key and scale
    slots: int = 0  # physical layer buffers Prefill's layers share (0: one per layer)


def main_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def indexer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.indexer.k_cache"


def kv_cache_config(m: Model) -> V.KVCacheConfig:
    names = [main_name(l) for l in range(m.layers)] + [indexer_name(l) for l in range(m.layers)]
    # DeepSeek-V3.2: main MLA and indexer layers share one group (UniformTypeKVCacheSpecs).
    group = V.KVCacheGroupSpec(names, V.MLAAttentionSpec(block_size=m.block_size))
    tensors = [V.KVCacheTensor(m.num_blocks * m.block_size * m.main_bytes, [n]) for n in names]
    return V.KVCacheConfig(m.num_blocks, tensors, [group])


def vllm_config(args: argparse.Namespace, rank: int) -> V.VllmConfig:
    ktc = json.loads(args.kv_transfer_config)
    return V.VllmConfig(
        kv_transfer_config=V.KVTransferConfig(**ktc),
        parallel_config=V.ParallelConfig(tensor_parallel_size=args.tp, rank=rank),
        cache_config=V.CacheConfig(block_size=args.block_size),
        scheduler_config=V.SchedulerConfig(max_num_batched_tokens=args.token_budget),
    )


def model_of(args: argparse.Namespace) -> Model:
    return Model(args.layers, args.block_size, args.num_blocks, args.main_bytes, args.indexer_bytes,
                 args.slots)


def expected_kv(tokens: torch.Tensor, positions: torch.Tensor, layer: int, tensor: int,
                width: int) -> torch.Tensor:
    """What the model writes for these positions: [len(positions), width] bytes."""
    cols = torch.arange(width, dtype=torch.int64)[None, :]
    v = (tokens[:, None] * 40503 + positions[:, None] * 2654435 + layer * 97 + tensor * 13 +
         cols * 7) % 251
    return v.to(torch.uint8)


class Rank:
    def __init__(self, args: argparse.Namespace, rank: int):
        from rd2h.vllm import KVConnectorRole, Rd2hConnector

        self.m = model_of(args)
        self.prefill = json.loads(args.kv_transfer_config)["kv_role"] == "kv_producer"
        self.connector = Rd2hConnector(vllm_config(args, rank), KVConnectorRole.WORKER,
                                       kv_cache_config(self.m))
        m = self.m
        self.caches: dict[str, torch.Tensor] = {}
        slots = m.slots if (self.prefill and m.slots > 0) else m.layers
        idx_width = args.decode_indexer_bytes if (not self.prefill and args.decode_indexer_bytes) \
            else m.indexer_bytes
        self.idx_width = idx_width
        mains = [torch.zeros(m.num_blocks, m.block_size, m.main_bytes, dtype=torch.uint8)
                 for _ in range(slots)]
        idxs = [torch.zeros(m.num_blocks, m.block_size, idx_width, dtype=torch.uint8)
                for _ in range(slots)]
        for l in range(m.layers):
            self.caches[main_name(l)] = mains[l % slots]
            self.caches[indexer_name(l)] = idxs[l % slots]
        self.connector.register_kv_caches(self.caches)
        self.reqs: dict[str, tuple[list[int], list[int]]] = {}  # id -> (tokens, blocks)

    def rows(self, blocks: list[int], positions: torch.Tensor) -> torch.Tensor:
        b = torch.tensor(blocks, dtype=torch.int64)
        return b[positions // self.m.block_size] * self.m.block_size + positions % self.m.block_size

    def write(self, layer: int, req_id: str, start: int, count: int) -> None:
        tokens, blocks = self.reqs[req_id]
        pos = torch.arange(start, start + count, dtype=torch.int64)
        tok = torch.tensor([tokens[p] if p < len(tokens) else 0 for p in range(start, start + count)],
                           dtype=torch.int64)
        rows = self.rows(blocks, pos)
        for t, (name, width) in enumerate(((main_name(layer), self.m.main_bytes),
                                           (indexer_name(layer), self.idx_width))):
            self.caches[name].view(-1, width)[rows] = expected_kv(tok, pos, layer, t, width)

    def step(self, so: V.SchedulerOutput):
        c = self.connector
        for r in so.scheduled_new_reqs:
            self.reqs[r.req_id] = (list(r.prompt_token_ids), list(r.block_ids[0]))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if cached.new_block_ids[i]:
                self.reqs[req_id][1].extend(cached.new_block_ids[i][0])
        work = [(r.req_id, r.num_computed_tokens, so.num_scheduled_tokens[r.req_id])
                for r in so.scheduled_new_reqs]
        work += [(req_id, cached.num_computed_tokens[i], so.num_scheduled_tokens[req_id])
                 for i, req_id in enumerate(cached.req_ids)]
        error = None
        c.bind_connector_metadata(so.kv_connector_metadata)
        try:
            attn = {main_name(l): object() for l in range(self.m.layers)} if work else None
            c.start_load_kv(V.ForwardContext(attn_metadata=attn))
            if work:
                for l in range(self.m.layers):
                    # vLLM's attention decorator: wait_for_layer_load, the op, save_kv_layer.
                    c.wait_for_layer_load(main_name(l))
                    for req_id, start, count in work:
                        self.write(l, req_id, start, count)
                    c.save_kv_layer(main_name(l), self.caches[main_name(l)], attn[main_name(l)])
            c.wait_for_save()
        except Exception as e:  # a failed transfer fails this step's requests
            error = f"{type(e).__name__}: {e}"
        sending, recving = c.get_finished(so.finished_req_ids)
        out = V.KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                  invalid_block_ids=c.get_block_ids_with_load_errors())
        c.clear_connector_metadata()
        for req_id in so.finished_req_ids:
            self.reqs.pop(req_id, None)
        return out, error

    def poison(self, blocks: list[int]) -> None:
        """Freed blocks hold garbage, so a block reused without being written is caught."""
        ids = torch.tensor(blocks, dtype=torch.int64)
        for t in {id(x): x for x in self.caches.values()}.values():
            t[ids] = 0xEE

    def verify(self, tokens: list[int], blocks: list[int]) -> tuple[int, int, str]:
        """Checks every byte of the prompt's KV in every layer: (bytes, mismatches, first)."""
        n = len(tokens)
        pos = torch.arange(n, dtype=torch.int64)
        tok = torch.tensor(tokens, dtype=torch.int64)
        rows = self.rows(blocks, pos)
        checked, bad, first = 0, 0, ""
        for l in range(self.m.layers):
            for t, (name, width) in enumerate(((main_name(l), self.m.main_bytes),
                                               (indexer_name(l), self.idx_width))):
                got = self.caches[name].view(-1, width)[rows]
                want = expected_kv(tok, pos, l, t, width)
                diff = (got != want)
                checked += got.numel()
                k = int(diff.sum())
                if k and not first:
                    p = int(diff.any(dim=1).nonzero()[0])
                    first = f"layer {l} {name} position {p} (block {blocks[p // self.m.block_size]})"
                bad += k
        return checked, bad, first


def rank_main(conn, args: argparse.Namespace, rank: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        r = Rank(args, rank)
    except Exception as e:
        conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    try:
        while True:
            if not conn.poll(1.0):
                if os.getppid() == 1:  # the core is gone
                    break
                continue
            kind, payload = conn.recv()
            if kind == "step":
                conn.send(("step", r.step(payload)))
            elif kind == "verify":
                conn.send(("verify", r.verify(*payload)))
            elif kind == "poison":
                r.poison(payload)
                conn.send(("poison", None))
            elif kind == "stop":
                break
    finally:
        r.connector.shutdown()
