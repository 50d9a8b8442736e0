"""What the proxy's failover gives, in one run: two Prefill and two Decode engines (the
vLLM-shaped mini engines of the tests, each with the rd2h connector) behind `rd2h proxy`;
before the load one Decode is SIGKILLed and one Prefill SIGSTOPped (a stalled host); then
200 requests, 8 at a time. Reported: how many succeeded, their latency (p50, p99, max), the
proxy's retries and the instances it took out, and when its /health said the fleet was
degraded.

    RD2H_BINARY=build/python/apps/rd2h PYTHONPATH=build/python-site \\
        /usr/bin/python3 tests/python/bench_failover.py
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import EngineProcess, ProxyProcess, free_ports, kv_config  # noqa: E402
from rd2h.bench import quantile  # noqa: E402

REQUESTS = 200
AT_ONCE = 8
TIMEOUT_S = 120.0


def ask(url: str, i: int) -> tuple:
    """(HTTP status or 0, seconds, error text) of one completion."""
    body = json.dumps({"prompt": f"request {i} " * 4, "max_tokens": 2}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            r.read()
            return r.status, time.monotonic() - t0, ""
    except urllib.error.HTTPError as e:
        return e.code, time.monotonic() - t0, e.read()[:200].decode(errors="replace")
    except OSError as e:
        return 0, time.monotonic() - t0, str(e)


def health(url: str) -> tuple:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except OSError:
        return 0, {}


def main() -> None:
    binary = os.environ.get("RD2H_BINARY")
    if not binary:
        sys.exit("RD2H_BINARY must name the rd2h binary")
    decodes = [EngineProcess("decode", kv_config("kv_consumer", free_ports(1))) for _ in range(2)]
    prefills = [EngineProcess("prefill", kv_config("kv_producer", free_ports(1))) for _ in range(2)]
    proxy = ProxyProcess(binary, [p.url for p in prefills], [d.url for d in decodes])
    stopped = prefills[0]
    try:
        # Every pair connected once, so that what is measured is the failover.
        for i in range(8):
            status, _, why = ask(proxy.url, -1 - i)
            assert status == 200, f"warm-up request failed: {status} {why}"
        decodes[0].proc.send_signal(signal.SIGKILL)
        decodes[0].proc.wait(timeout=30)
        os.kill(stopped.proc.pid, signal.SIGSTOP)
        hit = time.monotonic()
        with ThreadPoolExecutor(AT_ONCE) as pool:
            results = list(pool.map(lambda i: ask(proxy.url, i), range(REQUESTS)))
        took = time.monotonic() - hit
        degraded = None
        status, body = health(proxy.url)
        if body.get("status") == "degraded":
            degraded = status
        ok = [r for r in results if r[0] == 200]
        seconds = sorted(r[1] for r in results)
        print(f"2 Prefill + 2 Decode behind rd2h proxy; one Decode SIGKILLed, one Prefill "
              f"SIGSTOPped, then {REQUESTS} requests {AT_ONCE} at a time ({took:.1f} s):")
        print(f"  succeeded {len(ok)} of {REQUESTS} ({100.0 * len(ok) / REQUESTS:.1f}%); latency "
              f"p50 {quantile(seconds, 0.5):.3f} s, p99 {quantile(seconds, 0.99):.3f} s, "
              f"max {seconds[-1]:.3f} s")
        failed = [r for r in results if r[0] != 200]
        if failed:
            print(f"  failures, first: HTTP {failed[0][0]}: {failed[0][2]}")
        print(f"  /health after the load: HTTP {status}, status {body.get('status')!r}, out of "
              f"rotation: {[i['url'] for role in ('prefill', 'decode') for i in body.get(role, []) if not i.get('healthy')]}")
        if degraded is None:
            print("  /health did not say degraded")
    finally:
        try:
            os.kill(stopped.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        proxy.close()
        for e in prefills + decodes[1:]:
            e.stop()


if __name__ == "__main__":
    main()
