"""Real vLLM engines for the PD suite: the tiny model, `vllm serve` processes and `rd2h proxy`.

Every engine is vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`,
what `vllm serve` runs) on the CPU, started in a session of its own so that stopping or
killing it takes its engine core and workers too. A process counts as started once it
printed its ready line; every wait has a deadline.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Optional

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import make_model  # noqa: E402

START_DEADLINE_S = 600.0  # a vLLM engine on 2 busy cores takes about a minute
BLOCK_SIZE = 32
TOKEN_BUDGET = 256  # --max-num-batched-tokens: a longer prompt is prefilled in chunks
MODEL_NAME = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A command in a session of its own; its output goes to a log file and is watched
    for a ready line."""

    def __init__(self, name: str, cmd: list, log: Path, ready: str, env: Optional[dict] = None):
        self.name, self.log = name, log
        self._out = open(log, "w")
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **(env or {})}, start_new_session=True)
        self._ready: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._pump, args=(ready,), daemon=True)
        self._thread.start()
        try:
            line = self._ready.get(timeout=START_DEADLINE_S)
        except queue.Empty:
            line = None
        if line is None:
            self.kill()
            raise RuntimeError(f"{name} did not start within {START_DEADLINE_S:.0f} s; "
                               f"its log ends:\n{self.tail()}")
        self.ready_line = line

    def _pump(self, ready: str) -> None:
        told = False
        for line in self.proc.stdout:
            self._out.write(line)
            self._out.flush()
            if not told and ready in line:
                told = True
                self._ready.put(line)
        if not told:
            self._ready.put(None)  # exited before it was ready

    def tail(self, n: int = 40) -> str:
        return "".join(self.log.read_text(errors="replace").splitlines(True)[-n:])

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL to the whole session: a host that died."""
        self._signal(signal.SIGKILL)
        self.proc.wait(timeout=60)
        self._thread.join(timeout=60)

    def stop(self) -> Optional[int]:
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(timeout=60)
        self._signal(signal.SIGKILL)  # what the server left of its session
        self._thread.join(timeout=60)
        self._out.close()
        return self.proc.returncode


EXAMPLES = HERE.parents[1] / "examples" / "vllm"


# This 2-vCPU virtual machine freezes now and then for seconds (a shell loop sleeping 100 ms
# missed up to 1.8 s at a time, 3.6 s in all, while a Decode engine had just started): a
# Decode's first connection to a Prefill then outlives the 5 s connect deadline. The suite's
# engines allow 20 s to connect, and Prefill waits 30 s for the MF_META ACK that follows it.
FREEZE_TOLERANT = {"kv_producer": {"ack_timeout_ms": 30000},
                   "kv_consumer": {"connect_timeout_ms": 20000}}


def kv_transfer_config(role: str, kv_port: int, **extra) -> dict:
    """examples/vllm/local-{prefill,decode}.json as written, on a port of this run's, with
    the deadlines of FREEZE_TOLERANT."""
    name = "local-prefill.json" if role == "kv_producer" else "local-decode.json"
    ktc = json.loads((EXAMPLES / name).read_text())
    assert ktc["kv_role"] == role, f"{name} is not a {role}"
    ktc["kv_port"] = kv_port
    ktc["kv_connector_extra_config"].update(FREEZE_TOLERANT[role])
    ktc["kv_connector_extra_config"].update(extra)
    return ktc


class Engine(Process):
    """`vllm serve` of the tiny model, with a kv_transfer_config or without."""

    def __init__(self, name: str, model: Path, logs: Path, ktc: Optional[dict] = None,
                 cpus: Optional[str] = None, env: Optional[dict] = None,
                 args: Optional[list] = None):
        """`cpus`: the CPUs the engine's processes may run on (taskset's list), else all;
        `env`: more environment for it; `args`: more arguments of `vllm serve`."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model), "--served-model-name", MODEL_NAME,
               "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager",
               "--block-size", str(BLOCK_SIZE), "--max-num-batched-tokens", str(TOKEN_BUDGET),
               "--max-num-seqs", "64", "--seed", "0", *(args or [])]
        if ktc is not None:
            cmd += ["--kv-transfer-config", json.dumps(ktc)]
        if cpus is not None:
            cmd = ["taskset", "--cpu-list", cpus] + cmd
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", **(env or {})}
        super().__init__(name, cmd, logs / f"{name}.log", "Application startup complete", env)

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return r.read().decode()


