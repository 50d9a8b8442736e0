"""Figures of rd2h inside real vLLM, measured in one run on this machine:

- time to first token and end-to-end latency of the same prompts through PD (Prefill and
  Decode vLLM engines, rd2h, `rd2h proxy`) and from a single vLLM instance;
- what the Python connector adds per layer inside vLLM (wait_for_layer_load + save_kv_layer
  on Prefill, timed on the connector instance by RD2H_VLLM_LAYER_TIMES), for steps of 1
  request and of 32, with Decode polling while it is owed layers (the default) and with
  Decode always asleep (busy_poll_us 0, so that every layer wakes it);
- KV bytes Decode read per prompt token, against what the model's layers hold per token.

    RD2H_BINARY=build/python/apps/rd2h "$(scripts/vllm-venv)/bin/python" tests/vllm/bench_vllm.py

Engines run one at a time where they are compared (the single instance is stopped before
the PD pair starts), and each engine has a CPU of its own (the single instance and Prefill
the first, Decode the second), as engines on separate hosts would: on two shared cores,
vLLM's busy-waiting processes of two engines and the Decode's reads preempt each other.
The per-layer time is given as wall-clock time and as the calling thread's CPU time.
"""

from __future__ import annotations

import os
import random
import socket
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import conftest as c  # noqa: E402
import make_model  # noqa: E402
import openai  # noqa: E402
from rd2h.bench import quantile  # noqa: E402  (nearest rank, as every rd2h bench)

PROMPT_LENGTHS = [100, 200, 400, 800] * 4
OUTPUT_TOKENS = 32


def timed_stream(url: str, prompt: str) -> tuple:
    cl = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    first = None
    n = 0
    for ev in cl.completions.create(model=c.MODEL_NAME, prompt=prompt, max_tokens=OUTPUT_TOKENS,
                                    temperature=0, stream=True):
        for ch in ev.choices:
            if ch.text and first is None:
                first = time.perf_counter() - t0
            n += len(ch.text)
    return first, time.perf_counter() - t0, n


def latencies(url: str, prompts: list) -> tuple:
    timed_stream(url, prompts[0])  # warm-up
    runs = [timed_stream(url, p) for p in prompts]
    return [r[0] for r in runs], [r[1] for r in runs]


def layer_times(directory: Path) -> dict:
    """requests in the step -> ([per-layer wall ns], [per-layer CPU ns])."""
    out: dict = {}
    for f in directory.glob("layer-times-*.txt"):
        for line in f.read_text().splitlines():
            requests, *layers = line.split()
            wall, cpu = out.setdefault(int(requests), ([], []))
            for layer in layers:
                w, c = layer.split("/")
                wall.append(int(w))
                cpu.append(int(c))
    return out


