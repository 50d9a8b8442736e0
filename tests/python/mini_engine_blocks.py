"""The block pool of mini_engine.py's core: KV cache blocks with reference counts, reused
oldest-freed first, and a prefix cache of full prompt blocks, as in vLLM's block pool."""

from __future__ import annotations

import collections
from typing import Optional

import vllm_standin as V


class BlockPool:
    """num_blocks blocks of block_size tokens and each request's blocks. A full prompt block
    freed with `cache` stays in the prefix cache, under the hash of the prompt up to its end,
    until the block is reused."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks: dict[str, list[int]] = {}  # request id -> its blocks
        self.free = collections.OrderedDict((b, None) for b in range(num_blocks))
        self.ref = [0] * num_blocks
        self.hash_of: dict[int, int] = {}  # block -> prefix hash (cached full blocks)
        self.cached: dict[int, int] = {}  # prefix hash -> block

    def prefix_hashes(self, tokens: list[int]) -> list[int]:
        out, h = [], 0
        bs = self.block_size
        for i in range(len(tokens) // bs):
            h = hash((h, tuple(tokens[i * bs:(i + 1) * bs])))
            out.append(h)
        return out

    def prefix_hits(self, prompt: list[int]) -> list[int]:
        """The cached blocks holding the prompt from its start, all but its last token."""
        hit_blocks = []
        for h in self.prefix_hashes(prompt):
            if h not in self.cached:
                break
            hit_blocks.append(self.cached[h])
        return hit_blocks[:(len(prompt) - 1) // self.block_size]

    def take_block(self, b: int) -> None:
        if self.ref[b] == 0:
            del self.free[b]
        self.ref[b] += 1

    def take_hits(self, req_id: str, hits: list[int]) -> None:
        """A request starts out holding the cached blocks its prompt hit."""
        for b in hits:
            self.take_block(b)
        self.blocks[req_id] = list(hits)

    def allocate(self, req_id: str, tokens: int) -> Optional[list[int]]:
        """The blocks added so that the request holds `tokens`; None if too few are free."""
        have = self.blocks.setdefault(req_id, [])
        need = -(-tokens // self.block_size) - len(have)
        if need <= 0:
            return []
        if need > len(self.free):
            return None
        new = []
        for _ in range(need):
            b, _ = self.free.popitem(last=False)
            h = self.hash_of.pop(b, None)
            if h is not None:
                self.cached.pop(h, None)
            self.ref[b] = 1
            new.append(b)
        have.extend(new)
        return new

    def release(self, req_id: str, prompt: list[int], cache: bool) -> list[int]:
        """Drops the request's blocks; those now free and not in the prefix cache."""
        blocks = self.blocks.pop(req_id, [])
        hashes = self.prefix_hashes(prompt) if cache else []
        garbage = []
        for i, b in enumerate(blocks):
            if i < len(hashes) and hashes[i] not in self.cached:
                self.cached[hashes[i]] = b
                self.hash_of[b] = hashes[i]
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None  # cached blocks are evicted last-freed-last
                if b not in self.hash_of:
                    garbage.append(b)
        return garbage

    def kv_blocks(self, req_id: str) -> V.KVCacheBlocks:
        return V.KVCacheBlocks((tuple(V.KVCacheBlock(b) for b in self.blocks.get(req_id, [])),))
