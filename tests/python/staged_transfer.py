"""A Prefill and a Decode worker whose KV caches are on a device, staged through host buffers
(kv_buffer_device "cpu"), driven request by request as vLLM's scheduler and model runner
would: test_staging.py, bench_staging.py and gpu_check.py (scripts/gpu-check) run on it.

The device is torch's CUDA, or a double: CPU tensors that report a GPU (OnDevice), with a
device module of streams and events (StreamDevice) where a test wants Prefill's copies on
the copy thread. Prefill runs in the calling process, Decode in a spawned process of its
own (a process binds one transfer-engine role); the metaserver is a recording stand-in.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Optional

import torch

import vllm_standin as V
from harness import Metaserver, free_ports, kv_config, start_decode_rank
from mini_engine_rank import Model, expected_kv, indexer_name, kv_cache_config, main_name
from rd2h.vllm import KVConnectorRole, Rd2hConnector


class OnDevice(torch.Tensor):
    """A CPU tensor that says it is in GPU memory: what rd2h sees of a device KV cache."""

    @property
    def device(self):  # type: ignore[override]
        return torch.device("cuda", 0)


class StreamDevice:
    """A device module with streams and events, as torch.cuda has: with it, Prefill's copies
    to the host run on the connector's copy thread. The double's work is done when it was
    called, so its events are complete as soon as they are recorded."""

    class Stream:
        def __init__(self, device=None) -> None:
            pass

        def wait_event(self, event) -> None:
            pass

        def synchronize(self) -> None:
            pass

    class Event:
        def record(self, stream=None) -> None:
            pass

        def synchronize(self) -> None:
            pass

    def current_stream(self):
        return self.Stream()

    def stream(self, s):
        return contextlib.nullcontext()


def copy_blocks(src: dict, dst: dict, src_ids: list, dst_ids: list, direction: str) -> None:
    """vLLM's CopyBlocksOp for the double's memory, a block at a time (torch's indexed copies
    on the CPU run at a twentieth of a memory copy's speed)."""
    assert direction in ("h2d", "d2h")
    for name in src:
        for s, d in zip(src_ids, dst_ids):
            dst[name][d].copy_(src[name][s])


def vllm_copy_op() -> tuple[Callable, str]:
    """vLLM's copy operation (copy_kv_blocks) where vLLM is installed, else the same steps with
    the block copies of vLLM's GPU platforms; and which one it is."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import copy_kv_blocks

        return copy_kv_blocks, "vLLM's copy_kv_blocks"
    except ImportError:
        pass

    def copy_kv_blocks_like_vllm(src: dict, dst: dict, src_ids: list, dst_ids: list,
                                 direction: str) -> None:
        src_dev = next(iter(src.values())).device
        dst_dev = next(iter(dst.values())).device
        si = torch.tensor(src_ids, dtype=torch.int64, device=src_dev)
        di = torch.tensor(dst_ids, dtype=torch.int64, device=dst_dev)
        for name in src:
            picked = src[name][si]
            dst[name][di] = picked.to(dst_dev) if direction == "h2d" else picked.cpu()

    return copy_kv_blocks_like_vllm, "vLLM's block copies (vLLM is not installed)"


def caches(m: Model, device: str, fill: bool = False) -> dict:
    """The model's KV caches: zeros (random bytes with `fill`) on `device` ("cuda", "cpu", or
    "double" for OnDevice tensors)."""
    out = {}
    for l in range(m.layers):
        for name, width in ((main_name(l), m.main_bytes), (indexer_name(l), m.indexer_bytes)):
            shape = (m.num_blocks, m.block_size, width)
            on = "cpu" if device == "double" else device
            t = (torch.randint(0, 255, shape, dtype=torch.uint8, device=on) if fill
                 else torch.zeros(shape, dtype=torch.uint8, device=on))
            out[name] = t.as_subclass(OnDevice) if device == "double" else t
    return out


def rows(m: Model, blocks: list, n_tokens: int) -> torch.Tensor:
    """The rows of a [num_blocks * block_size, width] view that hold a prompt's tokens."""
    return torch.tensor([blocks[p // m.block_size] * m.block_size + p % m.block_size
                         for p in range(n_tokens)])


def write(m: Model, kv: dict, layer: int, tokens: list, blocks: list) -> None:
    """What the model writes into a layer's caches for a prompt."""
    tok, pos = torch.tensor(tokens), torch.arange(len(tokens))
    r = rows(m, blocks, len(tokens))
    for t, (name, width) in enumerate(((main_name(layer), m.main_bytes),
                                       (indexer_name(layer), m.indexer_bytes))):
        target = kv[name]
        where = "cpu" if isinstance(target, OnDevice) else target.device
        target.view(-1, width)[r.to(where)] = expected_kv(tok, pos, layer, t, width).to(where)


def wrong_layers(m: Model, engine_kv: dict, tokens: list, blocks: list) -> list:
    """The caches that do not hold what the model wrote for the prompt."""
    tok, pos = torch.tensor(tokens), torch.arange(len(tokens))
    r = rows(m, blocks, len(tokens))
    return [name
            for l in range(m.layers)
            for t, (name, width) in enumerate(((main_name(l), m.main_bytes),
                                               (indexer_name(l), m.indexer_bytes)))
            if not torch.equal(engine_kv[name].view(-1, width).cpu()[r],
                               expected_kv(tok, pos, l, t, width))]


def vllm_config(m: Model, ktc: dict) -> V.VllmConfig:
    return V.VllmConfig(kv_transfer_config=V.KVTransferConfig(**ktc, kv_buffer_device="cpu"),
                        cache_config=V.CacheConfig(block_size=m.block_size))


def step_output(new_reqs, counts) -> V.SchedulerOutput:
    return V.SchedulerOutput(new_reqs, V.CachedRequestData(), counts, sum(counts.values()))


def decode_rank(conn, m: Model, ktc: dict, device: str) -> None:
    """Decode's worker, in a process of its own: for each (metadata, tokens, blocks) it gets,
    it pulls the request and answers (the finished ids, when, the caches that do not hold the
    prompt's KV or None when not asked). With main_kv_on_host, main KV is checked in the
    host buffers and must not have reached the device caches."""
    main_on_host = ktc["kv_connector_extra_config"].get("main_kv_on_host", False)
    work = Rd2hConnector(vllm_config(m, ktc), KVConnectorRole.WORKER, kv_cache_config(m))
    kv = caches(m, device)
    work.register_kv_caches(kv)
    work.set_host_xfer_buffer_ops(copy_blocks if device == "double" else vllm_copy_op()[0])
    host = work.host_kv_caches()
    assert set(host) == (set() if device == "cpu" else set(kv)), "host buffers are not as staged"
    mains = {main_name(l) for l in range(m.layers)}
    engine_kv = {name: host[name][0] if main_on_host and name in mains else t
                 for name, t in kv.items()}  # where the engine finds each cache's KV
    conn.send("ready")
    try:
        while conn.poll(120):
            job = conn.recv()
            if job is None:
                return
            meta, tokens, blocks = job
            work.bind_connector_metadata(meta)
            work.start_load_kv(V.ForwardContext())
            recving, deadline = None, time.monotonic() + 60
            while not recving and time.monotonic() < deadline:
                _, recving = work.get_finished(set())
            finished = time.monotonic()
            work.clear_connector_metadata()
            wrong = None
            if tokens is not None:
                wrong = wrong_layers(m, engine_kv, tokens, blocks)
                if main_on_host:
                    wrong += [f"{main_name(l)} (on the device)" for l in range(m.layers)
                              if kv[main_name(l)].any()]
            conn.send((recving, finished, wrong))
    finally:
        work.shutdown()


class StagedPair:
    """A Prefill worker (here) and a Decode worker (its own process), both with caches on
    `device`, and both sides' scheduler roles."""

    def __init__(self, m: Model, device: str, prefill_copy: Callable, decode_extra: Optional[dict] = None,
                 prefill_kv: Optional[dict] = None):
        self.m = m
        self.metaserver = Metaserver()
        decode_ktc = kv_config("kv_consumer", free_ports(1), **(decode_extra or {}))
        prefill_ktc = kv_config("kv_producer", free_ports(1))
        kcc = kv_cache_config(m)
        self._opened: list = []
        try:
            self.d_sched = Rd2hConnector(vllm_config(m, decode_ktc), KVConnectorRole.SCHEDULER, kcc)
            self._opened.append(self.d_sched)
            self.conn, self.decode = start_decode_rank(decode_rank, m, decode_ktc, device)
            self.p_sched = Rd2hConnector(vllm_config(m, prefill_ktc), KVConnectorRole.SCHEDULER, kcc)
            self._opened.append(self.p_sched)
            self.p_work = Rd2hConnector(vllm_config(m, prefill_ktc), KVConnectorRole.WORKER, kcc)
            self._opened.append(self.p_work)
            self.kv = prefill_kv if prefill_kv is not None else caches(m, device)
            self.p_work.register_kv_caches(self.kv)
            self.p_work.set_host_xfer_buffer_ops(prefill_copy)
        except BaseException:
            self.close()
            raise

    def schedule(self, name: str, tokens: list, blocks: list, check: bool = True):
        """Decode schedules the request and sends its metadata to its worker; Prefill
        schedules it with the rendezvous Decode posted. Prefill's step metadata."""
        sp = V.SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {
            "do_remote_prefill": True, "do_remote_decode": False,
            "metaserver": self.metaserver.url}})
        d_req = V.Request(f"cmpl-{name}-abcd1234", tokens, sp)
        assert self.d_sched.get_num_new_matched_tokens(d_req, 0) == (len(tokens), True)
        kv_blocks = V.KVCacheBlocks((tuple(V.KVCacheBlock(b) for b in blocks),))
        self.d_sched.update_state_after_alloc(d_req, kv_blocks, len(tokens))
        self.conn.send((self.d_sched.build_connector_meta(step_output([], {})),
                        tokens if check else None, blocks))
        rendezvous = self.metaserver.next_post()
        p_req = V.Request(f"cmpl-{name}-efgh5678", tokens, V.SamplingParams(
            max_tokens=1, extra_args={"kv_transfer_params": rendezvous}))
        assert self.p_sched.get_num_new_matched_tokens(p_req, 0) == (0, False)
        self.p_sched.update_state_after_alloc(p_req, kv_blocks, 0)
        self.decode_request = d_req.request_id
        return self.p_sched.build_connector_meta(step_output(
            [V.NewRequestData(p_req.request_id, tokens, p_req.sampling_params, (blocks,), 0)],
            {p_req.request_id: len(tokens)}))

    def prefill(self, meta, layer: Callable[[int], None], after_layers: Optional[Callable] = None
                ) -> None:
        """Prefill's forward pass: per layer, `layer(l)` computes and writes the layer's KV, then
        save_kv_layer (its seconds, per layer, in `save_seconds`); `after_layers()` runs before
        wait_for_save."""
        w = self.p_work
        w.bind_connector_metadata(meta)
        w.start_load_kv(V.ForwardContext(attn_metadata={}))
        self.save_seconds = []
        for l in range(self.m.layers):
            w.wait_for_layer_load(main_name(l))
            layer(l)
            t0 = time.perf_counter()
            w.save_kv_layer(main_name(l), self.kv[main_name(l)], object())
            self.save_seconds.append(time.perf_counter() - t0)
        if after_layers is not None:
            after_layers()
        w.wait_for_save()
        w.clear_connector_metadata()

    def answer(self) -> tuple:
        """Decode's answer to the last request: (finished ids, when, wrong caches or None)."""
        assert self.conn.poll(120), "Decode did not answer"
        return self.conn.recv()

    def readiness_sent(self) -> int:
        return self.p_work._worker.transfer_stats()["readiness_sent"]

    def close(self) -> None:
        for c in self._opened:
            c.shutdown()
        if hasattr(self, "conn"):
            with contextlib.suppress(OSError):
                self.conn.send(None)
            self.decode.join(timeout=30)
            self.conn.close()
        self.metaserver.close()
