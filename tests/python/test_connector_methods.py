"""rd2h.vllm against the vLLM stand-ins: loading as vLLM's factory does, every method of the
KV Connector V1 interface with its return types, the no-metadata skip, errors as Python
exceptions, KV buffers from torch tensors and the buffer protocol, and the GIL released
while a call blocks."""

from __future__ import annotations

import importlib
import inspect
import pickle
import socket
import threading
import time

import pytest
import torch

import rd2h
import vllm_standin as V
from conftest import free_ports, in_own_process, kv_config
from mini_engine_rank import Model, indexer_name, kv_cache_config, main_name

M = Model(layers=2, block_size=16, num_blocks=8, main_bytes=32, indexer_bytes=8)


def vllm_config(ktc: dict, tp: int = 1) -> V.VllmConfig:
    return V.VllmConfig(kv_transfer_config=V.KVTransferConfig(**ktc),
                        parallel_config=V.ParallelConfig(tensor_parallel_size=tp),
                        cache_config=V.CacheConfig(block_size=M.block_size))


def load(ktc: dict, role, kv_cache_config_=None, tp: int = 1):
    """As vLLM's factory: import kv_connector_module_path, take the attribute kv_connector."""
    module = importlib.import_module(ktc["kv_connector_module_path"])
    cls = getattr(module, ktc["kv_connector"])
    return cls(vllm_config(ktc, tp), role, kv_cache_config_ or kv_cache_config(M))


def caches() -> dict:
    out = {}
    for l in range(M.layers):
        out[main_name(l)] = torch.zeros(M.num_blocks, M.block_size, M.main_bytes, dtype=torch.uint8)
        out[indexer_name(l)] = torch.zeros(M.num_blocks, M.block_size, M.indexer_bytes, dtype=torch.uint8)
    return out


def decode_request(metaserver_url: str, n: int = 40) -> V.Request:
    return V.Request("cmpl-m-0-abcdefgh", list(range(n)), V.SamplingParams(
        max_tokens=4, extra_args={"kv_transfer_params": {
            "do_remote_prefill": True, "do_remote_decode": False, "metaserver": metaserver_url}}))


def empty_output() -> V.SchedulerOutput:
    return V.SchedulerOutput([], V.CachedRequestData(), {}, 0)


def test_the_class_loads_like_vllm_loads_it():
    from rd2h.vllm import KVConnectorBase_V1, KVConnectorRole, SupportsHMA

    ktc = kv_config("kv_consumer", free_ports(1))
    c = load(ktc, KVConnectorRole.SCHEDULER)
    assert isinstance(c, KVConnectorBase_V1) and isinstance(c, SupportsHMA)
    assert "kv_cache_config" in inspect.signature(type(c).__init__).parameters
    assert c.role == KVConnectorRole.SCHEDULER
    assert type(c).get_required_kvcache_layout(None) is None
    assert type(c).requires_piecewise_for_cudagraph({}) is True
    c.shutdown()


def test_decode_scheduler_matches_the_prompt_asynchronously_and_posts_the_rendezvous(metaserver):
    from rd2h.vllm import KVConnectorRole, Rd2hConnectorMetadata

    kv_port = free_ports(1)
    c = load(kv_config("kv_consumer", kv_port), KVConnectorRole.SCHEDULER)
    try:
        req = decode_request(metaserver.url)
        assert c.get_num_new_matched_tokens(req, 16) == (24, True)
        assert c.get_num_new_matched_tokens(req, 16) == (24, True), "not free of side effects"
        plain = V.Request("cmpl-p-0-abcdefgh", [1, 2, 3], V.SamplingParams())
        assert c.get_num_new_matched_tokens(plain, 0) == (0, False)
        blocks = V.KVCacheBlocks(((V.KVCacheBlock(3), V.KVCacheBlock(1), V.KVCacheBlock(4)),))
        assert c.update_state_after_alloc(req, blocks, 24) is None
        assert req.kv_transfer_params["do_remote_prefill"] is False, "the pull would happen twice"
        post = metaserver.next_post()
        assert post["request_id"] == "cmpl-m-0"
        assert post["do_remote_decode"] is True
        assert post["remote_port"] == kv_port and post["remote_host"] == "127.0.0.1"
        assert post["remote_cached_tokens"] == 16
        c.update_state_after_alloc(req, blocks, 0)  # vLLM may call it again
        meta = c.build_connector_meta(empty_output())
        assert isinstance(meta, Rd2hConnectorMetadata) and isinstance(meta.data, bytes)
        assert pickle.loads(pickle.dumps(meta)).data == meta.data
        assert c.build_connector_meta(empty_output()).data != meta.data, "per-step state kept"
        assert c.request_finished(req, [3, 1, 4]) == (False, None)
        assert c.request_finished_all_groups(req, ([3, 1, 4],)) == (False, None)
        assert c.update_connector_output(V.KVConnectorOutput()) is None
        assert list(c.take_events()) == []
        assert c.get_finished_count() is None
    finally:
        c.shutdown()


