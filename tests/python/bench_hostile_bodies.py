"""What hostile request bodies cost in memory, in one run: `rd2h proxy` (and `rd2h decode`)
sent bodies of 16 MiB that are valid JSON but expand when parsed (`{}` x 5M, `"a"` x 4M,
a 16 MiB token list), one at a time and four at once. Reported per server: its resident
memory before, its peak (VmHWM) after each probe, and its resident memory after (the lowest
within a second of the answers: the server returns memory once it has answered).

    /usr/bin/python3 tests/python/bench_hostile_bodies.py build/default/apps/rd2h
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import free_ports  # noqa: E402

MIB = 1 << 20


def memory(pid: int) -> dict:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak(pid: int) -> None:
    # Writing 5 to clear_refs resets VmHWM to the current RSS.
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def bodies() -> dict:
    size = 16 * MIB - 64
    return {
        "{} x 5M": '{"prompt": [' + ",".join(["{}"] * ((size - 16) // 3)) + "]}",
        '"a" x 4M': '{"prompt": [' + ",".join(['"a"'] * ((size - 16) // 4)) + "]}",
        "16 MiB of token ids": '{"prompt": [[' + ",".join(["1"] * ((size - 16) // 2)) + "]]}",
    }


def post(url: str, body: bytes, out: list) -> None:
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            out.append(r.status)
    except urllib.error.HTTPError as e:
        out.append(e.code)
    except OSError as e:
        out.append(str(e))


def probe(name: str, pid: int, url: str) -> None:
    print(f"\n{name}:")
    for what, text in bodies().items():
        data = text.encode()
        for at_once in (1, 4):
            before = memory(pid)["VmRSS"]
            reset_peak(pid)
            statuses: list = []
            threads = [threading.Thread(target=post, args=(url, data, statuses))
                       for _ in range(at_once)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            m = memory(pid)
            # The server gives memory back once it has answered: the lowest RSS within 1 s.
            settle = time.monotonic() + 1.0
            while time.monotonic() < settle:
                m["VmRSS"] = min(m["VmRSS"], memory(pid)["VmRSS"])
                time.sleep(0.02)
            print(f"  {what:22s} x{at_once}: HTTP {sorted(set(map(str, statuses)))}; "
                  f"RSS {before / MIB:6.1f} MiB before, peak +{(m['VmHWM'] - before) / MIB:6.1f} MiB, "
                  f"after {m['VmRSS'] / MIB:6.1f} MiB")


def main() -> None:
    binary = sys.argv[1]
    port = free_ports(2)
    meta = port + 1
    proxy = subprocess.Popen([binary, "proxy", "--port", str(port), "--metaserver-port", str(meta),
                              "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:10"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        proxy.stdout.readline()
        probe("rd2h proxy", proxy.pid, f"http://127.0.0.1:{port}/v1/completions")
    finally:
        proxy.terminate()
        proxy.wait(30)
    http_port = free_ports(1)
    kv_port = free_ports(4)
    config = json.dumps({"kv_connector": "rd2h", "kv_role": "kv_consumer", "kv_port": kv_port,
                         "kv_connector_extra_config": {"transport": "shm"}})
    decode = subprocess.Popen([binary, "decode", "--port", str(http_port), "--layers", "2",
                               "--num-blocks", "64", "--kv-transfer-config", config],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = decode.stdout.readline()
        assert "serving" in line, line
        probe("rd2h decode (engine process)", decode.pid,
              f"http://127.0.0.1:{http_port}/v1/completions")
    finally:
        decode.terminate()
        decode.wait(30)


if __name__ == "__main__":
    main()
