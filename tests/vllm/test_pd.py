"""Real vLLM through rd2h: a Prefill and a Decode `vllm serve`, `rd2h proxy` in front, the
official OpenAI Python client as the user. Every answer at temperature 0 must equal the
answer of a single vLLM instance without a connector (token ids; the tiny model's tokenizer
maps each character to one token, so ids are read back from the text, streamed or not).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from conftest import (BLOCK_SIZE, MODEL_NAME, TOKEN_BUDGET, Engine, Proxy, kv_transfer_config,
                      free_port, metric, prompt, wait_until)
from make_model import NUM_LAYERS, kv_bytes_per_token, text_to_ids

MAX_TOKENS = 12


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)


def complete(url: str, p, stream: bool = False, max_tokens: int = MAX_TOKENS) -> list:
    """The token ids of each answer to a completion (one per prompt of a list)."""
    c = client(url)
    if not stream:
        r = c.completions.create(model=MODEL_NAME, prompt=p, max_tokens=max_tokens,
                                 temperature=0)
        return [text_to_ids(ch.text) for ch in sorted(r.choices, key=lambda ch: ch.index)]
    texts: dict = {}
    for ev in c.completions.create(model=MODEL_NAME, prompt=p, max_tokens=max_tokens,
                                   temperature=0, stream=True):
        for ch in ev.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    return [text_to_ids(texts[i]) for i in sorted(texts)]


def chat(url: str, p: str, stream: bool = False) -> list:
    c = client(url)
    messages = [{"role": "user", "content": p}]
    if not stream:
        r = c.chat.completions.create(model=MODEL_NAME, messages=messages,
                                      max_tokens=MAX_TOKENS, temperature=0)
        return [text_to_ids(r.choices[0].message.content)]
    text = ""
    for ev in c.chat.completions.create(model=MODEL_NAME, messages=messages,
                                        max_tokens=MAX_TOKENS, temperature=0, stream=True):
        for ch in ev.choices:
            text += ch.delta.content or ""
    return [text_to_ids(text)]


def first_difference(a: list, b: list):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def cases() -> list:
    """(name, how, prompt): every length the issue names, each way a client asks."""
    rng = random.Random(27)
    out = []
    for n in (1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1):
        out.append((f"completion of {n} tokens", "complete", prompt(rng, n)))
    out.append((f"completion of {TOKEN_BUDGET * 2 + 45} tokens, prefilled in chunks",
                "complete", prompt(rng, TOKEN_BUDGET * 2 + 45)))
    out.append(("streamed completion of 70 tokens", "complete-stream", prompt(rng, 70)))
    out.append(("prompt list of 3", "complete", [prompt(rng, n) for n in (20, 64, 90)]))
    out.append(("chat of 50 tokens", "chat", prompt(rng, 50)))
    out.append(("streamed chat of 100 tokens", "chat-stream", prompt(rng, 100)))
    return out


def ask(url: str, how: str, p) -> list:
    if how.startswith("chat"):
        return chat(url, p, stream=how.endswith("stream"))
    return complete(url, p, stream=how.endswith("stream"))


def results_file() -> Path:
    return Path(os.environ.get("RD2H_VLLM_LOGS", "/tmp")) / "gold.json"


def record(n: int) -> None:
    f = results_file()
    done = json.loads(f.read_text()) if f.exists() else {"prompts": 0}
    done["prompts"] += n
    f.write_text(json.dumps(done))


@pytest.fixture(scope="module")
def gold_record():
    results_file().unlink(missing_ok=True)
    yield


def check_same(pd: list, gold: list, what: str) -> None:
    assert len(pd) == len(gold), f"{what}: {len(pd)} answers through PD, {len(gold)} single"
    for i, (a, b) in enumerate(zip(pd, gold)):
        at = first_difference(a, b)
        assert at is None, (f"{what}, answer {i}: PD and the single instance differ first at "
                            f"token {at}: {a} vs {b}")
    record(len(gold))


@pytest.mark.parametrize("name,how,p", cases(), ids=[c[0] for c in cases()])
def test_pd_answer_equals_a_single_instance(gold_record, single, proxy, name, how, p):
    check_same(ask(proxy.url, how, p), ask(single.url, how, p), name)


SOURCES = ("external_kv_transfer", "local_compute", "local_cache_hit")


def decode_counts(engine) -> dict:
    """Decode's counters: vLLM's prompt tokens by where their KV came from (pulled,
    computed, found cached), rd2h's KV bytes read and layers arrived."""
    text = engine.metrics()
    out = {s: metric(text, "vllm:prompt_tokens_by_source_total", source=s) for s in SOURCES}
    out["bytes_read"] = metric(text, "rd2h_kv_bytes_read_total")
    out["layers_done"] = metric(text, "rd2h_kv_layers_total", outcome="done")
    return out


