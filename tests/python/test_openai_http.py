"""rd2h's OpenAI-compatible front with Python's standard library as the client: `rd2h proxy`
over `rd2h prefill` and `rd2h decode` (the binary named by RD2H_BINARY), called with urllib
as a script without any OpenAI package would."""

from __future__ import annotations

import json
import os
import random
import urllib.error
import urllib.request

import pytest

from conftest import start_process

BINARY = os.environ.get("RD2H_BINARY")
MODEL = "rd2h-sim"
SMALL = ["--layers", "4", "--block-size", "16", "--num-blocks", "64", "--bytes-per-token", "64,8,16"]

pytestmark = pytest.mark.skipif(not BINARY, reason="RD2H_BINARY names no rd2h binary")


class Server:
    def __init__(self, args: list):
        self.proc, line = start_process([BINARY, *args])
        if "serving " not in line:
            self.stop()
            raise RuntimeError(f"rd2h {args[0]} did not start: {line!r}")
        self.url = line.split("serving ")[1].split()[0]
        self.line = line

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def stack():
    servers = []
    try:
        for attempt in range(6):
            config = {"kv_connector": "rd2h", "kv_role": "kv_consumer",
                      "kv_port": random.randint(20000, 60000),
                      "kv_connector_extra_config": {"transport": "shm", "prefill_tp_size": 1}}
            try:
                servers.append(Server(["decode", *SMALL, "--kv-transfer-config", json.dumps(config)]))
                break
            except RuntimeError:
                if attempt == 5:
                    raise
        prefill_config = {"kv_connector": "rd2h", "kv_role": "kv_producer", "kv_port": 1,
                          "kv_connector_extra_config": {"transport": "shm"}}
        servers.append(Server(["prefill", *SMALL, "--kv-transfer-config", json.dumps(prefill_config)]))
        servers.append(Server(["proxy", "--decode", servers[0].url, "--prefill", servers[1].url]))
        yield servers[2].url
    finally:
        for s in reversed(servers):
            s.stop()


def call(url: str, path: str, body=None, headers=None):
    """(status, headers, raw body) of a GET (no body) or a POST."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def events(raw: bytes) -> list:
    """The data of each server-sent event, [DONE] last."""
    out = [block[len(b"data: "):] for block in raw.split(b"\n\n") if block.startswith(b"data: ")]
    assert out and out[-1] == b"[DONE]", raw[-200:]
    return [json.loads(e) for e in out[:-1]]


def test_a_completion_has_the_openai_shape_and_echoes_the_request_id(stack):
    status, headers, raw = call(stack, "/v1/completions",
                                {"model": MODEL, "prompt": "hello world", "max_tokens": 4},
                                {"X-Request-Id": "py-client-7"})
    assert status == 200, raw
    assert headers["X-Request-Id"] == "py-client-7"
    body = json.loads(raw)
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert isinstance(body["created"], int)
    choice = body["choices"][0]
    assert len(choice["text"]) == 4 and choice["finish_reason"] == "length"
    assert choice["logprobs"] is None
    assert body["usage"] == {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15}


def test_a_chat_completion_answers_with_a_message(stack):
    status, _, raw = call(stack, "/v1/chat/completions",
                          {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                           "max_completion_tokens": 2})
    assert status == 200, raw
    message = json.loads(raw)["choices"][0]["message"]
    assert message["role"] == "assistant" and len(message["content"]) == 2


def test_a_stream_has_one_event_per_token_and_the_usage_last(stack):
    status, headers, raw = call(stack, "/v1/chat/completions",
                                {"model": MODEL, "messages": [{"role": "user", "content": "abc"}],
                                 "max_tokens": 5, "stream": True,
                                 "stream_options": {"include_usage": True}})
    assert status == 200, raw
    assert headers["Content-Type"].startswith("text/event-stream")
    chunks = events(raw)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    tokens = [c["choices"][0]["delta"]["content"] for c in chunks
              if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(tokens) == 5, chunks
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


def test_errors_are_openai_error_objects(stack):
    status, _, raw = call(stack, "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 3})
    assert status == 400
    error = json.loads(raw)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "n" and error["code"] == "unsupported_parameter"
    status, _, raw = call(stack, "/v1/completions", {"model": MODEL, "prompt": "hi",
                                                       "max_tokens": "many"})
    assert status == 400 and json.loads(raw)["error"]["param"] == "max_tokens"
    status, _, raw = call(stack, "/v1/completions", {"model": MODEL, "prompt": "q" * 2000})
    assert status == 400 and json.loads(raw)["error"]["code"] == "context_length_exceeded"
    status, _, raw = call(stack, "/v1/nothing-here", {})
    assert status == 404 and "error" in json.loads(raw)


def test_health_models_and_version(stack):
    status, _, raw = call(stack, "/health")
    assert status == 200 and json.loads(raw)["status"] == "ok"
    status, _, raw = call(stack, "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(raw)["data"]] == [MODEL]
    status, _, raw = call(stack, "/version")
    assert status == 200 and json.loads(raw)["version"]
