"""Shared pieces of the Python tests: free ports, mini engines as processes, a recording
metaserver, HTTP calls with deadlines."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from typing import Optional

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from harness import Metaserver, free_ports, kv_config, start_decode_rank  # noqa: E402,F401

START_DEADLINE_S = 120.0


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