def wake_cost(samples: int = 2000) -> list:
    """CPU nanoseconds of one message that wakes a process sleeping on the other CPU (a
    Unix datagram, as UCX's shared-memory transport signals a sleeping peer): the least a
    per-layer notification to a sleeping Decode costs the sender on this host."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    reader = os.fork()
    if reader == 0:  # pragma: no cover (the child)
        os.sched_setaffinity(0, {1})
        while b.recv(16) != b"q":
            pass
        os._exit(0)
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    out = []
    try:
        for _ in range(samples):
            time.sleep(0.001)  # the reader is asleep again
            c0 = time.thread_time_ns()
            a.send(b"x")
            out.append(time.thread_time_ns() - c0)
    finally:
        os.sched_setaffinity(0, mask)
        a.send(b"q")
        os.waitpid(reader, 0)
    return out


def pd_run(work: Path, logs: Path, model: Path, prompts: list, rng: random.Random, name: str,
           **decode_extra) -> tuple:
    """Prefill on the first CPU and Decode on the second behind `rd2h proxy`: the prompts'
    TTFT and end-to-end latencies, Decode's KV bytes read and prompt tokens pulled for them,
    and the directory of Prefill's per-layer times (the prompts, then 5 lists of 32)."""
    times = work / f"layer-times-{name}"
    times.mkdir()
    os.environ["RD2H_VLLM_LAYER_TIMES"] = str(times)
    prefill = c.Engine(f"{name}-prefill", model, logs,
                       c.kv_transfer_config("kv_producer", c.free_port()), cpus="0")
    del os.environ["RD2H_VLLM_LAYER_TIMES"]
    decode = c.Engine(f"{name}-decode", model, logs,
                      c.kv_transfer_config("kv_consumer", c.free_port(), **decode_extra),
                      cpus="1")
    proxy = c.Proxy(f"{name}-proxy", logs, [prefill], [decode])
    try:
        before = decode.metrics()
        ttft, e2e = latencies(proxy.url, prompts)
        after = decode.metrics()
        read = (c.metric(after, "rd2h_kv_bytes_read_total")
                - c.metric(before, "rd2h_kv_bytes_read_total"))
        pulled = sum(c.metric(t, "vllm:prompt_tokens_by_source_total",
                              source="external_kv_transfer") * sign
                     for t, sign in ((after, 1), (before, -1)))
        # A prompt list of 32 prompts of 6 tokens: the proxy hands Prefill the 32 at once,
        # and Prefill computes them in one step (192 tokens, within the token budget).
        cl = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0,
                           timeout=600)
        for _ in range(5):
            batch = [c.prompt(rng, 6) for _ in range(32)]
            cl.completions.create(model=c.MODEL_NAME, prompt=batch, max_tokens=2,
                                  temperature=0)
    finally:
        proxy.stop()
        decode.stop()
        prefill.stop()
    return ttft, e2e, read, pulled, times


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="rd2h-bench-vllm-"))
    logs = work / "logs"
    logs.mkdir()
    model = work / "model"
    model.mkdir()
    c.made_model(model)
    rng = random.Random(3)
    prompts = [c.prompt(rng, n) for n in PROMPT_LENGTHS]

    # One CPU per engine: the single instance on the first, Prefill on the first and Decode
    # on the second, as on separate hosts (the proxy and the client run where they may).
    single = c.Engine("single", model, logs, cpus="0")
    try:
        s_ttft, s_e2e = latencies(single.url, prompts)
    finally:
        single.stop()

    # PD with Decode's default busy polling, then with Decode always asleep (busy_poll_us
    # 0): what the polling spares Prefill's compute thread.
    polled = pd_run(work, logs, model, prompts, rng, "pd")
    asleep = pd_run(work, logs, model, prompts, rng, "pd-asleep", busy_poll_us=0)
    pd_ttft, pd_e2e, read, pulled, _ = polled

    wake = quantile(wake_cost(), 0.5)
    per_token = make_model.kv_bytes_per_token()
    print(f"vLLM {__import__('vllm').__version__}, tiny Llama ({make_model.NUM_LAYERS} layers, "
          f"fp32, block {c.BLOCK_SIZE}), {len(prompts)} prompts of {min(PROMPT_LENGTHS)}-"
          f"{max(PROMPT_LENGTHS)} tokens, {OUTPUT_TOKENS} tokens out, one at a time")
    for name, pd, single_ in (("TTFT", pd_ttft, s_ttft), ("end to end", pd_e2e, s_e2e)):
        p50, s50 = quantile(pd, 0.5), quantile(single_, 0.5)
        p99, s99 = quantile(pd, 0.99), quantile(single_, 0.99)
        print(f"  {name}: PD p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms; single p50 "
              f"{s50 * 1e3:.1f} ms, p99 {s99 * 1e3:.1f} ms; PD/single p50 {p50 / s50:.2f}x")
    print(f"  KV read per pulled prompt token: {read / pulled:.0f} bytes; the model's layers "
          f"hold {per_token} bytes per token ({read / pulled / per_token:.3f}x)")
    for label, run in (("", polled), (", Decode asleep (busy_poll_us 0)", asleep)):
        by_size = layer_times(run[4])
        for requests in sorted(by_size):
            wall, cpu = by_size[requests]
            if requests == 1 or requests == max(by_size):
                print(f"  connector per layer{label}, {requests} request(s) in the step "
                      f"({len(wall)} layers): wall p50 {quantile(wall, 0.5) / 1e3:.1f} us, p99 "
                      f"{quantile(wall, 0.99) / 1e3:.1f} us; on the thread's CPU p50 "
                      f"{quantile(cpu, 0.5) / 1e3:.1f} us ({quantile(cpu, 0.5) / wake:.1f}x a "
                      f"wake), p99 {quantile(cpu, 0.99) / 1e3:.1f} us")
    print(f"  a wake: one message to a process asleep on the other CPU costs its sender "
          f"{wake / 1e3:.1f} us of CPU (p50)")
    print(f"  (engine logs in {logs})")


if __name__ == "__main__":
    main()
