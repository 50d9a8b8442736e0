"""Two engines in separate processes, driven in vLLM's call order through rd2h proxy: a Prefill
at TP 2 (a process per rank, 4 layers sharing 2 physical buffers, so buffers are reused within
and across requests) and a Decode at TP 1 with a prefix cache. Decode checks every byte of
every prompt's KV before it answers."""

from __future__ import annotations

import concurrent.futures
import json
import urllib.request

import pytest

from conftest import EngineProcess, free_ports, kv_config, post, start_proxy

LAYERS = 4
MAIN_BYTES, INDEXER_BYTES = 64, 16


@pytest.fixture(scope="module")
def cluster():
    decode = EngineProcess("decode", kv_config("kv_consumer", free_ports(1), prefill_tp_size=2),
                           tp=1, args=("--prefix-cache", "--layers", str(LAYERS)))
    prefill = EngineProcess("prefill", kv_config("kv_producer", free_ports(1)), tp=2,
                            args=("--slots", "2", "--layers", str(LAYERS)))
    proxy = start_proxy([prefill.url], [decode.url])
    yield proxy
    proxy.close()
    assert prefill.stop() == 0, "Prefill did not stop cleanly"
    assert decode.stop() == 0, "Decode did not stop cleanly"


def verified_bytes(prompt_tokens: int) -> int:
    return prompt_tokens * LAYERS * (MAIN_BYTES + INDEXER_BYTES)


def check(choice: dict, prompt_tokens: int) -> None:
    v = choice["kv_verified"]
    assert v["mismatches"] == 0, f"Decode holds wrong KV bytes: {v['first']}"
    assert v["bytes"] == verified_bytes(prompt_tokens)


def test_chunked_prompts_and_prompt_lists_arrive_byte_exact(cluster):
    # 64-token steps: 300 tokens are 5 chunks; 7 tokens are one partial block.
    jobs = [
        {"prompt": "chunked prefill " * 19, "max_tokens": 3},  # 304 tokens
        {"prompt": "seven!!", "max_tokens": 2},
        {"prompt": ["first prompt of a list", "second, longer prompt " * 6, "3rd"], "max_tokens": 2},
        {"prompt": list(range(1000, 1130)), "max_tokens": 1},  # token ids
    ]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda b: post(cluster.url + "/v1/completions", b), jobs))
    for job, (status, body) in zip(jobs, results):
        assert status == 200, body
        prompt = job["prompt"]
        prompts = prompt if isinstance(prompt, list) and isinstance(prompt[0], str) else [prompt]
        assert len(body["choices"]) == len(prompts)
        for choice, p in zip(body["choices"], prompts):
            check(choice, len(p.encode()) if isinstance(p, str) else len(p))
            assert len(choice["text"]) == job["max_tokens"]


def test_a_prefix_cached_on_decode_is_kept_and_the_rest_arrives(cluster):
    prefix = "a shared system prompt, exactly sixty-four bytes long, padded..."
    assert len(prefix) == 64
    status, body = post(cluster.url + "/v1/completions", {"prompt": prefix + " first question", "max_tokens": 1})
    assert status == 200, body
    check(body["choices"][0], 64 + 15)
    status, body = post(cluster.url + "/v1/completions", {"prompt": prefix + " another one, longer", "max_tokens": 1})
    assert status == 200, body
    # Decode found the four prefix blocks locally and loaded the rest (Prefill is told
    # remote_cached_tokens=64); the whole prompt is right.
    assert body["choices"][0]["cached_tokens"] == 64
    check(body["choices"][0], 64 + 20)


def test_many_requests_reuse_prefill_buffers(cluster):
    prompts = [f"request {i} " * (3 + 5 * i) for i in range(12)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(
            lambda p: post(cluster.url + "/v1/completions", {"prompt": p, "max_tokens": 1}), prompts))
    for p, (status, body) in zip(prompts, results):
        assert status == 200, body
        check(body["choices"][0], len(p))


def test_a_streamed_request_streams_through_the_proxy(cluster):
    prompt = "streamed " * 20
    req = urllib.request.Request(cluster.url + "/v1/completions", method="POST",
                                 data=json.dumps({"prompt": prompt, "max_tokens": 2,
                                                  "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [line[len(b"data: "):] for line in r.read().split(b"\n\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 1
    check(chunks[0]["choices"][0], len(prompt))
