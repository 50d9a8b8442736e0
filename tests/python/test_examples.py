"""The kv-transfer-configs of examples/vllm read as written: the multi-host pair with the keys
`rd2h keygen` makes at the paths they name (moved under a temporary directory), the
loopback pair as they are."""

import json
import os
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
    for stem in ("prefill-0", "decode-0"):
        subprocess.run([BINARY, "keygen", str(tmp_path / stem)], check=True,
                       capture_output=True, timeout=60)
    (tmp_path / "decoders.keys").write_text((tmp_path / "decode-0.key").read_text())
    (tmp_path / "prefillers.keys").write_text((tmp_path / "prefill-0.key").read_text())
    (tmp_path / "token").write_text("an engines' token of enough length\n")
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


def test_the_loopback_examples_read_as_written(tmp_path):
    for name, role in (("local-prefill.json", rd2h.KvRole.PRODUCER),
                       ("local-decode.json", rd2h.KvRole.CONSUMER)):
        assert rd2h.ConnectorConfig.from_json(example(name, tmp_path)).role == role