def test_prefill_scheduler_loads_nothing_and_publishes_chunks():
    from rd2h.vllm import KVConnectorRole

    c = load(kv_config("kv_producer", free_ports(1)), KVConnectorRole.SCHEDULER)
    try:
        params = {"do_remote_decode": True, "do_remote_prefill": False, "request_id": "cmpl-q-0",
                  "remote_engine_id": "d", "remote_host": "127.0.0.1", "remote_port": 30000,
                  "remote_tp_size": 1}
        req = V.Request("cmpl-q-0-abcdefgh", list(range(40)),
                        V.SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}))
        assert c.get_num_new_matched_tokens(req, 0) == (0, False)
        blocks = V.KVCacheBlocks(((V.KVCacheBlock(0), V.KVCacheBlock(1)),))
        c.update_state_after_alloc(req, blocks, 0)
        idle = c.build_connector_meta(empty_output()).data
        so = V.SchedulerOutput([V.NewRequestData(req.request_id, req.prompt_token_ids,
                                                 req.sampling_params, ([0, 1],), 0)],
                               V.CachedRequestData(), {req.request_id: 32}, 32)
        first = c.build_connector_meta(so).data
        assert len(first) > len(idle), "the chunk's complete blocks were not published"
        cached = V.CachedRequestData(req_ids=[req.request_id], new_block_ids=[([2],)],
                                     num_computed_tokens=[32], new_token_ids=[[]],
                                     num_output_tokens=[0])
        final = c.build_connector_meta(V.SchedulerOutput([], cached, {req.request_id: 8}, 8)).data
        assert len(final) > len(idle)
        assert c.request_finished(req, [0, 1, 2]) == (False, None)
    finally:
        c.shutdown()


@in_own_process
def test_decode_worker_methods_and_their_return_types():
    from rd2h.vllm import KVConnectorRole

    c = load(kv_config("kv_consumer", free_ports(1)), KVConnectorRole.WORKER)
    try:
        c.register_kv_caches(caches())
        assert c.has_connector_metadata() is False
        s = load(kv_config("kv_consumer", free_ports(1)), KVConnectorRole.SCHEDULER)
        c.bind_connector_metadata(s.build_connector_meta(empty_output()))
        s.shutdown()
        assert c.has_connector_metadata() is True
        assert c.start_load_kv(V.ForwardContext()) is None
        assert c.wait_for_layer_load(main_name(0)) is None
        assert c.save_kv_layer(main_name(0), None, None) is None
        assert c.wait_for_save() is None
        assert c.get_finished(set()) == (None, None)
        assert c.get_block_ids_with_load_errors() == set()
        c.clear_connector_metadata()
        assert c.has_connector_metadata() is False
    finally:
        c.shutdown()


def test_save_kv_layer_without_metadata_is_skipped():
    from rd2h.vllm import KVConnectorRole

    c = load(kv_config("kv_producer", free_ports(1)), KVConnectorRole.WORKER)
    calls = []

    class Recording:
        def __getattr__(self, name):
            calls.append(name)
            return lambda *a, **k: None

    try:
        c.register_kv_caches(caches())
        real, c._worker = c._worker, Recording()
        c.save_kv_layer(main_name(0), None, None)
        assert calls == [], "save_kv_layer reached rd2h with no metadata bound"
        c._worker = real
    finally:
        c.shutdown()


def test_errors_are_python_exceptions_naming_what_was_wrong():
    from rd2h.vllm import KVConnectorRole

    bad = kv_config("kv_both", free_ports(1))
    with pytest.raises(rd2h.InvalidArgument, match="kv_role") as e:
        load(bad, KVConnectorRole.WORKER)
    assert isinstance(e.value, ValueError) and isinstance(e.value, rd2h.Error)
    assert e.value.code == "invalid argument"
    unknown = kv_config("kv_producer", free_ports(1), no_such_setting=1)
    with pytest.raises(rd2h.InvalidArgument, match="no_such_setting"):
        load(unknown, KVConnectorRole.WORKER)
    c = load(kv_config("kv_producer", free_ports(1)), KVConnectorRole.WORKER)
    try:
        with pytest.raises(rd2h.InvalidArgument, match="layers.<n>"):
            c.register_kv_caches({"lm_head.kv": torch.zeros(4, 4, dtype=torch.uint8)})
        with pytest.raises(rd2h.Error, match="before register_kv_caches"):
            c.wait_for_save()
    finally:
        c.shutdown()


