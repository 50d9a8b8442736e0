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

from mini_engine_rank import Model  # noqa: E402
from rd2h.bench import quantile  # noqa: E402
from staged_transfer import StagedPair, caches, copy_blocks  # noqa: E402

REQUESTS = 12
BLOCKS_PER_REQUEST = 16


def run(m: Model, on_device: bool) -> tuple:
    """Per layer Prefill's save_kv_layer seconds per MiB, and per request the Decode-ready
    delay."""
    device = "double" if on_device else "cpu"
    pair = StagedPair(m, device, copy_blocks, prefill_kv=caches(m, device, fill=True))
    save_per_mib, ready_delay = [], []
    layer_mib = BLOCKS_PER_REQUEST * m.block_size * (m.main_bytes + m.indexer_bytes) / 2**20
    try:
        for i in range(REQUESTS + 1):  # the first opens the connection: not counted
            blocks = [(i * BLOCKS_PER_REQUEST + b) % m.num_blocks for b in range(BLOCKS_PER_REQUEST)]
            tokens = [100 + (i + t) % 1000 for t in range(BLOCKS_PER_REQUEST * m.block_size)]
            meta = pair.schedule(f"bench-{i}", tokens, blocks, check=False)
            saved = []
            pair.prefill(meta, lambda l: None, lambda: saved.append(time.monotonic()))
            recving, finished, _ = pair.answer()
            assert recving == {pair.decode_request}, recving
            if i > 0:
                save_per_mib += [s / layer_mib for s in pair.save_seconds]
                ready_delay.append(finished - saved[0])
    finally:
        pair.close()
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
