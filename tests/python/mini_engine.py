"""A small serving engine shaped like vLLM, to drive rd2h.vllm the way vLLM does.

An engine core (an OpenAI-style HTTP front (mini_engine_http.py), a scheduler with a block pool
and a prefix cache (mini_engine_blocks.py) and chunked prefill, following vLLM's scheduler,
section 3 of spec/vllm-connector-v1.md) and one worker process per TP rank
(mini_engine_rank.py). The core owns the scheduler-role connector; each rank owns a worker-role
connector and CPU tensors as KV caches, and runs every step in vLLM's order:
bind_connector_metadata, start_load_kv, per layer wait_for_layer_load / write / save_kv_layer,
wait_for_save, get_finished, get_block_ids_with_load_errors, clear_connector_metadata. The
SchedulerOutput (with the connector metadata) is pickled to the ranks, as vLLM does.

The "model" writes each position's KV as a function of its token, position, layer and tensor,
so Decode checks every byte it received (or recomputed) before a request's blocks are freed.

    python3 mini_engine.py --role decode --tp 1 --kv-transfer-config '{...}'

prints "ready <port>" once its ranks registered their caches.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import signal
import sys
import threading
import traceback
from http.server import ThreadingHTTPServer
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vllm_standin as V  # noqa: E402
from mini_engine_blocks import BlockPool  # noqa: E402
from mini_engine_http import EngineRequest, make_handler  # noqa: E402
from mini_engine_rank import kv_cache_config, model_of, rank_main, vllm_config  # noqa: E402

RANK_DEADLINE_S = 60.0


# ---- engine core ----------------------------------------------------------------------------

class Core:
    def __init__(self, args: argparse.Namespace):
        from rd2h.vllm import KVConnectorRole, Rd2hConnector

        self.args = args
        self.m = model_of(args)
        self.ktc = json.loads(args.kv_transfer_config)
        self.prefill = self.ktc["kv_role"] == "kv_producer"
        self.policy = self.ktc.get("kv_load_failure_policy", "fail")
        ctx = mp.get_context("spawn")
        self.ranks = []
        for rank in range(args.tp):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=rank_main, args=(child, args, rank), daemon=True)
            p.start()
            self.ranks.append((p, parent))
        for rank, (p, conn) in enumerate(self.ranks):
            kind, payload = self.recv(rank, conn)
            if kind != "ready":
                raise RuntimeError(payload)
        self.connector = Rd2hConnector(vllm_config(self.args, 0), KVConnectorRole.SCHEDULER,
                                       kv_cache_config(self.m))
        self.lock = threading.Condition()
        self.waiting: collections.deque[EngineRequest] = collections.deque()
        self.running: list[EngineRequest] = []
        self.requests: dict[str, EngineRequest] = {}
        self.pool = BlockPool(self.m.num_blocks, self.m.block_size)
        self.recv_counts: collections.Counter = collections.Counter()
        # Aborted while their KV loaded: vLLM keeps their blocks until the id is received.
        self.aborted_loading: dict[str, EngineRequest] = {}
        self.recved: set[str] = set()
        self.finished_ids: set[str] = set()
        self.stopped = False
        self.failure: Optional[str] = None
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def recv(self, rank: int, conn):
        if not conn.poll(RANK_DEADLINE_S):
            raise RuntimeError(f"TP rank {rank} did not answer within {RANK_DEADLINE_S} s")
        try:
            return conn.recv()
        except EOFError:
            raise RuntimeError(f"TP rank {rank} died") from None

    def call_ranks(self, kind: str, payload):
        for _, conn in self.ranks:
            conn.send((kind, payload))
        return [self.recv(rank, conn)[1] for rank, (_, conn) in enumerate(self.ranks)]

    # -- blocks --
    def free_blocks(self, r: EngineRequest, cache: bool) -> None:
        garbage = self.pool.release(r.request_id, r.prompt_token_ids, cache)
        if garbage and not self.prefill:
            self.call_ranks("poison", garbage)

    def kv_blocks(self, r: EngineRequest) -> V.KVCacheBlocks:
        return self.pool.kv_blocks(r.request_id)

    def verify(self, r: EngineRequest) -> None:
        """Every rank checks every byte of the prompt's KV that it holds."""
        results = self.call_ranks("verify", (r.prompt_token_ids, self.pool.blocks[r.request_id]))
        r.verified = {"bytes": sum(x[0] for x in results),
                      "mismatches": sum(x[1] for x in results),
                      "first": next((x[2] for x in results if x[2]), "")}

    # -- requests --
    def add(self, reqs: list[EngineRequest]) -> None:
        with self.lock:
            if self.failure:
                for r in reqs:
                    r.error = self.failure
                    r.done.set()
                return
            for r in reqs:
                self.requests[r.request_id] = r
                self.waiting.append(r)
            self.lock.notify()

    def abort(self, request_ids: list[str]) -> None:
        with self.lock:
            for req_id in request_ids:
                r = self.requests.get(req_id)
                if r is None:
                    continue
                if r.status == V.RequestStatus.WAITING_FOR_REMOTE_KVS:
                    r.status = V.RequestStatus.FINISHED_ABORTED
                    r.error = f"request {req_id} was aborted"
                    self.waiting.remove(r)
                    self.connector.request_finished_all_groups(
                        r, tuple([list(g) for g in self.kv_blocks(r).get_block_ids()]))
                    self.aborted_loading[req_id] = r
                    self.finished_ids.add(req_id)
                    del self.requests[req_id]
                    r.done.set()
                else:
                    self.finish(r, V.RequestStatus.FINISHED_ABORTED, f"request {req_id} was aborted")

    def stats(self) -> dict:
        with self.lock:
            return {"free_blocks": len(self.pool.free), "num_blocks": self.m.num_blocks,
                    "requests": len(self.requests), "aborted_loading": len(self.aborted_loading)}

    def finish(self, r: EngineRequest, status: V.RequestStatus, error: Optional[str] = None) -> None:
        r.status = status
        r.error = error
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        ok = error is None and not self.prefill
        if ok and r.verified is None:  # computed here: checked before its blocks are freed
            self.verify(r)
        delay, _params = self.connector.request_finished_all_groups(
            r, tuple([list(g) for g in self.kv_blocks(r).get_block_ids()]))
        assert delay is False
        self.free_blocks(r, cache=ok and r.verified["mismatches"] == 0)
        self.finished_ids.add(r.request_id)
        del self.requests[r.request_id]
        r.done.set()

    # -- the step --
    def chunk(self, r: EngineRequest, budget: int) -> int:
        """Tokens of `r` to compute this step. Layers that share a physical buffer keep only
        the current chunk's KV there, so with shared buffers a prompt chunk that is not the
        last ends on a block boundary (a block is never written by two chunks)."""
        n = min(budget, r.num_tokens - r.num_computed_tokens)
        if self.prefill and self.m.slots > 0 and r.num_computed_tokens + n < r.num_tokens:
            bs = self.m.block_size
            n = (r.num_computed_tokens + n) // bs * bs - r.num_computed_tokens
        return max(n, 0)

    def schedule(self) -> Optional[tuple[V.SchedulerOutput, list]]:
        cached = V.CachedRequestData()
        counts: dict[str, int] = {}
        budget = self.schedule_running(cached, counts, self.args.token_budget)
        new_reqs = self.schedule_waiting(counts, budget)
        finished = self.finished_ids
        self.finished_ids = set()
        so = V.SchedulerOutput(new_reqs, cached, counts, sum(counts.values()),
                               finished_req_ids=finished)
        so.kv_connector_metadata = self.connector.build_connector_meta(so)
        waiting_remote = any(r.status == V.RequestStatus.WAITING_FOR_REMOTE_KVS
                             for r in self.waiting)
        if not counts and not finished and not waiting_remote:
            return None
        return so, [self.requests[i] for i in counts]

    def schedule_running(self, cached: V.CachedRequestData, counts: dict[str, int],
                         budget: int) -> int:
        """The running requests' next chunks, with the blocks they need; the budget left."""
        for r in list(self.running):
            if budget <= 0:
                break
            n = self.chunk(r, budget)
            new = self.pool.allocate(r.request_id, r.num_computed_tokens + n) if n else None
            if new is None:
                continue
            cached.req_ids.append(r.request_id)
            cached.new_block_ids.append((new,) if new else None)
            cached.num_computed_tokens.append(r.num_computed_tokens)
            cached.new_token_ids.append([])
            cached.num_output_tokens.append(len(r.output_token_ids))
            counts[r.request_id] = n
            budget -= n
        return budget

    def schedule_waiting(self, counts: dict[str, int], budget: int) -> list[V.NewRequestData]:
        """Waiting requests that can start within the budget, moved to running."""
        new_reqs: list[V.NewRequestData] = []
        for r in list(self.waiting):
            if budget <= 0:
                break
            if r.status == V.RequestStatus.WAITING_FOR_REMOTE_KVS and not self.remote_kv_arrived(r):
                continue
            ext = 0
            if not r.seen:
                ext = self.first_look(r)
                if ext is None:
                    continue
            n = self.chunk(r, budget)
            if n == 0 or self.pool.allocate(r.request_id, r.num_computed_tokens + n) is None:
                continue
            self.connector.update_state_after_alloc(r, self.kv_blocks(r), ext)
            self.waiting.remove(r)
            self.running.append(r)
            r.status = V.RequestStatus.RUNNING
            new_reqs.append(V.NewRequestData(r.request_id, r.prompt_token_ids, r.sampling_params,
                                             self.kv_blocks(r).get_block_ids(),
                                             r.num_computed_tokens))
            counts[r.request_id] = n
            budget -= n
        return new_reqs

    def remote_kv_arrived(self, r: EngineRequest) -> bool:
        """Whether every rank received the KV `r` waits for; if so it waits to be computed from
        there (or from the first block that failed to load)."""
        if r.request_id not in self.recved:
            return False
        self.recved.discard(r.request_id)
        if r.recompute_from is not None:
            r.num_computed_tokens = r.recompute_from
        else:
            n = min(len(self.pool.blocks[r.request_id]) * self.m.block_size, r.num_tokens)
            r.num_computed_tokens = n - 1 if n == r.num_tokens else n
        r.status = V.RequestStatus.WAITING
        return True

    def first_look(self, r: EngineRequest) -> Optional[int]:
        """A new request's tokens found locally and by the connector. The external tokens if
        it is to be computed now; None if it waits: for blocks, or for its KV to load."""
        r.seen = True
        hit_blocks = self.pool.prefix_hits(r.prompt_token_ids) if self.args.prefix_cache else []
        local = len(hit_blocks) * self.m.block_size
        r.cached_tokens = local
        ext, load_async = self.connector.get_num_new_matched_tokens(r, local)
        need = -(-(local + (ext or 0)) // self.m.block_size) - len(hit_blocks)
        if ext is None or (load_async and need > len(self.pool.free)):
            r.seen = False  # ask again later, like vLLM when blocks run out
            return None
        r.num_external_computed_tokens = ext
        self.pool.take_hits(r.request_id, hit_blocks)
        if load_async:
            self.pool.allocate(r.request_id, local + ext)
            self.connector.update_state_after_alloc(r, self.kv_blocks(r), ext)
            r.num_computed_tokens = local
            r.status = V.RequestStatus.WAITING_FOR_REMOTE_KVS
            return None
        r.num_computed_tokens = local + ext
        return ext

    def update_from_output(self, so: V.SchedulerOutput, scheduled: list, outputs: list) -> None:
        errors = [e for _, e in outputs if e]
        invalid = set().union(*(o.invalid_block_ids for o, _ in outputs))
        if invalid:
            for r in list(self.waiting) + list(self.running):
                blocks = self.pool.blocks.get(r.request_id, [])
                bad = [i for i, b in enumerate(blocks) if b in invalid]
                if not bad:
                    continue
                if self.policy == "recompute":
                    r.recompute_from = bad[0] * self.m.block_size
                else:
                    r.load_failed = True
        for r in scheduled:
            if errors:
                self.finish(r, V.RequestStatus.FINISHED_ERROR, errors[0])
                continue
            r.num_computed_tokens += so.num_scheduled_tokens[r.request_id]
            if r.num_computed_tokens >= r.num_tokens:
                r.output_token_ids.append(0)
                if len(r.output_token_ids) >= r.sampling_params.max_tokens:
                    self.finish(r, V.RequestStatus.FINISHED_LENGTH_CAPPED)
        self.connector.update_connector_output(V.KVConnectorOutput())
        for o, _ in outputs:
            for req_id in o.finished_recving or ():
                self.recv_counts[req_id] += 1
            assert not o.finished_sending, "rd2h's Prefill holds no blocks past a request"
        for req_id, n in list(self.recv_counts.items()):
            if n < len(self.ranks):
                continue
            del self.recv_counts[req_id]
            if req_id in self.aborted_loading:  # its blocks are free to go now
                self.free_blocks(self.aborted_loading.pop(req_id), cache=False)
                continue
            r = self.requests.get(req_id)
            assert r is not None and r.status == V.RequestStatus.WAITING_FOR_REMOTE_KVS, req_id
            if r.load_failed:
                self.finish(r, V.RequestStatus.FINISHED_ERROR,
                            f"request {req_id}: its KV failed to load (kv_load_failure_policy=fail)")
            else:
                if r.recompute_from is None:
                    self.verify(r)  # what was loaded, before any forward pass touches it
                self.recved.add(req_id)

    def loop(self) -> None:
        try:
            while True:
                with self.lock:
                    if self.stopped:
                        return
                    step = self.schedule()
                    if step is None:
                        self.lock.wait(0.002)
                        continue
                    so, scheduled = step
                outputs = self.call_ranks("step", so)
                with self.lock:
                    self.update_from_output(so, scheduled, outputs)
                    if not so.total_num_scheduled_tokens:
                        self.lock.wait(0.001)
        except Exception as e:
            traceback.print_exc()
            with self.lock:
                self.failure = f"engine core failed: {type(e).__name__}: {e}"
                for r in list(self.requests.values()):
                    r.error = self.failure
                    r.done.set()

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            self.lock.notify()
        self.thread.join(timeout=10)
        for _, conn in self.ranks:
            try:
                conn.send(("stop", None))
            except OSError:
                pass
        for p, _ in self.ranks:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self.connector.shutdown()


# ---- command line and main ------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--kv-transfer-config", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--main-bytes", type=int, default=64)
    p.add_argument("--indexer-bytes", type=int, default=16)
    p.add_argument("--decode-indexer-bytes", type=int, default=0,
                   help="Decode's indexer bytes per token when they differ (a wrong layout)")
    p.add_argument("--slots", type=int, default=0)
    p.add_argument("--token-budget", type=int, default=64)
    p.add_argument("--prefix-cache", action="store_true")
    p.add_argument("--request-timeout", type=float, default=60.0)
    return p.parse_args(argv)


def main() -> int:
    args = parse_args()
    core = Core(args)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(core, args.request_timeout))
    server.daemon_threads = True
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"ready {server.server_address[1]}", flush=True)
    while not stop.wait(0.5):
        if core.failure:
            print(core.failure, file=sys.stderr, flush=True)
    server.shutdown()
    core.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
