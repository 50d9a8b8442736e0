"""What staging device KV through host buffers costs, against registering host caches, in one run.

For blocks of 128 KiB and of 1 MiB (main KV; the indexer is an eighth of it), Prefill and
Decode workers move the same requests twice: with host caches registered as they are, and
with caches on a device double (CPU tensors that report a GPU, as in test_staging.py), which
rd2h stages through host mirrors with a block-copy operation of vLLM's shape. Reported:

- Prefill's ``save_kv_layer`` per MiB of the layer's blocks, p50, for both (staged, it
  copies the blocks device->host before it returns), and the difference: the copy, against
  a plain memory copy measured in the same run;
- the Decode-ready delay: from Prefill's last ``save_kv_layer`` returning to Decode's
  ``get_finished`` reporting the request (Decode's host->device copy included), p50, for
  both, and their ratio.

On this CPU "device" memory is host memory, so the copies are memory copies: a GPU's
device->host copy runs on a side stream instead, and its cost is the PCIe transfer.

    PYTHONPATH=build/python-site /usr/bin/python3 tests/python/bench_staging.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import vllm_standin as V  # noqa: E402
from conftest import Metaserver, free_ports, kv_config, start_decode_rank  # noqa: E402
from mini_engine_rank import Model, indexer_name, kv_cache_config, main_name  # noqa: E402
from rd2h.bench import quantile  # noqa: E402
from rd2h.vllm import KVConnectorRole, Rd2hConnector  # noqa: E402
from test_staging import OnDevice, copy_blocks  # noqa: E402

REQUESTS = 12
BLOCKS_PER_REQUEST = 16


def caches(m: Model, on_device: bool) -> dict:
    out = {}
    for l in range(m.layers):
        for name, width in ((main_name(l), m.main_bytes), (indexer_name(l), m.indexer_bytes)):
            t = torch.randint(0, 255, (m.num_blocks, m.block_size, width), dtype=torch.uint8)
            out[name] = t.as_subclass(OnDevice) if on_device else t
    return out


def config(m: Model, ktc: dict) -> V.VllmConfig:
    return V.VllmConfig(kv_transfer_config=V.KVTransferConfig(**ktc),
                        cache_config=V.CacheConfig(block_size=m.block_size))


def step_output(new_reqs, counts) -> V.SchedulerOutput:
    return V.SchedulerOutput(new_reqs, V.CachedRequestData(), counts, sum(counts.values()))


def decode_rank(conn, m: Model, ktc: dict, on_device: bool) -> None:
    work = Rd2hConnector(config(m, ktc), KVConnectorRole.WORKER, kv_cache_config(m))
    work.register_kv_caches(caches(m, on_device))
    work.set_host_xfer_buffer_ops(copy_blocks)
    conn.send("ready")
    try:
        while conn.poll(60):
            meta = conn.recv()
            if meta is None:
                return
            work.bind_connector_metadata(meta)
            work.start_load_kv(V.ForwardContext())
            recving, deadline = None, time.monotonic() + 60
            while not recving and time.monotonic() < deadline:
                _, recving = work.get_finished(set())
            work.clear_connector_metadata()
            conn.send((recving, time.monotonic()))
    finally:
        work.shutdown()


def run(m: Model, on_device: bool) -> tuple:
    """Per layer Prefill's save_kv_layer seconds per MiB, and per request the Decode-ready
    delay."""
    metaserver = Metaserver()
    decode_ktc = kv_config("kv_consumer", free_ports(1))
    prefill_ktc = kv_config("kv_producer", free_ports(1))
    kcc = kv_cache_config(m)
    d_sched = Rd2hConnector(config(m, decode_ktc), KVConnectorRole.SCHEDULER, kcc)
    conn, decode = start_decode_rank(decode_rank, m, decode_ktc, on_device)
    p_sched = Rd2hConnector(config(m, prefill_ktc), KVConnectorRole.SCHEDULER, kcc)
    p_work = Rd2hConnector(config(m, prefill_ktc), KVConnectorRole.WORKER, kcc)
    p_work.register_kv_caches(caches(m, on_device))
    p_work.set_host_xfer_buffer_ops(copy_blocks)
    save_per_mib, ready_delay = [], []
    layer_mib = BLOCKS_PER_REQUEST * m.block_size * (m.main_bytes + m.indexer_bytes) / 2**20
    try:
        for i in range(REQUESTS + 1):  # the first opens the connection: not counted
            blocks = [(i * BLOCKS_PER_REQUEST + b) % m.num_blocks for b in range(BLOCKS_PER_REQUEST)]
            tokens = [100 + (i + t) % 1000 for t in range(BLOCKS_PER_REQUEST * m.block_size)]
            sp = V.SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {
                "do_remote_prefill": True, "do_remote_decode": False,
                "metaserver": metaserver.url}})
            d_req = V.Request(f"cmpl-bench-{i}-abcd1234", tokens, sp)
            d_sched.get_num_new_matched_tokens(d_req, 0)
            kv_blocks = V.KVCacheBlocks((tuple(V.KVCacheBlock(b) for b in blocks),))
            d_sched.update_state_after_alloc(d_req, kv_blocks, len(tokens))
            conn.send(d_sched.build_connector_meta(step_output([], {})))
            rendezvous = metaserver.next_post()
            p_req = V.Request(f"cmpl-bench-{i}-efgh5678", tokens, V.SamplingParams(
                max_tokens=1, extra_args={"kv_transfer_params": rendezvous}))
            p_sched.get_num_new_matched_tokens(p_req, 0)
            p_sched.update_state_after_alloc(p_req, kv_blocks, 0)
            p_meta = p_sched.build_connector_meta(step_output(
                [V.NewRequestData(p_req.request_id, tokens, p_req.sampling_params, (blocks,), 0)],
                {p_req.request_id: len(tokens)}))
            p_work.bind_connector_metadata(p_meta)
            p_work.start_load_kv(V.ForwardContext(attn_metadata={}))
            for l in range(m.layers):
                p_work.wait_for_layer_load(main_name(l))
                t0 = time.perf_counter()
                p_work.save_kv_layer(main_name(l), None, object())
                if i > 0:
                    save_per_mib.append((time.perf_counter() - t0) / layer_mib)
            saved = time.monotonic()
            p_work.wait_for_save()
            p_work.clear_connector_metadata()
            assert conn.poll(60), "Decode did not answer"
            recving, finished = conn.recv()
            assert recving == {d_req.request_id}, recving
            if i > 0:
                ready_delay.append(finished - saved)
        conn.send(None)
    finally:
        for c in (p_work, p_sched, d_sched):
            c.shutdown()
        decode.join(timeout=30)
        metaserver.close()
    return save_per_mib, ready_delay


def memcpy_per_mib(mib: int = 64, rounds: int = 9) -> float:
    """A plain memory copy on this machine, seconds per MiB (p50), for scale."""
    src = torch.randint(0, 255, (mib, 1 << 20), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # both touched
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        dst.copy_(src)
        out.append((time.perf_counter() - t0) / mib)
    return quantile(out, 0.5)


def main() -> None:
    print(f"{REQUESTS} requests of {BLOCKS_PER_REQUEST} blocks, 4 layers; main KV blocks of "
          "the size below, indexer blocks an eighth of it")
    for kib in (128, 1024):
        m = Model(layers=4, block_size=16, num_blocks=64, main_bytes=kib * 1024 // 16,
                  indexer_bytes=kib * 1024 // 16 // 8)
        host_save, host_delay = run(m, on_device=False)
        staged_save, staged_delay = run(m, on_device=True)
        hs, ss = quantile(host_save, 0.5), quantile(staged_save, 0.5)
        h, s = quantile(host_delay, 0.5), quantile(staged_delay, 0.5)
        mc = memcpy_per_mib()
        print(f"  {kib} KiB blocks: save_kv_layer p50 host caches {hs * 1e3:.3f} ms/MiB, staged "
              f"{ss * 1e3:.3f} ms/MiB (the copy: {(ss - hs) * 1e3:.3f} ms/MiB, "
              f"{(ss - hs) / mc:.1f}x a memcpy's {mc * 1e3:.3f}); Decode-ready "
              f"after the last layer p50: host caches {h * 1e3:.2f} ms, staged {s * 1e3:.2f} ms "
              f"({s / h:.2f}x)")


if __name__ == "__main__":
    main()
