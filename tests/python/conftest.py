"""Shared pieces of the Python tests: free ports, mini engines as processes, a recording
metaserver, HTTP calls with deadlines."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

START_DEADLINE_S = 120.0


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


def start_process(cmd: list) -> tuple:
    """The process and the first line it printed ("" if none within the start deadline)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in proc.stdout] and None,
                     daemon=True).start()
    try:
        return proc, lines.get(timeout=START_DEADLINE_S)
    except queue.Empty:
        return proc, ""


class EngineProcess:
    """mini_engine.py as a process; started once it printed 'ready <port>'."""

    def __init__(self, role: str, ktc: dict, tp: int = 1, args: tuple = ()):
        cmd = [sys.executable, os.path.join(HERE, "mini_engine.py"), "--role", role, "--tp", str(tp),
               "--kv-transfer-config", json.dumps(ktc), *args]
        self.proc, line = start_process(cmd)
        if not line.startswith("ready "):
            self.stop()
            raise RuntimeError(f"{role} engine did not start: {line!r}")
        self.url = f"http://127.0.0.1:{int(line.split()[1])}"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


class ProxyProcess:
    """`rd2h proxy` as a process (the binary named by RD2H_BINARY)."""

    def __init__(self, binary: str, prefill: list, decode: list):
        cmd = [binary, "proxy", "--host", "127.0.0.1", "--port", "0", "--metaserver-port", "0"]
        for url in prefill:
            cmd += ["--prefill", url]
        for url in decode:
            cmd += ["--decode", url]
        self.proc, line = start_process(cmd)
        if "serving " not in line:
            self.close()
            raise RuntimeError(f"rd2h proxy did not start: {line!r}")
        self.url = line.split("serving ")[1].split()[0]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        assert self.proc.returncode == 0, f"rd2h proxy exited with {self.proc.returncode}"


def start_proxy(prefill: list, decode: list):
    """`rd2h proxy`: the binary when RD2H_BINARY names it, else the same proxy in-process."""
    binary = os.environ.get("RD2H_BINARY")
    if binary:
        return ProxyProcess(binary, prefill, decode)
    import rd2h

    return rd2h.Proxy(prefill=prefill, decode=decode)


def post(url: str, body: dict, headers: Optional[dict] = None, timeout: float = 120.0):
    """(status, JSON body) of a POST."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


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


@pytest.fixture
def metaserver():
    m = Metaserver()
    yield m
    m.close()


def _run_and_report(conn, module: str, name: str) -> None:
    import importlib
    import traceback

    try:
        getattr(importlib.import_module(module), name)()
        conn.send(None)
    except BaseException:  # reported to the parent, which fails the test with it
        conn.send(traceback.format_exc())


def in_own_process(fn):
    """Runs a test in a process of its own: a process binds its transfer engine to one role,
    and the tests of one file share a process."""
    import functools
    import multiprocessing as mp

    @functools.wraps(fn)
    def wrapper():
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_run_and_report, args=(child, fn.__module__, "_isolated_" + fn.__name__))
        p.start()
        try:
            assert parent.poll(120), f"{fn.__name__} did not finish in its process"
            failure = parent.recv()
        finally:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        if failure:
            pytest.fail(failure, pytrace=False)

    import sys as _sys
    setattr(_sys.modules[fn.__module__], "_isolated_" + fn.__name__, fn)
    return wrapper


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
