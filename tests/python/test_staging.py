"""KV caches on a device move through host buffers (kv_buffer_device "cpu"): rd2h registers
host mirrors, Prefill copies each layer's blocks there with the copy operation vLLM gave it and
publishes the layer only once the copy is complete, and Decode copies the blocks it pulled to
the device before it reports the request. The device is a double: CPU tensors that say they
are on a GPU, a device module with streams and events (so that Prefill copies on its copy
thread), and a copy operation that the test can hold."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

import rd2h
import vllm_standin as V
from conftest import free_ports, kv_config, start_decode_rank
from mini_engine_rank import Model, expected_kv, indexer_name, kv_cache_config, main_name
from rd2h import staging
from rd2h.vllm import KVConnectorRole, Rd2hConnector

M = Model(layers=2, block_size=16, num_blocks=8, main_bytes=32, indexer_bytes=8)
BLOCKS = [5, 2, 7]


class OnDevice(torch.Tensor):
    """A CPU tensor that says it is in GPU memory: what rd2h sees of a device KV cache."""

    @property
    def device(self):  # type: ignore[override]
        return torch.device("cuda", 0)


def device_caches() -> dict:
    out = {}
    for l in range(M.layers):
        out[main_name(l)] = torch.zeros(M.num_blocks, M.block_size, M.main_bytes,
                                        dtype=torch.uint8).as_subclass(OnDevice)
        out[indexer_name(l)] = torch.zeros(M.num_blocks, M.block_size, M.indexer_bytes,
                                           dtype=torch.uint8).as_subclass(OnDevice)
    return out


def copy_blocks(src: dict, dst: dict, src_ids: list, dst_ids: list, direction: str) -> None:
    """vLLM's CopyBlocksOp for the double's memory, a block at a time (torch's indexed copies
    on the CPU run at a twentieth of a memory copy's speed)."""
    assert direction in ("h2d", "d2h")
    for name in src:
        for s, d in zip(src_ids, dst_ids):
            dst[name][d].copy_(src[name][s])


class HeldCopy:
    """copy_blocks whose copies to the host wait until the test releases them."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.entered = threading.Event()  # a copy to the host started and waits
        self.copies = 0

    def __call__(self, src, dst, src_ids, dst_ids, direction) -> None:
        if direction == "d2h":
            self.copies += 1
            self.entered.set()
            assert self.released.wait(60), "the test never released the copies"
        copy_blocks(src, dst, src_ids, dst_ids, direction)


def rows(tokens: list) -> torch.Tensor:
    return torch.tensor([BLOCKS[p // M.block_size] * M.block_size + p % M.block_size
                         for p in range(len(tokens))])


def write(kv: dict, layer: int, tokens: list) -> None:
    tok, pos = torch.tensor(tokens), torch.arange(len(tokens))
    for t, (name, width) in enumerate(((main_name(layer), M.main_bytes),
                                       (indexer_name(layer), M.indexer_bytes))):
        kv[name].view(-1, width)[rows(tokens)] = expected_kv(tok, pos, layer, t, width)


def config(ktc: dict, buffer_device: str = "cpu") -> V.VllmConfig:
    return V.VllmConfig(
        kv_transfer_config=V.KVTransferConfig(**ktc, kv_buffer_device=buffer_device),
        cache_config=V.CacheConfig(block_size=M.block_size))


def step_output(new_reqs, counts) -> V.SchedulerOutput:
    return V.SchedulerOutput(new_reqs, V.CachedRequestData(), counts, sum(counts.values()))


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


def test_device_caches_without_a_host_buffer_device_are_refused_naming_the_setting():
    ktc = kv_config("kv_producer", free_ports(1))
    work = Rd2hConnector(config(ktc, buffer_device="cuda"), KVConnectorRole.WORKER,
                         kv_cache_config(M))
    try:
        with pytest.raises(rd2h.InvalidArgument, match='"kv_buffer_device": "cpu"'):
            work.register_kv_caches(device_caches())
    finally:
        work.shutdown()


def test_main_kv_on_host_is_a_decode_setting_of_true_or_false():
    for role, value, match in (("kv_producer", True, "is for a Decode"),
                               ("kv_consumer", "yes", "expected true or false")):
        ktc = kv_config(role, free_ports(1))
        ktc["kv_connector_extra_config"]["main_kv_on_host"] = value
        with pytest.raises(rd2h.InvalidArgument, match=f"main_kv_on_host.* {match}"):
            Rd2hConnector(config(ktc), KVConnectorRole.WORKER, kv_cache_config(M))


def decode_rank(conn, ktc: dict) -> None:
    """Decode's worker with device caches, in a process of its own. With main_kv_on_host, main
    KV is checked in the host buffers and must not have reached the device caches."""
    main_on_host = ktc["kv_connector_extra_config"].get("main_kv_on_host", False)
    d_work = Rd2hConnector(config(ktc), KVConnectorRole.WORKER, kv_cache_config(M))
    d_kv = device_caches()
    d_work.register_kv_caches(d_kv)
    d_work.set_host_xfer_buffer_ops(copy_blocks)
    host = d_work.host_kv_caches()
    assert set(host) == set(d_kv), "a staged layer has no host buffers"
    # Where the engine finds each cache's KV.
    mains = {main_name(l) for l in range(M.layers)}
    engine_kv = {name: host[name][0] if main_on_host and name in mains else t
                 for name, t in d_kv.items()}
    conn.send("ready")
    try:
        while conn.poll(60):
            meta, tokens = conn.recv()
            d_work.bind_connector_metadata(meta)
            d_work.start_load_kv(V.ForwardContext())
            recving = None
            deadline = time.monotonic() + 30
            while not recving and time.monotonic() < deadline:
                _, recving = d_work.get_finished(set())
            d_work.clear_connector_metadata()
            tok, pos = torch.tensor(tokens), torch.arange(len(tokens))
            wrong = [
                name
                for l in range(M.layers)
                for t, (name, width) in enumerate(((main_name(l), M.main_bytes),
                                                   (indexer_name(l), M.indexer_bytes)))
                if not torch.equal(engine_kv[name].view(-1, width)[rows(tokens)],
                                   expected_kv(tok, pos, l, t, width))
            ]
            if main_on_host:
                wrong += [f"{main_name(l)} (on the device)" for l in range(M.layers)
                          if d_kv[main_name(l)].any()]
            conn.send((recving, wrong))
    finally:
        d_work.shutdown()


@pytest.mark.parametrize("main_on_host", [False, True], ids=["all-on-device", "main-kv-on-host"])
def test_device_kv_goes_through_host_buffers_and_no_layer_leaves_before_its_copy(
        metaserver, monkeypatch, main_on_host):
    monkeypatch.setattr(staging, "device_module", lambda device_type: StreamDevice())
    held = HeldCopy()
    decode_ktc = kv_config("kv_consumer", free_ports(1))
    decode_ktc["kv_connector_extra_config"]["main_kv_on_host"] = main_on_host
    prefill_ktc = kv_config("kv_producer", free_ports(1))
    kcc = kv_cache_config(M)
    d_sched = Rd2hConnector(config(decode_ktc), KVConnectorRole.SCHEDULER, kcc)
    conn, decode = start_decode_rank(decode_rank, decode_ktc)
    p_sched = Rd2hConnector(config(prefill_ktc), KVConnectorRole.SCHEDULER, kcc)
    p_work = Rd2hConnector(config(prefill_ktc), KVConnectorRole.WORKER, kcc)
    p_kv = device_caches()
    p_work.register_kv_caches(p_kv)
    p_work.set_host_xfer_buffer_ops(held)
    try:
        for i, release_first in enumerate((True, False)):
            # The first request opens the connection to Decode (its copies complete at once);
            # the second is held: its readiness would go out at once if it did not wait.
            tokens = list(range(100 + i, 140 + i))
            sp = V.SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {
                "do_remote_prefill": True, "do_remote_decode": False,
                "metaserver": metaserver.url}})
            d_req = V.Request(f"cmpl-staging-{i}-abcd1234", tokens, sp)
            assert d_sched.get_num_new_matched_tokens(d_req, 0) == (len(tokens), True)
            blocks = V.KVCacheBlocks((tuple(V.KVCacheBlock(b) for b in BLOCKS),))
            d_sched.update_state_after_alloc(d_req, blocks, len(tokens))
            conn.send((d_sched.build_connector_meta(step_output([], {})), tokens))
            rendezvous = metaserver.next_post()

            p_req = V.Request(f"cmpl-staging-{i}-efgh5678", tokens, V.SamplingParams(
                max_tokens=1, extra_args={"kv_transfer_params": rendezvous}))
            assert p_sched.get_num_new_matched_tokens(p_req, 0) == (0, False)
            p_sched.update_state_after_alloc(p_req, blocks, 0)
            p_meta = p_sched.build_connector_meta(step_output(
                [V.NewRequestData(p_req.request_id, tokens, p_req.sampling_params, (BLOCKS,), 0)],
                {p_req.request_id: len(tokens)}))
            if release_first:
                held.released.set()
            else:
                held.released.clear()
            sent = p_work._worker.transfer_stats()["readiness_sent"]
            copies = held.copies
            held.entered.clear()
            p_work.bind_connector_metadata(p_meta)
            p_work.start_load_kv(V.ForwardContext(attn_metadata={}))
            for l in range(M.layers):
                p_work.wait_for_layer_load(main_name(l))
                write(p_kv, l, tokens)
                p_work.save_kv_layer(main_name(l), p_kv[main_name(l)], object())
            if not release_first:
                # Every layer is saved and the first one's copy is under way, none complete:
                # nothing went out.
                assert held.entered.wait(60), "no layer was copied to the host"
                assert p_work._worker.transfer_stats()["readiness_sent"] == sent, \
                    "a layer's readiness left before its copy to host memory completed"
                held.released.set()
            p_work.wait_for_save()
            p_work.clear_connector_metadata()
            # One copy per layer for its main KV, one for its indexer.
            assert held.copies - copies == 2 * M.layers, "a layer was not copied to the host"
            assert p_work._worker.transfer_stats()["readiness_sent"] - sent == M.layers
            assert conn.poll(60), "Decode did not answer"
            recving, wrong = conn.recv()
            assert recving == {d_req.request_id}
            assert not wrong, f"Decode's device caches {wrong} do not hold Prefill's KV"
    finally:
        held.released.set()
        for c in (p_work, p_sched, d_sched):
            c.shutdown()
        conn.close()
        decode.join(timeout=30)
