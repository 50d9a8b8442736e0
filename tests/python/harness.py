"""Pieces of the Python tests that programs outside pytest use too (bench_staging.py,
gpu_check.py): free ports, the connector's settings, a recording metaserver, a Decode worker
in a process of its own."""

from __future__ import annotations

import json
import multiprocessing as mp
import queue
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional


def free_ports(n: int) -> int:
    """A base port with n consecutive ports free on loopback."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        try:
            held = []
            for p in range(base, base + n):
                t = socket.socket()
                held.append(t)
                t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for t in held:
                t.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def kv_config(role: str, kv_port: int, **extra) -> dict:
    policy = extra.pop("kv_load_failure_policy", "fail")
    return {
        "kv_connector": "Rd2hConnector",
        "kv_connector_module_path": "rd2h.vllm",
        "kv_role": role,
        "kv_port": kv_port,
        "engine_id": f"{role}-{kv_port}",
        "kv_ip": "127.0.0.1",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"transport": "auto", **extra},
    }


class Metaserver:
    """An HTTP endpoint that records the rendezvous Decode posts and hands each to `on_post`."""

    def __init__(self, on_post: Optional[Callable[[dict], None]] = None):
        self.posts: queue.Queue = queue.Queue()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                owner.posts.put(body)
                if on_post:
                    on_post(body)
                data = b'{"status":"ok"}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/metaserver"

    def next_post(self, timeout: float = 30.0) -> dict:
        return self.posts.get(timeout=timeout)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def start_decode_rank(target: Callable, *args) -> tuple:
    """Runs ``target(conn, *args)``, a Decode worker, in a spawned process of its own (a
    process binds one transfer-engine role) and waits for it to send "ready": the parent's
    end of the pipe, and the process."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    assert conn.poll(120) and conn.recv() == "ready", "the Decode process did not start"
    return conn, proc
