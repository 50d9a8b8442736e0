"""The kv-transfer-configs of examples/vllm read as written: the multi-host pair with the keys
`rd2h keygen` makes at the paths they name (moved under a temporary directory), the
loopback pair as they are. The multi-host pair also serves: `rd2h prefill` (TP 2, as
decode.json's prefill_tp_size says) and `rd2h decode` load them with their keys and token,
on loopback addresses in place of 10.0.0.x, behind `rd2h proxy --token-file`."""

import json
import os
import random
import subprocess
from pathlib import Path

import pytest
import rd2h

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "vllm"
BINARY = os.environ.get("RD2H_BINARY")


def example(name: str, etc: Path) -> str:
    return (EXAMPLES / name).read_text().replace("/etc/rd2h", str(etc))


@pytest.mark.skipif(not BINARY, reason="RD2H_BINARY names no rd2h binary")
def test_the_multi_host_examples_read_with_their_keys(tmp_path):
    make_keys(tmp_path)
    prefill = rd2h.ConnectorConfig.from_json(example("prefill.json", tmp_path))
    decode = rd2h.ConnectorConfig.from_json(example("decode.json", tmp_path))
    assert prefill.role == rd2h.KvRole.PRODUCER and decode.role == rd2h.KvRole.CONSUMER
    assert json.loads(decode.to_json())["kv_ip"] == "10.0.0.2", "kv_ip from the extra config"
    # Without its keys the same Decode is refused: off loopback they are what admits peers.
    bare = json.loads(example("decode.json", tmp_path))
    for key in ("curve_secret_key_file", "curve_trusted_keys_file"):
        del bare["kv_connector_extra_config"][key]
    with pytest.raises(rd2h.InvalidArgument, match="kv_ip"):
        rd2h.ConnectorConfig.from_json(json.dumps(bare))


def make_keys(etc: Path) -> None:
    for stem in ("prefill-0", "decode-0"):
        subprocess.run([BINARY, "keygen", str(etc / stem)], check=True, capture_output=True,
                       timeout=60)
    (etc / "decoders.keys").write_text((etc / "decode-0.key").read_text())
    (etc / "prefillers.keys").write_text((etc / "prefill-0.key").read_text())
    (etc / "token").write_text("an engines' token of enough length\n")


@pytest.mark.skipif(not BINARY, reason="RD2H_BINARY names no rd2h binary")
def test_the_multi_host_examples_serve_with_their_keys_and_token(tmp_path):
    from conftest import post
    from test_openai_http import SMALL, Server

    make_keys(tmp_path)
    prefill = json.loads(example("prefill.json", tmp_path).replace("10.0.0.1", "127.0.0.1"))
    token = ["--token-file", str(tmp_path / "token")]
    servers = []
    try:
        for attempt in range(6):
            decode = json.loads(example("decode.json", tmp_path).replace("10.0.0.2", "127.0.0.1"))
            decode["kv_port"] = random.randint(20000, 60000)
            try:
                servers.append(Server(["decode", *SMALL, *token, "--kv-transfer-config",
                                       json.dumps(decode)]))
                break
            except RuntimeError:
                if attempt == 5:
                    raise
        tp = str(decode["kv_connector_extra_config"]["prefill_tp_size"])
        servers.append(Server(["prefill", *SMALL, *token, "--tp", tp, "--kv-transfer-config",
                               json.dumps(prefill)]))
        servers.append(Server(["proxy", *token, "--decode", servers[0].url, "--prefill",
                               servers[1].url]))
        status, body = post(servers[2].url + "/v1/completions",
                            {"model": "rd2h-sim", "prompt": "hello from the examples",
                             "max_tokens": 3})
        assert status == 200, body
        assert body["rd2h"]["verified_blocks"] > 0, body
        assert "CURVE" in servers[0].line, "the Decode's control channels are not encrypted"
    finally:
        for s in reversed(servers):
            s.stop()


def test_the_loopback_examples_read_as_written(tmp_path):
    for name, role in (("local-prefill.json", rd2h.KvRole.PRODUCER),
                       ("local-decode.json", rd2h.KvRole.CONSUMER)):
        assert rd2h.ConnectorConfig.from_json(example(name, tmp_path)).role == role