class Proxy(Process):
    def __init__(self, name: str, logs: Path, prefill: list, decode: list):
        binary = os.environ.get("RD2H_BINARY")
        if not binary:
            pytest.fail("RD2H_BINARY must name the rd2h binary (scripts/test vllm sets it)")
        cmd = [binary, "proxy", "--host", "127.0.0.1", "--port", "0", "--metaserver-port", "0"]
        for e in prefill:
            cmd += ["--prefill", e.url]
        for e in decode:
            cmd += ["--decode", e.url]
        super().__init__(name, cmd, logs / f"{name}.log", "serving ")
        self.url = self.ready_line.split("serving ")[1].split()[0]


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus counter's samples whose labels include `labels`, read from a
    /metrics text with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = [s for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and labels.items() <= s.labels.items()]
    if not samples:
        raise AssertionError(f"/metrics has no {name} with {labels}")
    return sum(s.value for s in samples)


LOG_DIRS: list = []  # where this session's engines and proxies log
ERROR_LINE = re.compile(r"ERROR|Error|\[(warning|error|critical)\]|UCX")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """After a failure: the engines' and proxies' error lines, so that CI's output says what
    an engine raised (the whole logs stay in the log directory)."""
    if exitstatus == 0:
        return
    for d in LOG_DIRS:
        for log in sorted(Path(d).glob("*.log")):
            lines = [l for l in log.read_text(errors="replace").splitlines()
                     if ERROR_LINE.search(l)]
            if lines:
                terminalreporter.write_line(f"---- {log} (errors, last 30)")
                for l in lines[-30:]:
                    terminalreporter.write_line(l[:400])


@pytest.fixture(scope="session")
def logs(tmp_path_factory) -> Path:
    d = Path(os.environ.get("RD2H_VLLM_LOGS") or tmp_path_factory.mktemp("logs"))
    d.mkdir(parents=True, exist_ok=True)
    LOG_DIRS.append(d)
    return d


MODEL_SEED = 20261203


def prompt(rng, n: int) -> str:
    """A prompt of `n` tokens drawn by `rng` (one token per character)."""
    return "".join(rng.choice(make_model.ALPHABET) for _ in range(n))


def made_model(out: Path, arch: str = "llama") -> Path:
    """The suite's tiny model of `arch`, with its tokenizer, made in `out`."""
    make_model.make_tokenizer(out)
    make_model.make_model(out, seed=MODEL_SEED, arch=arch)
    return out


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> Path:
    return made_model(tmp_path_factory.mktemp("model"))


def running(process):
    """A fixture's body: the started process, stopped when the fixture ends."""
    yield process
    process.stop()


@pytest.fixture(scope="session")
def single(model, logs):
    yield from running(Engine("single", model, logs))


@pytest.fixture(scope="session")
def prefill(model, logs):
    yield from running(
        Engine("prefill", model, logs, kv_transfer_config("kv_producer", free_port())))


@pytest.fixture(scope="session")
def decode(model, logs):
    yield from running(
        Engine("decode", model, logs, kv_transfer_config("kv_consumer", free_port())))


@pytest.fixture(scope="session")
def proxy(prefill, decode, logs):
    yield from running(Proxy("proxy", logs, [prefill], [decode]))


def wait_until(predicate, deadline_s: float, what: str):
    """Polls a condition that has no event to wait on (a metric served over HTTP)."""
    end = time.monotonic() + deadline_s
    delay = 0.05
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {deadline_s} s")
        time.sleep(delay)
        delay = min(delay * 2, 1.0)