def counts_of_next_request(engine, send) -> dict:
    """What one request added to decode_counts; the engine publishes a step's counts after
    its answer went out, so they are waited for."""
    before = decode_counts(engine)
    send()

    def moved():
        c = decode_counts(engine)
        return c if c["external_kv_transfer"] != before["external_kv_transfer"] else None

    after = wait_until(moved, 60, "Decode's prompt token counts")
    return {k: after[k] - before[k] for k in after}


def test_a_prefix_cached_on_decode_is_not_pulled_again(gold_record, single, proxy, decode):
    rng = random.Random(31)
    head = prompt(rng, 3 * BLOCK_SIZE)
    check_same(complete(proxy.url, head), complete(single.url, head), "the prefix alone")
    longer = head + prompt(rng, 40)
    pd = []
    c = counts_of_next_request(decode, lambda: pd.extend(complete(proxy.url, longer)))
    check_same(pd, complete(single.url, longer), "prefix + 40 tokens")
    pulled, computed, cached = (c[s] for s in SOURCES)
    assert (pulled, computed, cached) == (len(longer) - 3 * BLOCK_SIZE, 0, 3 * BLOCK_SIZE), (
        f"Decode pulled {pulled}, computed {computed} and found {cached} cached tokens of "
        f"{len(longer)}; the prefix's {3 * BLOCK_SIZE} were cached")


def test_eight_concurrent_requests(gold_record, single, proxy):
    rng = random.Random(8)
    prompts = [prompt(rng, rng.randrange(20, 200)) for _ in range(8)]
    with ThreadPoolExecutor(8) as pool:
        pd = list(pool.map(lambda p: complete(proxy.url, p)[0], prompts))
    gold = [complete(single.url, p)[0] for p in prompts]
    check_same(pd, gold, "8 concurrent completions")


