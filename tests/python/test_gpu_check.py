"""scripts/gpu-check, as it runs on a machine without a GPU: it skips, naming why, and exits 0;
the same program runs through on the device double; and its bundle (rd2h's package, the
check's files, the libraries rd2h needs beyond glibc and libstdc++) stays under 64 MiB and
runs from its own directory, on its own copies of those libraries."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check"
SMALL = ["--requests", "2", "--layers", "3", "--blocks", "4", "--block-size", "16"]


def run(cmd: list, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "RD2H_PYTHON": sys.executable, **env})


def gpu_seen() -> bool:
    import torch

    return torch.version.cuda is not None and torch.cuda.is_available()


def test_without_a_gpu_the_check_says_why_it_skipped_and_exits_0():
    if gpu_seen():
        pytest.skip("this machine has a GPU: the check runs for real")
    r = run([SCRIPT])
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.fullmatch(r"gpu-check: skipped: .*(CUDA|GPU|torch).*\n", r.stdout), r.stdout


def test_the_check_runs_through_on_the_device_double():
    r = run([SCRIPT, "--device", "double", *SMALL])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "gpu-check: passed: " in r.stdout, r.stdout


def test_the_bundle_is_under_64_mib_and_runs_on_its_own_libraries(tmp_path):
    bundle = tmp_path / "gpu-check-bundle"
    r = run([SCRIPT, "--bundle", bundle])
    assert r.returncode == 0, r.stdout + r.stderr
    size = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file())
    assert size < 64 * 2**20, f"the bundle is {size} bytes"
    manifest = (bundle / "MANIFEST").read_text()
    assert re.search(r"glibc with GLIBC_2\.\d+, libstdc\+\+ with GLIBCXX_3\.4\.\d+", manifest)
    # Run from elsewhere, with nothing of the checkout on the path.
    r = run([bundle / "gpu-check", "--device", "double", *SMALL], PYTHONPATH="")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "gpu-check: passed: " in r.stdout, r.stdout
    loaded = dict(p.split(": ") for p in
                  re.search(r"gpu-check: loaded (.*)", r.stdout).group(1).split(", "))
    assert loaded["_native"] == str(bundle / "python" / "rd2h")
    for lib in ("libucp", "libucs", "libzmq", "libspdlog"):
        assert loaded.get(lib) == str(bundle / "lib"), f"{lib} was loaded from {loaded.get(lib)}"


def test_a_python_the_module_was_not_built_for_is_named():
    r = run([SCRIPT], RD2H_PYTHON="/bin/false")
    assert r.returncode == 2
    assert "built for CPython 3." in r.stderr and "RD2H_PYTHON" in r.stderr, r.stderr
