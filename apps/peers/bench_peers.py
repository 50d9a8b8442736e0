"""The peer engines of `rd2h bench engine --peers` (and `rd2h bench layers --peers`), each
driven through its own public Python API as its users drive it, in the roles rd2h's bench
gives its own engine: a source process registers a pool filled with a pattern, and a reader
(this process) pulls batches of random blocks into its own registered memory and checks
every byte of every batch, outside the timed part.

    python bench_peers.py engine --peer nixl|mooncake --transport shm|tcp \
        --blocks 16384,131072 --batch-bytes 67108864 --seconds 2 --min-batches 5
    python bench_peers.py layer --peer nixl --requests 32 --blocks-per-layer 64 \
        --tensor-bytes 131072,16384,16384 --layers 61 --iterations 200

Prints one JSON object per line: per block size {"block", "engine", "gbs", "p50_s", "p99_s",
"batches", "settings"} (or {"block", "error"}); or {"skip": why} when the peer is not
installed or does not offer the transport. The same for every engine: the pool is twice a
batch; four random batches are chosen before anything is timed and read in turn (so no
engine builds or allocates anything per read); one warm-up read each; five rounds of
`seconds / 5` (median GB/s of the rounds, p50/p99 over every batch).
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import sys
import time
import traceback

ROUNDS = 5
WAIT_S = 30  # the longest any wait of the harness waits
SEED = 0x9E3779B97F4A7C15
PATTERN_MUL = 0xD6E8FEB86659FD93


def out(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


# ---------------------------------------------------------------------------------------
# Memory and the pattern


class Pool:
    """Page-aligned anonymous memory (as a KV pool is), as a numpy byte array."""

    def __init__(self, nbytes: int):
        import numpy as np

        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.array[::4096] = 0  # fault every page in
        self.address = self.array.ctypes.data
        self.size = nbytes


def fill_pattern(array) -> None:
    """Every 8-byte word of the pool gets a value of its own place: a block read from the
    wrong place, or not at all, does not match."""
    import numpy as np

    words = array.view(np.uint64)
    words[:] = np.arange(words.size, dtype=np.uint64)
    words *= np.uint64(PATTERN_MUL)
    words ^= np.uint64(SEED)


def choose_batches(pool_blocks: int, per_batch: int, block: int) -> list:
    import numpy as np

    rng = np.random.default_rng(block)
    return [rng.choice(pool_blocks, size=per_batch, replace=False) for _ in range(4)]


def quantile(values: list, p: float) -> float:
    """Nearest rank, as rd2h's bench computes it."""
    ordered = sorted(values)
    rank = max(1, -(-int(p * len(ordered) * 1000) // 1000))
    return ordered[min(len(ordered), rank) - 1]


def measure(read, check, batches: int, per_batch_bytes: int, seconds: float, min_batches: int):
    """Rounds of timed reads (`read(i)` returns its seconds; `check(i)` verifies, untimed)."""
    read(0)
    check(0)
    round_gbs, times = [], []
    per_round = max(1, min_batches // ROUNDS)
    n = 0
    for _ in range(ROUNDS):
        timed, count = 0.0, 0
        while count < per_round or timed < seconds / ROUNDS:
            t = read(n % batches)
            check(n % batches)
            times.append(t)
            timed += t
            count += 1
            n += 1
        round_gbs.append(per_batch_bytes * count / timed / 1e9)
    return sorted(round_gbs)[len(round_gbs) // 2], times


# ---------------------------------------------------------------------------------------
# NIXL


NIXL_TLS = {
    # CMA (process_vm_readv) reads the source's memory without it taking part, SysV shared
    # memory carries the small messages: NIXL's fastest shared-memory setting on this host
    # (posix,cma measured the same; UCX's default choice, with its progress thread, about
    # half as fast).
    "shm": "sysv,cma",
    "tcp": "tcp",
}


# NIXL's progress thread, where one runs, sleeps this long between its polls: the Python
# API's agent config fixes 0 (a spinning thread), which on a host with few cores takes the
# core the other process needs (TCP reads at 0.3 GB/s instead of 1-3 here).
NIXL_PROGRESS_DELAY_US = 100


def nixl_env(transport: str) -> None:
    os.environ["UCX_TLS"] = NIXL_TLS[transport]
    # The wheel's UCX would load its InfiniBand module, whose bundled libnl crashes at exit
    # on a host without InfiniBand.
    os.environ.setdefault("UCX_MODULES", "^ib")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if transport == "tcp":
        # Loopback only, and UCX's TCP segments as large as rd2h's engine sets them.
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        os.environ.setdefault("UCX_TCP_TX_SEG_SIZE", "1m")
        os.environ.setdefault("UCX_TCP_RX_SEG_SIZE", "1m")


def nixl_agent(name: str, transport: str, progress_thread: bool = False):
    import nixl

    bindings = nixl._bindings
    base = getattr(bindings, "_rd2h_base_config", bindings.nixlAgentConfig)
    bindings._rd2h_base_config = base

    class Config(base):
        def __setattr__(self, key, value):
            super().__setattr__(key, NIXL_PROGRESS_DELAY_US if key == "pthrDelay" else value)

    bindings.nixlAgentConfig = Config
    config = nixl.nixl_agent_config(enable_prog_thread=progress_thread, backends=[])
    agent = nixl.nixl_agent(name, config)
    params = {}
    if transport != "tcp":
        # Peer-failure detection needs a transport that can detect it; shm cannot.
        params["ucx_error_handling_mode"] = "none"
    agent.create_backend("UCX", params)
    return agent


def nixl_settings(transport: str) -> str:
    if transport == "tcp":
        return (f"UCX backend, UCX_TLS=tcp on lo, UCX_TCP_TX/RX_SEG_SIZE=1m, the source's "
                f"progress thread polling every {NIXL_PROGRESS_DELAY_US} us (a get over TCP "
                f"is served by the source), prepped descriptor lists, one READ handle per "
                f"batch made once and reposted")
    return (f"UCX backend, UCX_TLS={NIXL_TLS[transport]} (CMA reads need nothing of the "
            f"source), no progress thread, prepped descriptor lists, one READ handle per "
            f"batch made once and reposted")


def nixl_source(conn, transport: str, pool_bytes: int) -> None:
    nixl_env(transport)
    agent = nixl_agent("source", transport, progress_thread=transport == "tcp")
    pool = Pool(pool_bytes)
    fill_pattern(pool.array)
    registered = agent.register_memory([(pool.address, pool.size, 0, "pool")], "DRAM")
    conn.send((agent.get_agent_metadata(), pool.address))
    peer = None
    while True:
        msg = conn.recv()
        if msg[0] == "reader":
            peer = agent.add_remote_agent(msg[1])
            conn.send(("ok",))
        elif msg[0] == "layers":  # answer readiness notifications (layer mode)
            serve_layers_nixl(agent, conn, msg[1])
        elif msg[0] == "quit":
            break
    agent.deregister_memory(registered)
    if peer is not None:
        agent.remove_remote_agent(peer.decode() if isinstance(peer, bytes) else peer)
    conn.send(("bye",))


def nixl_engine(conn, transport: str, blocks: list, batch_bytes: int, seconds: float,
                min_batches: int) -> None:
    import numpy as np

    nixl_env(transport)
    agent = nixl_agent("reader", transport)
    metadata, remote_base = conn.recv()
    peer = agent.add_remote_agent(metadata)
    peer = peer.decode() if isinstance(peer, bytes) else peer
    conn.send(("reader", agent.get_agent_metadata()))
    conn.recv()
    pool_bytes = 2 * batch_bytes
    shadow = Pool(pool_bytes)
    fill_pattern(shadow.array)
    dest = Pool(batch_bytes)
    registered = agent.register_memory([(dest.address, dest.size, 0, "dest")], "DRAM")
    version = nixl_version()
    for block in blocks:
        try:
            per_batch, pool_blocks = batch_bytes // block, pool_bytes // block
            remote = np.empty((pool_blocks, 3), dtype=np.uint64)
            remote[:, 0] = remote_base + np.arange(pool_blocks, dtype=np.uint64) * np.uint64(block)
            remote[:, 1] = block
            remote[:, 2] = 0
            local = np.empty((per_batch, 3), dtype=np.uint64)
            local[:, 0] = dest.address + np.arange(per_batch, dtype=np.uint64) * np.uint64(block)
            local[:, 1] = block
            local[:, 2] = 0
            remote_list = agent.prep_xfer_dlist(peer, remote, "DRAM")
            local_list = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
            chosen = choose_batches(pool_blocks, per_batch, block)
            everything = np.arange(per_batch, dtype=np.int32)
            handles = [agent.make_prepped_xfer("READ", local_list, everything, remote_list,
                                               c.astype(np.int32)) for c in chosen]
            dest2d = dest.array[:per_batch * block].reshape(per_batch, block)
            shadow2d = shadow.array.reshape(pool_blocks, block)

            def read(i: int) -> float:
                dest.array[::4096] = 0xAA  # a block not written fails the check
                start = time.perf_counter()
                state = agent.transfer(handles[i])
                while state == "PROC":
                    state = agent.check_xfer_state(handles[i])
                    if time.perf_counter() - start > WAIT_S:
                        raise TimeoutError(f"a READ did not finish within {WAIT_S} s")
                took = time.perf_counter() - start
                if state != "DONE":
                    raise RuntimeError(f"NIXL transfer ended {state}")
                return took

            def check(i: int) -> None:
                if not np.array_equal(dest2d, shadow2d[chosen[i]]):
                    raise RuntimeError("a block arrived corrupted")

            gbs, times = measure(read, check, len(handles), per_batch * block, seconds,
                                 min_batches)
            for h in handles:
                agent.release_xfer_handle(h)
            agent.release_dlist_handle(remote_list)
            agent.release_dlist_handle(local_list)
            out({"block": block, "engine": f"NIXL {version}", "gbs": gbs,
                 "p50_s": quantile(times, 0.5), "p99_s": quantile(times, 0.99),
                 "batches": len(times), "settings": nixl_settings(transport)})
        except Exception as e:  # noqa: BLE001  (reported in its row; the next size goes on)
            out({"block": block, "error": f"{type(e).__name__}: {e}"})
    agent.deregister_memory(registered)
    agent.remove_remote_agent(peer)


def nixl_version() -> str:
    from importlib.metadata import version

    return version("nixl")


# ---------------------------------------------------------------------------------------
# Mooncake's transfer engine


# TCP is the only protocol of the build without CUDA that works between two processes of
# one host without RDMA devices.
MOONCAKE_PROTOCOLS = {"tcp": "tcp"}


def mooncake_env() -> None:
    os.environ.setdefault("GLOG_minloglevel", "2")
    # Its TCP transport refuses a batch of more slices per peer than this (default 256); a
    # batch of 64 MiB of 16 KiB blocks is 4096.
    os.environ.setdefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "16384")


def mooncake_engine_start(transport: str):
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    # No metadata server: each engine serves its segment over its own RPC port.
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", MOONCAKE_PROTOCOLS[transport], "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize returned {rc}")
    return engine, f"127.0.0.1:{engine.get_rpc_port()}"


def mooncake_source(conn, transport: str, pool_bytes: int) -> None:
    mooncake_env()
    engine, session = mooncake_engine_start(transport)
    pool = Pool(pool_bytes)
    fill_pattern(pool.array)
    if engine.register_memory(pool.address, pool.size) != 0:
        raise RuntimeError("register_memory failed")
    conn.send((session, pool.address))
    while conn.recv()[0] != "quit":
        pass
    engine.unregister_memory(pool.address)
    conn.send(("bye",))


def mooncake_engine(conn, transport: str, blocks: list, batch_bytes: int, seconds: float,
                    min_batches: int) -> None:
    import numpy as np

    mooncake_env()
    engine, _ = mooncake_engine_start(transport)
    session, remote_base = conn.recv()
    pool_bytes = 2 * batch_bytes
    shadow = Pool(pool_bytes)
    fill_pattern(shadow.array)
    dest = Pool(batch_bytes)
    if engine.register_memory(dest.address, dest.size) != 0:
        raise RuntimeError("register_memory failed")
    from importlib.metadata import version

    name = f"Mooncake {version('mooncake-transfer-engine-non-cuda')}"
    for block in blocks:
        try:
            per_batch, pool_blocks = batch_bytes // block, pool_bytes // block
            chosen = choose_batches(pool_blocks, per_batch, block)
            local = [dest.address + i * block for i in range(per_batch)]
            lengths = [block] * per_batch
            remote = [[remote_base + int(b) * block for b in c] for c in chosen]
            dest2d = dest.array[:per_batch * block].reshape(per_batch, block)
            shadow2d = shadow.array.reshape(pool_blocks, block)

            def read(i: int) -> float:
                dest.array[::4096] = 0xAA
                start = time.perf_counter()
                rc = engine.batch_transfer_sync_read(session, local, remote[i], lengths)
                took = time.perf_counter() - start
                if rc != 0:
                    raise RuntimeError(f"batch_transfer_sync_read returned {rc}")
                return took

            def check(i: int) -> None:
                if not np.array_equal(dest2d, shadow2d[chosen[i]]):
                    raise RuntimeError("a block arrived corrupted")

            gbs, times = measure(read, check, len(chosen), per_batch * block, seconds, min_batches)
            out({"block": block, "engine": name, "gbs": gbs, "p50_s": quantile(times, 0.5),
                 "p99_s": quantile(times, 0.99), "batches": len(times),
                 "settings": "tcp protocol, P2PHANDSHAKE (no metadata server), "
                             "batch_transfer_sync_read of the batch's blocks, "
                             "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER=16384"})
        except Exception as e:  # noqa: BLE001
            out({"block": block, "error": f"{type(e).__name__}: {e}"})
    engine.unregister_memory(dest.address)


# ---------------------------------------------------------------------------------------
# Layer-ready to read and acknowledged, over NIXL's notifications


def serve_layers_nixl(agent, conn, count: int) -> None:
    """The Prefill side: for each layer, says it is ready (a notification) and waits for the
    reader's notification that it was read; sends the round trips back (the reader leaves
    out its warm-up)."""
    conn.send(("ready",))
    reader = conn.recv()[1]
    times = []
    for i in range(count):
        start = time.perf_counter()
        agent.send_notif(reader, b"ready %d" % i)
        want = b"read %d" % i
        deadline = start + WAIT_S
        while True:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"layer {i} was not acknowledged within {WAIT_S} s")
            got = agent.get_new_notifs().get(reader, [])
            if got:
                if got != [want]:
                    raise RuntimeError(f"unexpected notifications {got}")
                break
        times.append(time.perf_counter() - start)
    conn.send(("times", times))


def nixl_layer(conn, args) -> None:
    """The Decode side: on each readiness, reads the layer's blocks of every request (one
    READ of all of them, prepped once) and acknowledges with the READ's own notification."""
    import numpy as np

    nixl_env("shm")
    agent = nixl_agent("reader", "shm")
    metadata, remote_base = conn.recv()
    peer = agent.add_remote_agent(metadata)
    peer = peer.decode() if isinstance(peer, bytes) else peer
    conn.send(("reader", agent.get_agent_metadata()))
    conn.recv()
    tensor_bytes = args.tensor_bytes
    per_block = sum(tensor_bytes)
    layer_blocks = args.blocks_per_layer
    dest = Pool(layer_blocks * per_block)
    registered = agent.register_memory([(dest.address, dest.size, 0, "dest")], "DRAM")
    # The source pool holds `layers` layers; each layer's blocks of each tensor contiguous.
    layer_bytes = layer_blocks * per_block
    rows = []
    for t, size in enumerate(tensor_bytes):
        offset = sum(tensor_bytes[:t]) * layer_blocks
        for b in range(layer_blocks):
            rows.append((offset + b * size, size))
    local = np.array([(dest.address + off, size, 0) for off, size in rows], dtype=np.uint64)
    local_list = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
    remote_rows = []
    for layer in range(args.layers):
        base = remote_base + layer * layer_bytes
        remote_rows.extend((base + off, size, 0) for off, size in rows)
    remote_list = agent.prep_xfer_dlist(peer, np.array(remote_rows, dtype=np.uint64), "DRAM")
    everything = np.arange(len(rows), dtype=np.int32)
    # Each layer's rows in the remote list.
    layer_rows = [np.arange(layer * len(rows), (layer + 1) * len(rows), dtype=np.int32)
                  for layer in range(args.layers)]
    # One pass over every layer first, as rd2h's bench warms up: nothing measured is the
    # first touch of its memory.
    warmup = args.layers
    conn.send(("layers", warmup + args.iterations))
    conn.recv()  # ready
    conn.send(("reader", "reader"))
    for i in range(warmup + args.iterations):
        deadline = time.perf_counter() + WAIT_S
        while not agent.get_new_notifs().get(peer, []):
            if time.perf_counter() > deadline:
                raise TimeoutError(f"no readiness of layer {i} within {WAIT_S} s")
        layer = i % args.layers
        handle = agent.make_prepped_xfer("READ", local_list, everything, remote_list,
                                         layer_rows[layer], b"read %d" % i)
        state = agent.transfer(handle)
        started = time.perf_counter()
        while state == "PROC":
            state = agent.check_xfer_state(handle)
            if time.perf_counter() - started > WAIT_S:
                raise TimeoutError(f"a READ did not finish within {WAIT_S} s")
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer ended {state}")
        agent.release_xfer_handle(handle)
    kind, times = conn.recv()
    times = times[warmup:]
    agent.release_dlist_handle(local_list)
    agent.release_dlist_handle(remote_list)
    agent.deregister_memory(registered)
    out({"engine": f"NIXL {nixl_version()}", "layer_bytes": layer_bytes,
         "p50_s": quantile(times, 0.5), "p99_s": quantile(times, 0.99), "layers": len(times),
         "settings": "UCX backend, UCX_TLS=sysv,cma, no progress thread, prepped descriptor "
                     "lists, one READ per layer of every tensor's blocks made from them with "
                     "make_prepped_xfer; readiness and the acknowledgement are NIXL "
                     "notifications (send_notif, and the READ's own notification), both "
                     "sides polling get_new_notifs"})


# ---------------------------------------------------------------------------------------


def installed(peer: str) -> str | None:
    """Why `peer` cannot be measured here, or None."""
    from importlib.util import find_spec

    module = {"nixl": "nixl", "mooncake": "mooncake.engine"}[peer]
    try:
        if find_spec(module) is None:
            raise ImportError
    except ImportError:
        return "not installed (scripts/bootstrap --bench installs it)"
    return None


def run(args) -> int:
    why = installed(args.peer)
    if why:
        out({"skip": why})
        return 0
    if args.peer == "mooncake" and args.transport not in MOONCAKE_PROTOCOLS:
        out({"skip": f"offers no {args.transport} transport in this build"})
        return 0
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    if args.mode == "layer":
        pool_bytes = args.layers * args.blocks_per_layer * sum(args.tensor_bytes)
        source = ctx.Process(target=nixl_source, args=(theirs, "shm", pool_bytes))
    else:
        target = nixl_source if args.peer == "nixl" else mooncake_source
        source = ctx.Process(target=target, args=(theirs, args.transport, 2 * args.batch_bytes))
    source.start()
    rc = 0
    try:
        if args.mode == "layer":
            nixl_layer(mine, args)
        elif args.peer == "nixl":
            nixl_engine(mine, args.transport, args.blocks, args.batch_bytes, args.seconds,
                        args.min_batches)
        else:
            mooncake_engine(mine, args.transport, args.blocks, args.batch_bytes, args.seconds,
                            args.min_batches)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        out({"error": f"{type(e).__name__}: {e}"})
        rc = 1
    finally:
        try:
            mine.send(("quit",))
            if mine.poll(30):
                mine.recv()
        except (OSError, EOFError):
            pass
        source.join(30)
        if source.is_alive():
            source.kill()
            source.join(10)
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["engine", "layer"])
    ap.add_argument("--peer", choices=["nixl", "mooncake"], required=True)
    ap.add_argument("--transport", choices=["shm", "tcp"], default="shm")
    ap.add_argument("--blocks", type=lambda s: [int(x) for x in s.split(",")],
                    default=[16 << 10, 128 << 10, 1 << 20, 4 << 20])
    ap.add_argument("--batch-bytes", type=int, default=64 << 20)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--min-batches", type=int, default=5)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--blocks-per-layer", type=int, default=64)
    ap.add_argument("--tensor-bytes", type=lambda s: [int(x) for x in s.split(",")],
                    default=[131072, 16384, 16384])
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--iterations", type=int, default=200)
    args = ap.parse_args()
    if args.mode == "layer" and args.peer != "nixl":
        out({"skip": "the layer figure compares with NIXL's notifications only"})
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
