"""`rd2h bench engine --peers` and `rd2h bench layers --peers`: rd2h, NIXL and Mooncake's
transfer engine measured in one run on the same blocks (each reader checks every byte it
reads, or the bench fails), one Markdown table, rd2h's ratio to the faster peer as a script
reads it; and a peer that is not installed reported as such and skipped.

Run by `scripts/test peers`: RD2H_BINARY is the rd2h binary, RD2H_PEERS_PYTHON the
interpreter of scripts/bench-venv."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

BINARY = os.environ.get("RD2H_BINARY", "")
PEERS_PYTHON = os.environ.get("RD2H_PEERS_PYTHON", "")

pytestmark = pytest.mark.skipif(not BINARY or not PEERS_PYTHON,
                                reason="RD2H_BINARY and RD2H_PEERS_PYTHON are set by scripts/test")

ROW = re.compile(r"^\| (shm|tcp) \| ([^|]+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \|$")


def bench(args: list[str], python: str = PEERS_PYTHON) -> str:
    env = dict(os.environ, RD2H_PEERS_PYTHON=python)
    done = subprocess.run([BINARY, "bench", *args], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def rows(out: str) -> dict:
    """The Markdown table: (transport, block, engine) -> its cells."""
    table = {}
    for line in out.splitlines():
        m = ROW.match(line)
        if m and m.group(3) != "engine":
            table[(m.group(1), m.group(2).strip(), m.group(3).split(" ")[0])] = [
                c.strip() for c in m.groups()[3:]]
    return table


ENGINE_ARGS = ["engine", "--peers", "nixl,mooncake", "--transports", "shm,tcp", "--block-bytes",
               "131072", "--batch-bytes", "4194304", "--min-seconds", "0.3", "--no-perftest"]


def test_rd2h_nixl_and_mooncake_are_measured_on_the_same_blocks_in_one_table():
    table = rows(bench(ENGINE_ARGS))
    for transport in ("shm", "tcp"):
        rd2h = table[(transport, "128 KiB", "rd2h")]
        nixl = table[(transport, "128 KiB", "NIXL")]
        memcpy = table[(transport, "128 KiB", "memcpy")]
        for cells in (rd2h, nixl, memcpy):
            assert float(cells[0]) > 0, cells  # GB/s
            assert cells[1].endswith(" ms") and cells[2].endswith(" ms"), cells  # p50, p99
        peers = [nixl[0]]
        if transport == "tcp":
            mooncake = table[(transport, "128 KiB", "Mooncake")]
            assert float(mooncake[0]) > 0, mooncake
            peers.append(mooncake[0])
        else:
            assert "offers no shm transport" in table[(transport, "128 KiB", "Mooncake")][4]
        # The ratio a script reads: rd2h's GB/s over the faster peer's, at this transport.
        m = re.fullmatch(r"(\d+\.\d\d)x the faster peer", rd2h[4])
        assert m, rd2h
        fastest = max(peers, key=float)
        assert consistent_ratio(m.group(1), rd2h[0], fastest), (rd2h, peers)
        assert consistent_ratio(rd2h[3][:-1], rd2h[0], memcpy[0]), (rd2h, memcpy)


def consistent_ratio(ratio: str, a: str, b: str) -> bool:
    """Whether a printed ratio is a / b for some values the printed, rounded a and b stand
    for (the bench divides before it rounds)."""
    def half_unit(text: str) -> float:
        return 0.5 * 10 ** -len(text.partition(".")[2])
    lo = (float(a) - half_unit(a)) / (float(b) + half_unit(b))
    hi = (float(a) + half_unit(a)) / (float(b) - half_unit(b))
    return lo - half_unit(ratio) <= float(ratio) <= hi + half_unit(ratio)


def test_a_peer_that_is_not_installed_is_reported_and_skipped():
    # The system Python has neither NIXL nor Mooncake.
    out = bench(ENGINE_ARGS[:4] + ["shm"] + ENGINE_ARGS[5:], python="/usr/bin/python3")
    table = rows(out)
    assert float(table[("shm", "128 KiB", "rd2h")][0]) > 0
    assert table[("shm", "128 KiB", "rd2h")][4] == "-"
    for peer in ("NIXL", "Mooncake"):
        assert "not installed" in table[("shm", "128 KiB", peer)][4], table


def test_layer_ready_to_acknowledged_is_measured_beside_nixls_notifications():
    out = bench(["layers", "--peers", "nixl", "--requests", "32", "--layers", "20",
                 "--warmup", "5"])
    nixl = re.search(r"NIXL [\d.]+ \(notifications\)\s+p50\s+([\d.]+)\s+p99\s+([\d.]+)", out)
    assert nixl, out
    for control in ("ZeroMQ", "the link"):
        m = re.search(rf"rd2h, 32 requests, control on {control}\s+p50\s+([\d.]+)\s+p99\s+"
                      rf"([\d.]+)\s+= ([\d.]+)x / ([\d.]+)x", out)
        assert m, out
        assert consistent_ratio(m.group(3), m.group(1), nixl.group(1)), (
            m.group(0), nixl.group(0))
