"""The Prefill buffer-reuse hazard. vLLM calls wait_for_layer_load(layer) before an attention
layer writes its KV and never calls wait_for_layer_send, so on Prefill wait_for_layer_load must
hold the write until Decode has read what the layer's physical buffer holds. Here Prefill's
two layers share one buffer and Decode is told of the request late (its readiness is held
meanwhile): if the wait were missing, layer 1 would overwrite layer 0 before Decode read it."""

from __future__ import annotations

import threading
import time

import torch

import rd2h
import vllm_standin as V
from conftest import free_ports, kv_config, start_decode_rank
from mini_engine_rank import Model, expected_kv, indexer_name, kv_cache_config, main_name
from rd2h.vllm import KVConnectorRole, Rd2hConnector

M = Model(layers=2, block_size=16, num_blocks=8, main_bytes=32, indexer_bytes=8)
TOKENS = list(range(100, 140))  # 40 tokens: 3 blocks, the last one partial
BLOCKS = [5, 2, 7]
ROWS = torch.tensor([BLOCKS[p // 16] * 16 + p % 16 for p in range(len(TOKENS))])
POSITIONS = torch.arange(len(TOKENS))


def config(ktc: dict) -> V.VllmConfig:
    return V.VllmConfig(kv_transfer_config=V.KVTransferConfig(**ktc),
                        cache_config=V.CacheConfig(block_size=M.block_size))


def caches(shared: bool) -> dict:
    n = 1 if shared else M.layers
    mains = [torch.zeros(M.num_blocks, M.block_size, M.main_bytes, dtype=torch.uint8) for _ in range(n)]
    idxs = [torch.zeros(M.num_blocks, M.block_size, M.indexer_bytes, dtype=torch.uint8) for _ in range(n)]
    out = {}
    for l in range(M.layers):
        out[main_name(l)] = mains[l % n]
        out[indexer_name(l)] = idxs[l % n]
    return out


def write(kv: dict, layer: int) -> None:
    tok = torch.tensor(TOKENS)
    for t, (name, width) in enumerate(((main_name(layer), M.main_bytes),
                                       (indexer_name(layer), M.indexer_bytes))):
        kv[name].view(-1, width)[ROWS] = expected_kv(tok, POSITIONS, layer, t, width)


def step_output(new_reqs, counts) -> V.SchedulerOutput:
    return V.SchedulerOutput(new_reqs, V.CachedRequestData(), counts, sum(counts.values()))


def decode_rank(conn, ktc: dict) -> None:
    """Decode's worker, in a process of its own (a process binds one transfer-engine role)."""
    d_work = Rd2hConnector(config(ktc), KVConnectorRole.WORKER, kv_cache_config(M))
    d_kv = caches(shared=False)
    d_work.register_kv_caches(d_kv)
    conn.send("ready")
    try:
        if not conn.poll(60):
            return
        d_work.bind_connector_metadata(conn.recv())
        d_work.start_load_kv(V.ForwardContext())
        deadline = time.monotonic() + 30
        recving = None
        while not recving and time.monotonic() < deadline:
            _, recving = d_work.get_finished(set())
        d_work.clear_connector_metadata()
        wrong = []
        tok = torch.tensor(TOKENS)
        for l in range(M.layers):
            for t, (name, width) in enumerate(((main_name(l), M.main_bytes),
                                               (indexer_name(l), M.indexer_bytes))):
                got = d_kv[name].view(-1, width)[ROWS]
                if not torch.equal(got, expected_kv(tok, POSITIONS, l, t, width)):
                    wrong.append(name)
        conn.send((recving, d_work.get_block_ids_with_load_errors(), wrong))
    finally:
        d_work.shutdown()


def test_prefill_waits_for_decode_before_reusing_a_layer_buffer(metaserver):
    decode_ktc = kv_config("kv_consumer", free_ports(1))
    prefill_ktc = kv_config("kv_producer", free_ports(1))
    kcc = kv_cache_config(M)
    d_sched = Rd2hConnector(config(decode_ktc), KVConnectorRole.SCHEDULER, kcc)
    conn, decode = start_decode_rank(decode_rank, decode_ktc)
    p_sched = Rd2hConnector(config(prefill_ktc), KVConnectorRole.SCHEDULER, kcc)
    p_work = Rd2hConnector(config(prefill_ktc), KVConnectorRole.WORKER, kcc)
    p_kv = caches(shared=True)
    p_work.register_kv_caches(p_kv)
    try:
        # Decode's scheduler sets up the pull and posts the rendezvous.
        sp = V.SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {
            "do_remote_prefill": True, "do_remote_decode": False, "metaserver": metaserver.url}})
        d_req = V.Request("cmpl-hazard-0-abcd1234", TOKENS, sp)
        assert d_sched.get_num_new_matched_tokens(d_req, 0) == (len(TOKENS), True)
        blocks = V.KVCacheBlocks((tuple(V.KVCacheBlock(b) for b in BLOCKS),))
        d_sched.update_state_after_alloc(d_req, blocks, len(TOKENS))
        d_meta = d_sched.build_connector_meta(step_output([], {}))
        rendezvous = metaserver.next_post()

        # Prefill computes the request in one step, in vLLM's per-layer order.
        p_req = V.Request("cmpl-hazard-0-efgh5678", TOKENS, V.SamplingParams(
            max_tokens=1, extra_args={"kv_transfer_params": rendezvous}))
        assert p_sched.get_num_new_matched_tokens(p_req, 0) == (0, False)
        p_sched.update_state_after_alloc(p_req, blocks, 0)
        p_meta = p_sched.build_connector_meta(step_output(
            [V.NewRequestData(p_req.request_id, TOKENS, p_req.sampling_params, (BLOCKS,), 0)],
            {p_req.request_id: len(TOKENS)}))
        errors = []

        def forward() -> None:
            try:
                p_work.bind_connector_metadata(p_meta)
                p_work.start_load_kv(V.ForwardContext(attn_metadata={}))
                for l in range(M.layers):
                    p_work.wait_for_layer_load(main_name(l))
                    write(p_kv, l)
                    p_work.save_kv_layer(main_name(l), p_kv[main_name(l)], object())
                p_work.wait_for_save()
                p_work.clear_connector_metadata()
            except Exception as e:  # reported below
                errors.append(e)

        prefill = threading.Thread(target=forward)
        prefill.start()
        # Prefill's step cannot finish before Decode reads; without the wait it would, having
        # overwritten layer 0. Either way Decode is told of the request afterwards.
        prefill.join(timeout=2.0)
        assert prefill.is_alive() and not errors, \
            f"Prefill's step finished before Decode read its first layer {errors}"

        conn.send(d_meta)
        assert conn.poll(60), "Decode did not answer"
        recving, load_errors, wrong = conn.recv()
        prefill.join(timeout=30)
        assert not prefill.is_alive() and not errors, errors
        assert recving == {d_req.request_id}
        assert load_errors == set()
        assert not wrong, f"Decode's {wrong} hold another layer's KV"
    finally:
        for c in (p_work, p_sched, d_sched):
            c.shutdown()
        decode.join(timeout=30)
