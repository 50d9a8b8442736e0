"""The GPU check (scripts/gpu-check): a Prefill and a Decode worker whose KV caches are CUDA
tensors (torch's CUDA allocator), staged through host buffers with vLLM's copy operation on
a side stream and its events, every byte Decode ends up with on its device checked.

With no GPU that torch can use, it says why and exits 0 (skipped). `--device double` runs
the same program on the device double of the tests (CPU tensors that report a GPU), which
is how the suite keeps this program working on machines without a GPU.

On a GPU it also reports, per layer: the device->host copy against a stand-in for the
layer's compute (matrix products on the compute stream, `--compute-ms` long), and the
fraction of the copies hidden behind compute: 1 - (what the last copy ran past the end of
the compute) / (the step's copy time).

Exit status: 0 when every byte checked (or skipped), 1 when a byte differs, 2 on an error.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def why_no_gpu() -> str:
    """Why this process cannot run the check on a GPU ("" if it can)."""
    try:
        import torch
    except ImportError as e:
        return f"torch is not importable ({e})"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
    return ""


def libraries() -> str:
    """Where this process loaded rd2h's module and its own libraries from (UCX, ZeroMQ,
    spdlog, fmt, cpp-httplib), as "name: directory" pairs."""
    import rd2h  # noqa: F401  (loads them)

    wanted = ("_native", "libucp", "libucs", "libuct", "libzmq", "libspdlog", "libfmt",
              "libcpp-httplib")
    found = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            name = path.rsplit("/", 1)[-1]
            if path.startswith("/") and name.startswith(wanted):
                found[name.split(".")[0]] = path.rsplit("/", 1)[0]
    return ", ".join(f"{n}: {d}" for n, d in sorted(found.items()))


class TimedCopy:
    """A copy operation whose device->host calls are timed (on the thread that runs them)."""

    def __init__(self, copy) -> None:
        self.copy = copy
        self.lock = threading.Lock()
        self.spans: list = []  # (start, end) of each device->host call

    def __call__(self, src, dst, src_ids, dst_ids, direction) -> None:
        t0 = time.perf_counter()
        self.copy(src, dst, src_ids, dst_ids, direction)
        if direction == "d2h":
            with self.lock:
                self.spans.append((t0, time.perf_counter()))

    def take(self) -> list:
        with self.lock:
            out, self.spans = self.spans, []
        return out


def compute_stand_in(torch, compute_ms: float):
    """A function that keeps the current stream busy for about `compute_ms` with matrix
    products (calibrated here), as a layer's compute would."""
    a = torch.randn(1024, 1024, device="cuda")
    b = torch.randn(1024, 1024, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.matmul(a, b)
    start.record()
    for _ in range(20):
        torch.matmul(a, b)
    end.record()
    end.synchronize()
    n = max(1, round(compute_ms / (start.elapsed_time(end) / 20)))

    def layer_compute() -> None:
        for _ in range(n):
            torch.matmul(a, b)

    return layer_compute


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "double"), default="cuda")
    p.add_argument("--requests", type=int, default=8, help="after one that opens the connection")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--blocks", type=int, default=16, help="blocks per request")
    p.add_argument("--block-size", type=int, default=64, help="tokens per block")
    p.add_argument("--main-bytes", type=int, default=656,
                   help="main KV bytes per token (DeepSeek-V3.2's FP8 latent: 656)")
    p.add_argument("--indexer-bytes", type=int, default=132,
                   help="indexer bytes per token (DeepSeek-V3.2: 132)")
    p.add_argument("--compute-ms", type=float, default=2.0,
                   help="the stand-in for a layer's compute, on a GPU")
    args = p.parse_args(argv)

    if args.device == "cuda":
        reason = why_no_gpu()
        if reason:
            print(f"gpu-check: skipped: {reason}")
            return 0
    import torch

    from mini_engine_rank import Model
    from staged_transfer import StagedPair, copy_blocks, vllm_copy_op, write

    m = Model(layers=args.layers, block_size=args.block_size,
              num_blocks=max(64, 2 * args.blocks), main_bytes=args.main_bytes,
              indexer_bytes=args.indexer_bytes)
    gpu = args.device == "cuda"
    op, op_name = vllm_copy_op() if gpu else (copy_blocks, "the double's block copies")
    timed = TimedCopy(op)
    where = (f"CUDA device {torch.cuda.get_device_name(0)} (torch {torch.__version__})" if gpu
             else "the device double (CPU tensors that report a GPU)")
    print(f"gpu-check: KV caches on {where}; copies by {op_name}; {args.requests} requests of "
          f"{args.blocks} blocks x {args.layers} layers")
    print(f"gpu-check: loaded {libraries()}")
    compute = compute_stand_in(torch, args.compute_ms) if gpu else None
    rng = random.Random(7)
    copy_ms, compute_ms, hidden = [], [], []
    checked = 0
    pair = StagedPair(m, args.device, timed)
    try:
        for i in range(args.requests + 1):
            blocks = rng.sample(range(m.num_blocks), args.blocks)
            tokens = [rng.randrange(1000) for _ in range(args.blocks * m.block_size - 3)]
            meta = pair.schedule(f"gpu-check-{i}", tokens, blocks)
            events: list = []
            ended: list = []

            def layer(l: int) -> None:
                if compute is not None:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                        enable_timing=True)
                    start.record()
                    compute()
                    end.record()
                    events.append((start, end))
                write(m, pair.kv, l, tokens, blocks)

            def after_layers() -> None:
                if gpu:
                    torch.cuda.synchronize()
                ended.append(time.perf_counter())

            timed.take()
            pair.prefill(meta, layer, after_layers)
            recving, _, wrong = pair.answer()
            if recving != {pair.decode_request}:
                print(f"gpu-check: FAILED: Decode finished {recving}, not {pair.decode_request}")
                return 1
            if wrong:
                print(f"gpu-check: FAILED: request {i}: Decode's device caches {wrong} differ "
                      "from what Prefill computed")
                return 1
            checked += len(tokens) * m.layers * (m.main_bytes + m.indexer_bytes)
            spans = timed.take()
            if i == 0 or not gpu:
                continue
            # A layer is two copies, main KV then its indexer.
            copy_ms += [(spans[k][1] - spans[k][0] + spans[k + 1][1] - spans[k + 1][0]) * 1e3
                        for k in range(0, len(spans) - 1, 2)]
            compute_ms += [s.elapsed_time(e) for s, e in events]
            total = sum(e - s for s, e in spans)
            exposed = max(0.0, max(e for _, e in spans) - ended[0])
            hidden.append(1.0 - exposed / total if total > 0 else 1.0)
    finally:
        pair.close()
    if gpu and copy_ms:
        layer_mib = args.blocks * m.block_size * (m.main_bytes + m.indexer_bytes) / 2**20
        c = statistics.median(copy_ms)
        print(f"gpu-check: per layer ({layer_mib:.2f} MiB): device->host copy p50 {c:.3f} ms "
              f"({layer_mib / 1024 / (c / 1e3):.2f} GiB/s), compute stand-in p50 "
              f"{statistics.median(compute_ms):.3f} ms; copies hidden behind compute, p50 "
              f"{statistics.median(hidden):.0%}")
    print(f"gpu-check: passed: {checked} bytes of KV on Decode's device caches, each equal to "
          "what Prefill computed")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # a clear line, then the trace
        import traceback

        traceback.print_exc()
        print(f"gpu-check: error: {e}", file=sys.stderr)
        sys.exit(2)
