"""The mini engine's requests and its OpenAI-style HTTP front: POST /v1/completions (a prompt
or a list of them, each an EngineRequest the core schedules, answered once every one is done)
and POST /abort; GET /health and /stats. The core is handed in by make_handler; the front only
adds, aborts and reads."""

from __future__ import annotations

import json
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Optional

import vllm_standin as V

if TYPE_CHECKING:
    from mini_engine import Core


class EngineRequest(V.Request):
    def __init__(self, request_id, tokens, sampling):
        super().__init__(request_id, tokens, sampling)
        self.done = threading.Event()
        self.error: Optional[str] = None
        self.verified: Optional[dict] = None
        self.seen = False  # went through the new-request path once
        self.load_failed = False
        self.recompute_from: Optional[int] = None
        self.cached_tokens = 0  # prompt tokens found in the local prefix cache


def tokens_of(prompt) -> list[int]:
    if isinstance(prompt, str):
        return list(prompt.encode())
    return [int(t) for t in prompt]


def completion_requests(body: dict, parent: str) -> list[EngineRequest]:
    """One engine request per prompt of a completion's body (a list of prompts is a batch)."""
    prompt = body.get("prompt", "")
    prompts = prompt if (isinstance(prompt, list) and prompt and
                         not isinstance(prompt[0], int)) else [prompt]
    params = body.get("kv_transfer_params")
    reqs = []
    for i, p in enumerate(prompts):
        ext = f"cmpl-{parent}-{i}"
        sp = V.SamplingParams(max_tokens=int(body.get("max_tokens", 16)),
                              extra_args={"kv_transfer_params": json.loads(json.dumps(params))}
                              if params is not None else None)
        reqs.append(EngineRequest(f"{ext}-{secrets.token_hex(4)}", tokens_of(p), sp))
    return reqs


def wait_for(reqs: list[EngineRequest], timeout_s: float) -> None:
    """Waits for the requests to finish; those that did not in time get an error."""
    deadline = time.monotonic() + timeout_s
    for r in reqs:
        if not r.done.wait(max(0.0, deadline - time.monotonic())):
            r.error = r.error or f"request {r.request_id} did not finish in {timeout_s} s"


def choices_of(reqs: list[EngineRequest]) -> list[dict]:
    return [{"index": i, "text": "x" * len(r.output_token_ids), "finish_reason": "length",
             "kv_verified": r.verified, "cached_tokens": r.cached_tokens,
             "recomputed": r.recompute_from is not None}
            for i, r in enumerate(reqs)]


class EngineHandler(BaseHTTPRequestHandler):
    """The HTTP front of one engine core; make_handler binds `core` and `timeout_s`."""
    protocol_version = "HTTP/1.1"
    core: Core
    timeout_s: float

    def log_message(self, *a):
        pass

    def send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        try:
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client (the proxy) gave the request up: nobody reads the answer

    def read_json(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))

    def do_GET(self):
        if self.path == "/health":
            return self.send_json(200, {"status": "ok"})
        if self.path == "/stats":
            return self.send_json(200, self.core.stats())
        self.send_json(404, {"error": {"message": "not found", "code": 404}})

    def do_POST(self):
        if self.path == "/abort":  # vLLM aborts the requests of a client that went away
            return self.post_abort()
        if self.path != "/v1/completions":
            return self.send_json(404, {"error": {"message": "not found", "code": 404}})
        self.post_completions()

    def post_abort(self) -> None:
        parent = self.read_json()["x_request_id"]
        with self.core.lock:
            ids = [i for i in self.core.requests if i.startswith(f"cmpl-{parent}-")]
        self.core.abort(ids)
        self.send_json(200, {"aborted": ids})

    def post_completions(self) -> None:
        body = self.read_json()
        parent = self.headers.get("X-Request-Id") or secrets.token_hex(8)
        reqs = completion_requests(body, parent)
        self.core.add(reqs)
        wait_for(reqs, self.timeout_s)
        failed = [r for r in reqs if r.error]
        if failed:
            return self.send_json(500, {"error": {"message": failed[0].error, "code": 500}})
        choices = choices_of(reqs)
        out = {"id": f"cmpl-{parent}", "object": "text_completion", "choices": choices}
        if not body.get("stream"):
            return self.send_json(200, out)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for c in choices:
            self.chunk(b"data: " + json.dumps({**out, "choices": [c]}).encode() + b"\n\n")
        self.chunk(b"data: [DONE]\n\n")
        self.chunk(b"")

    def chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")


def make_handler(core: Core, timeout_s: float) -> type:
    """The handler class of an HTTP server in front of `core`."""
    return type("Handler", (EngineHandler,), {"core": core, "timeout_s": timeout_s})