def test_kv_caches_are_split_into_block_runs_from_their_strides():
    from rd2h.vllm import block_runs

    # K and V in one tensor, [2, num_blocks, heads, block_size, head_size]: a run each.
    kv = torch.zeros(2, 6, 2, 4, 8)
    k, v = block_runs("model.layers.0.self_attn", kv, 6)
    assert k.shape == v.shape == (6, 64)
    assert k.data_ptr() == kv.data_ptr()
    assert v.data_ptr() == kv.data_ptr() + 6 * 64 * kv.element_size()
    # Blocks outermost with a permuted interior (heads and tokens swapped): one run.
    nhc = torch.zeros(6, 4, 2, 8).permute(0, 2, 1, 3)
    (run,) = block_runs("model.layers.0.self_attn", nhc, 6)
    assert run.shape == (6, 64) and run.data_ptr() == nhc.data_ptr()
    # MLA's latent cache, [num_blocks, block_size, 576]: itself.
    (mla,) = block_runs("model.layers.0.self_attn", torch.zeros(6, 16, 576), 6)
    assert mla.shape == (6, 16 * 576)


def test_kv_caches_whose_blocks_are_not_one_run_are_refused():
    from rd2h.vllm import KVConnectorRole

    c = load(kv_config("kv_producer", free_ports(1)), KVConnectorRole.WORKER)
    try:
        kv = caches()
        # Padding inside each block (a slice of a wider cache): a block is not one range.
        kv[main_name(1)] = torch.zeros(M.num_blocks, M.block_size, 2 * M.main_bytes,
                                       dtype=torch.uint8)[:, :, : M.main_bytes]
        with pytest.raises(rd2h.InvalidArgument, match="not one contiguous run"):
            c.register_kv_caches(kv)
        kv[main_name(1)] = torch.zeros(3, 5, dtype=torch.uint8)
        with pytest.raises(rd2h.InvalidArgument, match=f"no dimension of {M.num_blocks} blocks"):
            c.register_kv_caches(kv)
    finally:
        c.shutdown()


def test_kv_buffers_from_tensors_and_the_buffer_protocol():
    t = torch.zeros(8, 16, 4, dtype=torch.float16)
    ct = rd2h.CacheTensor(t)
    nbytes = t.numel() * t.element_size()
    assert (ct.addr, ct.bytes, ct.block_len) == (t.data_ptr(), nbytes, nbytes // 8)
    b = bytearray(1024)
    cb = rd2h.CacheTensor(memoryview(b).cast("B", (8, 128)))
    assert cb.bytes == 1024 and cb.block_len == 128
    assert rd2h.CacheTensor(b, num_blocks=4).block_len == 256
    with pytest.raises(rd2h.InvalidArgument, match="contiguous"):
        rd2h.CacheTensor(t.transpose(0, 1))
    with pytest.raises(rd2h.InvalidArgument, match="contiguous"):
        rd2h.CacheTensor(memoryview(b)[::2])
    with pytest.raises(rd2h.InvalidArgument, match="device 'meta'"):
        rd2h.CacheTensor(torch.empty(8, 4, device="meta"))
    with pytest.raises(rd2h.InvalidArgument, match="does not split into 3 blocks"):
        rd2h.CacheTensor(b, num_blocks=3)
    with pytest.raises(rd2h.InvalidArgument, match="data_ptr"):
        rd2h.CacheTensor(object())


def test_a_blocking_call_releases_the_gil():
    """Prefill waits for a Decode that takes the connection and never answers (ACK deadline
    1.5 s); meanwhile this thread keeps running Python."""
    from rd2h.vllm import KVConnectorRole

    # The kernel accepts connections on a listening socket nobody serves: the connect
    # succeeds and no ACK ever comes (a port with nothing listening fails at once).
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    silent_decode_port = silent.getsockname()[1]
    ktc = kv_config("kv_producer", free_ports(1), ack_timeout_ms=1500, send_timeout_ms=5000,
                    on_peer_failure="raise")  # the wait raises when its deadline passes
    c = load(ktc, KVConnectorRole.WORKER)
    s = load(ktc, KVConnectorRole.SCHEDULER)
    try:
        c.register_kv_caches(caches())
        params = {"do_remote_decode": True, "request_id": "cmpl-g-0", "remote_host": "127.0.0.1",
                  "remote_port": silent_decode_port, "remote_tp_size": 1}
        req = V.Request("cmpl-g-0-abcdefgh", list(range(16)),
                        V.SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}))
        s.update_state_after_alloc(req, V.KVCacheBlocks(((V.KVCacheBlock(0),),)), 0)
        c.bind_connector_metadata(s.build_connector_meta(V.SchedulerOutput(
            [V.NewRequestData(req.request_id, req.prompt_token_ids, req.sampling_params, ([0],), 0)],
            V.CachedRequestData(), {req.request_id: 16}, 16)))
        c.save_kv_layer(main_name(0), None, None)
        entered, done = threading.Event(), threading.Event()
        raised = []

        def blocked():
            entered.set()
            try:
                c.wait_for_layer_send(main_name(0))
            except rd2h.Error as e:
                raised.append(e)
            done.set()

        threading.Thread(target=blocked).start()
        assert entered.wait(10)
        start = last = time.monotonic()
        longest_gap = 0.0
        while not done.is_set():
            now = time.monotonic()
            longest_gap, last = max(longest_gap, now - last), now
        waited = time.monotonic() - start
        assert waited > 1.0, f"the call returned after {waited:.3f} s, before its ACK deadline"
        # Python's switch interval is 5 ms: a call holding the GIL would stall this loop for
        # the whole wait.
        assert longest_gap < 0.5, f"this thread stalled {longest_gap:.3f} s: the call held the GIL"
        assert raised and "layers.0" in str(raised[0])
    finally:
        c.shutdown()
        s.shutdown()
        silent.close()


