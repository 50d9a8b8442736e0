"""A Decode that fails costs Prefill only the requests sent to it: with the default
`on_peer_failure` ("fail") the compute path goes on and the failure is counted; with "raise"
(the design's fail-fast) it raises the failure's kind, rd2h.PeerError for a Decode that is
gone or unreachable."""

from __future__ import annotations

import pytest

import rd2h
import vllm_standin as V
from conftest import free_ports, in_own_process, kv_config
from mini_engine_rank import Model, kv_cache_config, main_name
from rd2h.vllm import KVConnectorRole, Rd2hConnector
from staged_transfer import caches, step_output, vllm_config

M = Model(layers=3, block_size=16, num_blocks=8, main_bytes=32, indexer_bytes=8)


def prefill_step_to_a_dead_decode(on_peer_failure: str) -> Rd2hConnector:
    """Prefill's scheduler and worker run one step of a request whose Decode does not listen
    at the port its rendezvous names; returns the worker, after wait_for_save returned."""
    ktc = kv_config("kv_producer", free_ports(1), on_peer_failure=on_peer_failure,
                    ack_timeout_ms=2000, reply_timeout_ms=2000)
    cfg = vllm_config(M, ktc)
    sched = Rd2hConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(M))
    work = Rd2hConnector(cfg, KVConnectorRole.WORKER, kv_cache_config(M))
    work.register_kv_caches(caches(M, "cpu"))
    try:
        params = {"do_remote_decode": True, "do_remote_prefill": False, "request_id": "cmpl-d-0",
                  "remote_engine_id": "gone", "remote_host": "127.0.0.1",
                  "remote_port": free_ports(1), "remote_tp_size": 1}
        tokens = list(range(40))
        req = V.Request("cmpl-d-0-abcdefgh", tokens,
                        V.SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}))
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        blocks = [0, 1, 2]
        sched.update_state_after_alloc(req, V.KVCacheBlocks((tuple(V.KVCacheBlock(b) for b in blocks),)), 0)
        meta = sched.build_connector_meta(step_output(
            [V.NewRequestData(req.request_id, tokens, req.sampling_params, (blocks,), 0)],
            {req.request_id: len(tokens)}))
        work.bind_connector_metadata(meta)
        work.start_load_kv(V.ForwardContext(attn_metadata={}))
        for l in range(M.layers):
            work.wait_for_layer_load(main_name(l))
            work.save_kv_layer(main_name(l), None, object())
        try:
            work.wait_for_save()
        finally:
            work.clear_connector_metadata()
        return work
    finally:
        sched.shutdown()
        if on_peer_failure == "raise":
            work.shutdown()


@in_own_process
def test_by_default_a_dead_decode_fails_its_requests_and_the_step_goes_on():
    work = prefill_step_to_a_dead_decode("fail")
    try:
        assert work._worker.transfer_stats()["peer_failures"] >= 1
    finally:
        work.shutdown()


@in_own_process
def test_with_raise_a_dead_decode_raises_a_peer_error_naming_it():
    with pytest.raises(rd2h.PeerError, match="nothing listens") as e:
        prefill_step_to_a_dead_decode("raise")
    assert isinstance(e.value, ConnectionError)
    assert e.value.code == "unreachable"


def test_on_peer_failure_is_fail_or_raise():
    ktc = kv_config("kv_producer", free_ports(1), on_peer_failure="ignore")
    with pytest.raises(rd2h.InvalidArgument, match="on_peer_failure.*expected fail or raise"):
        Rd2hConnector(vllm_config(M, ktc), KVConnectorRole.WORKER, kv_cache_config(M))