def test_decode_pulled_the_prompt_and_computed_only_the_last_token(single, proxy, decode):
    rng = random.Random(5)
    p = prompt(rng, 5 * BLOCK_SIZE + 7)
    c = counts_of_next_request(decode, lambda: complete(proxy.url, p))
    pulled, computed, cached = (c[s] for s in SOURCES)
    # vLLM counts every prompt token the connector matched as pulled: the last one, which
    # its scheduler has Decode compute again to sample from, included.
    assert (pulled, computed, cached) == (len(p), 0, 0), (
        f"Decode pulled {pulled}, computed {computed} and found {cached} cached of {len(p)} "
        f"prompt tokens")
    # rd2h read every block that holds the pulled tokens, every layer of them.
    blocks = -(-pulled // BLOCK_SIZE)
    assert c["bytes_read"] == blocks * BLOCK_SIZE * kv_bytes_per_token(), (
        f"rd2h read {c['bytes_read']} bytes for {blocks} blocks")
    assert c["layers_done"] == NUM_LAYERS, f"{c['layers_done']} layers arrived"


# ---- the check has power: wrong KV gives other answers ------------------------------------


@pytest.fixture(scope="module")
def corrupting(model, logs, prefill):
    """A Decode that negates one pulled block of each request (a test-only setting), behind
    a proxy of its own over the same Prefill."""
    d = Engine("decode-corrupting", model, logs,
               kv_transfer_config("kv_consumer", free_port(), test_corrupt_pulled_block=True))
    p = Proxy("proxy-corrupting", logs, [prefill], [d])
    yield d, p
    p.stop()
    d.stop()


def test_the_check_fails_when_decode_has_wrong_kv(single, corrupting):
    _, proxy = corrupting
    rng = random.Random(77)
    prompts = [prompt(rng, n) for n in (BLOCK_SIZE + 5, 2 * BLOCK_SIZE + 9, 3 * BLOCK_SIZE)]
    for p in prompts:
        wrong = complete(proxy.url, p)[0]
        gold = complete(single.url, p)[0]
        assert first_difference(wrong, gold) is not None, (
            f"a Decode with one negated block answered as the single instance: {wrong}")


# ---- a Decode that dies ----------------------------------------------------------------------


def test_a_decode_killed_mid_request_fails_it_and_prefill_serves_on(single, prefill, proxy,
                                                                    corrupting):
    victim, victim_proxy = corrupting
    rng = random.Random(99)
    # A thousand tokens whatever the model samples (no end at its EOS): the stream is still
    # going when the client, however slowly it is scheduled, reads its first event.
    stream = client(victim_proxy.url).completions.create(
        model=MODEL_NAME, prompt=prompt(rng, 80), max_tokens=1000, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    with pytest.raises(openai.APIError):
        for i, ev in enumerate(stream):
            if i == 0:
                victim.kill()
            assert not any(ch.finish_reason for ch in ev.choices), \
                "the stream finished although its Decode was killed"
        raise openai.APIError("the stream ended without an error", request=None, body=None)
    assert prefill.proc.poll() is None, "the Prefill engine died with a Decode"
    p = prompt(rng, 60)
    check_same(complete(proxy.url, p), complete(single.url, p), "after a Decode was killed")


def test_a_prefill_whose_decode_is_gone_fails_only_that_transfer_and_serves_on(single, prefill,
                                                                                  proxy):
    """Prefill is sent a request whose Decode does not listen (it died, or the rendezvous names
    the wrong port): before, wait_for_save raised and vLLM ended the engine with every request
    it held. Now only that transfer fails; the engine answers, and serves the next request."""
    rng = random.Random(98)
    params = {"do_remote_decode": True, "do_remote_prefill": False,
              "request_id": "cmpl-nodecode-0", "remote_engine_id": "gone",
              "remote_host": "127.0.0.1", "remote_port": free_port(), "remote_tp_size": 1}
    body = {"model": MODEL_NAME, "prompt": prompt(rng, 70), "max_tokens": 1,
            "kv_transfer_params": params}
    req = urllib.request.Request(prefill.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "X-Request-Id": "nodecode"}, method="POST")
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.status == 200, "the Prefill engine failed the request of a gone Decode"
    assert prefill.proc.poll() is None, "the Prefill engine died with a Decode that is gone"
    p = prompt(rng, 60)
    check_same(complete(proxy.url, p), complete(single.url, p), "after a gone Decode's request")


# ---- the official npm client -----------------------------------------------------------------


def node_answers(url: str, asks: list) -> list:
    node_dir = Path(__file__).resolve().parents[1] / "node"
    r = subprocess.run(["node", str(node_dir / "vllm_client.mjs"), url, MODEL_NAME],
                       input=json.dumps(asks), capture_output=True, text=True, timeout=600,
                       cwd=node_dir)
    assert r.returncode == 0, f"the Node client failed:\n{r.stderr}"
    return [text_to_ids(t) for t in json.loads(r.stdout)]


def test_the_npm_client_gets_the_single_instance_answers(gold_record, single, proxy):
    rng = random.Random(12)
    asks = [{"kind": kind, "prompt": prompt(rng, n), "stream": stream, "max_tokens": MAX_TOKENS}
            for kind, n, stream in (("completion", 45, False), ("completion", 66, True),
                                    ("chat", 30, False), ("chat", 90, True))]
    check_same(node_answers(proxy.url, asks), node_answers(single.url, asks),
               "the npm client's asks")