def prefill_request(ext_id: str, tokens: int) -> V.Request:
    """A Prefill request of `tokens` prompt tokens bound for a Decode on port 30000."""
    params = {"do_remote_decode": True, "request_id": ext_id, "remote_host": "127.0.0.1",
              "remote_port": 30000, "remote_tp_size": 1}
    return V.Request(ext_id + "-abcdefgh", list(range(tokens)),
                     V.SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}))


def allocated(blocks: list) -> V.KVCacheBlocks:
    return V.KVCacheBlocks((tuple(V.KVCacheBlock(b) for b in blocks),))


def test_a_resumed_request_replaces_its_blocks():
    """vLLM gives a request resumed after a preemption its whole new block list."""
    from rd2h.vllm import KVConnectorRole

    def publish(resumed: bool) -> bytes:
        c = load(kv_config("kv_producer", free_ports(1)), KVConnectorRole.SCHEDULER)
        try:
            req = prefill_request("cmpl-r-0", 64)
            c.update_state_after_alloc(req, allocated([0, 1]), 0)
            c.build_connector_meta(V.SchedulerOutput(
                [V.NewRequestData(req.request_id, req.prompt_token_ids, req.sampling_params, ([0, 1],), 0)],
                V.CachedRequestData(), {req.request_id: 32}, 32))
            cached = V.CachedRequestData(
                req_ids=[req.request_id], resumed_req_ids={req.request_id} if resumed else set(),
                new_block_ids=[([5, 6, 7, 3],)], num_computed_tokens=[0], new_token_ids=[[]],
                num_output_tokens=[0])
            return c.build_connector_meta(V.SchedulerOutput([], cached, {req.request_id: 64}, 64)).data
        finally:
            c.shutdown()

    # Past the 32 tokens Decode holds, a resumed request publishes blocks 7 and 3 of its new
    # list; appended to the old list ([0, 1, 5, 6, 7, 3]) they would be 5 and 6.
    assert publish(resumed=True) != publish(resumed=False)


def test_speculative_tokens_are_not_counted_as_computed():
    """A step's speculative tokens are scheduled, not computed: 40 scheduled of which 8 are
    speculative publish what 32 plain tokens publish, not the prompt's final chunk."""
    from rd2h.vllm import KVConnectorRole

    def publish(scheduled: int, speculative: int) -> bytes:
        c = load(kv_config("kv_producer", free_ports(1)), KVConnectorRole.SCHEDULER)
        try:
            req = prefill_request("cmpl-s-0", 40)
            c.update_state_after_alloc(req, allocated([0, 1, 2]), 0)
            so = V.SchedulerOutput(
                [V.NewRequestData(req.request_id, req.prompt_token_ids, req.sampling_params,
                                  ([0, 1, 2],), 0)],
                V.CachedRequestData(), {req.request_id: scheduled}, scheduled,
                scheduled_spec_decode_tokens={req.request_id: list(range(speculative))})
            return c.build_connector_meta(so).data
        finally:
            c.shutdown()

    assert publish(40, 8) == publish(32, 0)
    assert publish(40, 8) != publish(40, 0), "the speculative tokens completed the prompt"


def test_indexer_layers_are_found_in_any_case():
    from rd2h.vllm import is_indexer_layer

    assert is_indexer_layer("model.layers.0.self_attn.INDEXER")
    assert is_indexer_layer("model.layers.0.Indexer.k_cache")
    assert not is_indexer_layer("model.layers.0.self_attn")
