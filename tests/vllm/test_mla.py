"""Real vLLM with an MLA model (DeepSeek-V2 attention, the single 576-wide latent cache) through
rd2h: a Prefill and a Decode `vllm serve`, `rd2h proxy` in front.

vLLM's CPU MLA backend computes a prompt's next token differently in its prefill path and in
its decode kernel, so a single instance is no reference for the answers of a Decode that
computes from pulled KV (see docs/design.md, "Limits"). The check here is on the KV itself: each side files
the SHA-256 of every prompt's latent blocks (the test-only `test_kv_digest_dir` setting),
Prefill once it saved them and Decode once they arrived, and the two must be equal for every
prompt.

Both engines keep their KV caches as vLLM's device caches would be kept: they register host
buffers apart from vLLM's caches (the test-only `test_stage_host_caches` setting, with
`kv_buffer_device` "cpu"), Prefill copies each layer into them with vLLM's own copy operation
before it publishes the layer, and Decode copies what it pulled into vLLM's caches before it
reports the request. The digests are taken from vLLM's caches on both sides, so equal digests
also say that both copies ran. vLLM's CPU platform has no block copy functions: the suite's
plugin (tests/vllm/plugins) gives it those of vLLM's GPU platforms.
"""

from __future__ import annotations

import json
import math
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

import make_model
from conftest import (MODEL_NAME, Engine, Proxy, free_port, kv_transfer_config, made_model,
                      prompt, running)
from rd2h.vllm import prompt_key

MLA_BLOCK_SIZE = 16  # vLLM's CPU MLA backend requires it (it overrides --block-size)


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory) -> Path:
    return made_model(tmp_path_factory.mktemp("mla-model"), arch="deepseek_v2")


@pytest.fixture(scope="module")
def digests(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kv-digests")


PLUGINS = Path(__file__).resolve().parent / "plugins"


def staged_engine(name: str, role: str, model: Path, digests: Path, logs: Path) -> Engine:
    ktc = kv_transfer_config(role, free_port(), test_kv_digest_dir=str(digests),
                             test_stage_host_caches=True)
    ktc["kv_buffer_device"] = "cpu"
    path = os.pathsep.join(p for p in (str(PLUGINS), os.environ.get("PYTHONPATH")) if p)
    # On a CPU with AMX tiles vLLM would pick its AMX MLA backend, which takes bfloat16 weights
    # only; the suite's models are float32, so the engines ask for the reference CPU backend.
    return Engine(name, model, logs, ktc, env={"PYTHONPATH": path},
                  args=["--attention-backend", "CPU_MLA"])


@pytest.fixture(scope="module")
def mla_prefill(mla_model, digests, logs):
    yield from running(staged_engine("mla-prefill", "kv_producer", mla_model, digests, logs))


@pytest.fixture(scope="module")
def mla_decode(mla_model, digests, logs):
    yield from running(staged_engine("mla-decode", "kv_consumer", mla_model, digests, logs))


@pytest.fixture(scope="module")
def mla_proxy(mla_prefill, mla_decode, logs):
    yield from running(Proxy("mla-proxy", logs, [mla_prefill], [mla_decode]))


def filed(digests: Path, side: str) -> dict:
    """prompt key -> (blocks, digest) as one side filed them."""
    out = {}
    for f in digests.glob(f"{side}-*"):
        blocks, digest = f.read_text().split()
        out[f.name[len(side) + 1:]] = (int(blocks), digest)
    return out


def test_decode_holds_the_latent_kv_prefill_computed(mla_proxy, digests, logs):
    rng = random.Random(16)
    cl = openai.OpenAI(base_url=mla_proxy.url + "/v1", api_key="unused", max_retries=0,
                       timeout=600)
    lengths = [1, MLA_BLOCK_SIZE - 1, MLA_BLOCK_SIZE, MLA_BLOCK_SIZE + 1, 100, 300]
    prompts = [prompt(rng, n) for n in lengths]
    singles = {}  # prompt key -> its blocks
    for p in prompts:
        r = cl.completions.create(model=MODEL_NAME, prompt=p, max_tokens=4, temperature=0)
        assert r.choices[0].text, f"no answer to a prompt of {len(p)} characters"
        ids = make_model.text_to_ids(p)
        assert r.usage.prompt_tokens == len(ids), "the tokenizer is one token per character"
        singles[prompt_key(ids)] = math.ceil(len(ids) / MLA_BLOCK_SIZE)
    # A prompt list and concurrent requests: several prompts' blocks in one step.
    listed = [prompt(rng, n) for n in (20, 40, 70)]
    r = cl.completions.create(model=MODEL_NAME, prompt=listed, max_tokens=2, temperature=0)
    assert len(r.choices) == 3 and all(ch.text for ch in r.choices)
    together = [prompt(rng, rng.randrange(10, 120)) for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(
            lambda p: cl.completions.create(model=MODEL_NAME, prompt=p, max_tokens=3,
                                            temperature=0), together))
    assert all(a.choices[0].text for a in answers)

    prefill, decode = filed(digests, "prefill"), filed(digests, "decode")
    expected = len(prompts) + len(listed) + len(together)
    assert len(decode) == expected, f"Decode filed {len(decode)} prompts' KV, not {expected}"
    for key, (n, digest) in decode.items():
        assert key in prefill, f"Decode pulled KV of prompt {key}, which Prefill never saved"
        assert (n, digest) == prefill[key], (
            f"prompt {key}: Decode's {n} latent blocks differ from Prefill's {prefill[key][0]}")
    for key, n in singles.items():
        assert decode.get(key, (None,))[0] == n, (
            f"a prompt of {n} blocks was filed as {decode.get(key)}")
    # What scripts/test reports.
    (logs / "mla.json").write_text(json.dumps({"prompts": len(decode)}))
