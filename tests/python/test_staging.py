"""KV caches on a device move through host buffers (kv_buffer_device "cpu"): rd2h registers
host mirrors, Prefill copies each layer's blocks there with the copy operation vLLM gave it and
publishes the layer only once the copy is complete, and Decode copies the blocks it pulled to
the device before it reports the request. The device is a double: CPU tensors that say they
are on a GPU, a device module with streams and events (so that Prefill copies on its copy
thread), and a copy operation that the test can hold."""

from __future__ import annotations

import threading

import pytest

import rd2h
from conftest import free_ports, kv_config
from mini_engine_rank import Model, kv_cache_config
from rd2h import staging
from rd2h.vllm import KVConnectorRole, Rd2hConnector
from staged_transfer import StagedPair, StreamDevice, caches, copy_blocks, vllm_config, write

M = Model(layers=2, block_size=16, num_blocks=8, main_bytes=32, indexer_bytes=8)
BLOCKS = [5, 2, 7]


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


def test_device_caches_without_a_host_buffer_device_are_refused_naming_the_setting():
    ktc = kv_config("kv_producer", free_ports(1))
    cfg = vllm_config(M, ktc)
    cfg.kv_transfer_config.kv_buffer_device = "cuda"
    work = Rd2hConnector(cfg, KVConnectorRole.WORKER, kv_cache_config(M))
    try:
        with pytest.raises(rd2h.InvalidArgument, match='"kv_buffer_device": "cpu"'):
            work.register_kv_caches(caches(M, "double"))
    finally:
        work.shutdown()


def test_main_kv_on_host_is_a_decode_setting_of_true_or_false():
    for role, value, match in (("kv_producer", True, "is for a Decode"),
                               ("kv_consumer", "yes", "expected true or false")):
        ktc = kv_config(role, free_ports(1))
        ktc["kv_connector_extra_config"]["main_kv_on_host"] = value
        with pytest.raises(rd2h.InvalidArgument, match=f"main_kv_on_host.* {match}"):
            Rd2hConnector(vllm_config(M, ktc), KVConnectorRole.WORKER, kv_cache_config(M))


@pytest.mark.parametrize("main_on_host", [False, True], ids=["all-on-device", "main-kv-on-host"])
def test_device_kv_goes_through_host_buffers_and_no_layer_leaves_before_its_copy(
        monkeypatch, main_on_host):
    monkeypatch.setattr(staging, "device_module", lambda device_type: StreamDevice())
    held = HeldCopy()
    pair = StagedPair(M, "double", held, decode_extra={"main_kv_on_host": main_on_host})
    try:
        for i, release_first in enumerate((True, False)):
            # The first request opens the connection to Decode (its copies complete at once);
            # the second is held: its readiness would go out at once if it did not wait.
            tokens = list(range(100 + i, 140 + i))
            meta = pair.schedule(f"staging-{i}", tokens, BLOCKS)
            if release_first:
                held.released.set()
            else:
                held.released.clear()
            sent, copies = pair.readiness_sent(), held.copies
            held.entered.clear()

            def after_layers() -> None:
                if not release_first:
                    # Every layer is saved and the first one's copy is under way, none
                    # complete: nothing went out.
                    assert held.entered.wait(60), "no layer was copied to the host"
                    assert pair.readiness_sent() == sent, \
                        "a layer's readiness left before its copy to host memory completed"
                    held.released.set()

            pair.prefill(meta, lambda l: write(M, pair.kv, l, tokens, BLOCKS), after_layers)
            # One copy per layer for its main KV, one for its indexer.
            assert held.copies - copies == 2 * M.layers, "a layer was not copied to the host"
            assert pair.readiness_sent() - sent == M.layers
            recving, _, wrong = pair.answer()
            assert recving == {pair.decode_request}
            assert not wrong, f"Decode's device caches {wrong} do not hold Prefill's KV"
    finally:
        held.released.set()
        pair.close()
