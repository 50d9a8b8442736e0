"""What the Python class adds per layer: the same per-layer loop of a forward pass through
rd2h.vllm.Rd2hConnector and through the C++ facade, on one Prefill worker, in one run.

    python3 -m rd2h.bench [--layers 61] [--steps 200] [--rounds 5]

Per step: bind_connector_metadata, start_load_kv, then per layer wait_for_layer_load and
save_kv_layer (the two calls vLLM's attention decorator makes; each layer timed), then
wait_for_save and clear_connector_metadata. The step carries no request, so both paths do
the same C++ work and the difference is Python's: the class's bookkeeping, the binding, the
GIL hand-off. Rounds alternate the two paths; figures are p50 and p99 per layer.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import statistics
import sys
import time


def quantile(xs: list[float], q: float) -> float:
    """The nearest rank, as rd2h's C++ benches and demo report define it (metrics::quantile):
    the smallest value with at least a share q of the values at or below it; 0 for none."""
    if not xs:
        return 0
    s = sorted(xs)
    rank = math.ceil(q * len(s))
    return s[min(len(s) - 1, max(rank, 1) - 1)]


class Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def connectors(layers: int):
    """A Prefill scheduler and worker of the Python class on a free port, the worker's caches
    registered, and the metadata of a step without requests."""
    import torch

    from rd2h.vllm import KVConnectorRole, Rd2hConnector

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ktc = Obj(kv_connector="Rd2hConnector", kv_role="kv_producer", kv_port=port, engine_id="bench",
              kv_ip="127.0.0.1", kv_connector_extra_config={}, is_kv_producer=True)
    vc = Obj(kv_transfer_config=ktc, parallel_config=Obj(tensor_parallel_size=1, rank=0),
             cache_config=Obj(block_size=128))
    names = [f"model.layers.{l}.self_attn.attn" for l in range(layers)]
    kcc = Obj(kv_cache_groups=[Obj(layer_names=names, kv_cache_spec=Obj(block_size=128))])
    sched = Rd2hConnector(vc, KVConnectorRole.SCHEDULER, kcc)
    conn = Rd2hConnector(vc, KVConnectorRole.WORKER, kcc)
    caches = {n: torch.zeros(4, 128, 656, dtype=torch.uint8) for n in names}
    conn.register_kv_caches(caches)
    so = Obj(scheduled_new_reqs=[], scheduled_cached_reqs=Obj(req_ids=[], new_block_ids=[],
                                                              num_computed_tokens=[]),
             num_scheduled_tokens={})
    return sched, conn, caches, sched.build_connector_meta(so)


def python_loop(conn, caches: dict, meta, steps: int) -> list[int]:
    """Each layer's wait_for_layer_load + save_kv_layer through the Python class, in ns."""
    out = []
    clock = time.perf_counter_ns
    attn = object()
    for _ in range(steps):
        conn.bind_connector_metadata(meta)
        conn.start_load_kv(None)
        for n, cache in caches.items():
            t0 = clock()
            conn.wait_for_layer_load(n)
            conn.save_kv_layer(n, cache, attn)
            out.append(clock() - t0)
        conn.wait_for_save()
        conn.clear_connector_metadata()
    return out


def report(args: argparse.Namespace, py_all: list[int], cpp_all: list[int]) -> dict:
    result = {
        "layers_per_path": len(py_all),
        "cpp_p50_us": quantile(cpp_all, 0.5) / 1e3,
        "cpp_p99_us": quantile(cpp_all, 0.99) / 1e3,
        "python_p50_us": quantile(py_all, 0.5) / 1e3,
        "python_p99_us": quantile(py_all, 0.99) / 1e3,
    }
    result["added_p50_us"] = result["python_p50_us"] - result["cpp_p50_us"]
    result["added_p99_us"] = result["python_p99_us"] - result["cpp_p99_us"]
    result["python_mean_us"] = statistics.fmean(py_all) / 1e3
    print(f"per-layer loop (wait_for_layer_load + save_kv_layer), {args.layers} layers x "
          f"{args.steps} steps x {args.rounds} rounds per path")
    print(f"  C++ facade:   p50 {result['cpp_p50_us']:.2f} us   p99 {result['cpp_p99_us']:.2f} us")
    print(f"  Python class: p50 {result['python_p50_us']:.2f} us   p99 {result['python_p99_us']:.2f} us")
    print(f"  Python adds:  p50 {result['added_p50_us']:.2f} us   p99 {result['added_p99_us']:.2f} us "
          f"(goal: p50 <= 20 us)")
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)

    sched, conn, caches, meta = connectors(args.layers)
    names = list(caches)

    def on_python() -> list[int]:
        return python_loop(conn, caches, meta, args.steps)

    def on_cpp() -> list[int]:
        return conn._worker._time_layer_loop(meta.data, names, args.steps)

    py_all, cpp_all = [], []
    on_python(), on_cpp()  # warm-up
    for r in range(args.rounds):
        for fn, acc in ((on_python, py_all), (on_cpp, cpp_all))[:: 1 if r % 2 == 0 else -1]:
            acc.extend(fn())
    conn.shutdown()
    sched.shutdown()
    print(json.dumps(report(args, py_all, cpp_all)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
