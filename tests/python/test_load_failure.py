"""A failing read reaches vLLM's scheduler as invalid block ids, and the request is handled
per kv_load_failure_policy. Decode's indexer layout differs from Prefill's (8 bytes per token
against 16), so Decode refuses every read of the request (READ_FAILED) and reports it
finished with its blocks invalid. The client talks to Decode directly; the test's metaserver
dispatches Prefill, as the proxy would, but a failed Prefill does not end Decode's request."""

from __future__ import annotations

import threading

import pytest

from conftest import EngineProcess, Metaserver, free_ports, kv_config, post


@pytest.fixture(scope="module")
def prefill():
    engine = EngineProcess("prefill", kv_config("kv_producer", free_ports(1)), tp=1)
    yield engine
    engine.stop()


def run(prefill, policy: str):
    dispatched = []

    def dispatch(rendezvous: dict) -> None:
        body = {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": rendezvous}
        t = threading.Thread(target=lambda: post(prefill.url + "/v1/completions", body,
                                                 {"X-Request-Id": PARENT}))
        t.start()
        dispatched.append(t)

    meta = Metaserver(on_post=dispatch)
    decode = EngineProcess(
        "decode",
        kv_config("kv_consumer", free_ports(1), kv_load_failure_policy=policy),
        args=("--decode-indexer-bytes", "8"))
    try:
        status, body = post(decode.url + "/v1/completions",
                            {"prompt": PROMPT, "max_tokens": 2,
                             "kv_transfer_params": {"do_remote_prefill": True,
                                                    "do_remote_decode": False,
                                                    "metaserver": meta.url}},
                            {"X-Request-Id": PARENT})
        rendezvous = meta.next_post(timeout=1)
        assert rendezvous["request_id"] == f"cmpl-{PARENT}-0"
        return status, body
    finally:
        for t in dispatched:
            t.join(timeout=60)
        assert decode.stop() == 0
        meta.close()


PROMPT = "a prompt whose KV Decode cannot take " * 3
PARENT = "load-failure"


def test_fail_policy_ends_the_request_with_an_error(prefill):
    status, body = run(prefill, "fail")
    assert status == 500
    assert "failed to load" in body["error"]["message"]


def test_recompute_policy_computes_the_prompt_on_decode(prefill):
    status, body = run(prefill, "recompute")
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["recomputed"], "the invalid blocks did not reach the scheduler"
    assert choice["kv_verified"]["mismatches"] == 0
    assert choice["kv_verified"]["bytes"] == len(PROMPT) * 4 * (64 + 8)
