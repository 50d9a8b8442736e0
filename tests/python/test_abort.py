"""A request aborted while its KV loads: vLLM keeps its blocks until a worker reports the id
as received, so rd2h must report it; otherwise the blocks (and the request) are held until
the connector's arrival deadline."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

from conftest import EngineProcess, free_ports, kv_config, post


def stats(engine) -> dict:
    with urllib.request.urlopen(engine.url + "/stats", timeout=10) as r:
        return json.loads(r.read())


def test_an_aborted_load_gives_its_blocks_back(metaserver):
    # No Prefill answers: the KV never arrives (the arrival deadline is the default 120 s).
    decode = EngineProcess("decode", kv_config("kv_consumer", free_ports(1)))
    try:
        total = stats(decode)["num_blocks"]
        answer = {}
        client = threading.Thread(target=lambda: answer.update(zip(("status", "body"), post(
            decode.url + "/v1/completions",
            {"prompt": "x" * 200, "max_tokens": 2,
             "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                    "metaserver": metaserver.url}},
            {"X-Request-Id": "to-abort"}))))
        client.start()
        assert metaserver.next_post()["request_id"] == "cmpl-to-abort-0"
        assert stats(decode)["free_blocks"] < total, "the request holds no blocks"
        status, body = post(decode.url + "/abort", {"x_request_id": "to-abort"})
        assert status == 200 and len(body["aborted"]) == 1
        client.join(timeout=30)
        assert answer["status"] == 500 and "aborted" in answer["body"]["error"]["message"]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            s = stats(decode)
            if s["free_blocks"] == total and s["aborted_loading"] == 0:
                break
            time.sleep(0.05)  # polling the engine's state, bounded by the deadline above
        s = stats(decode)
        assert s["aborted_loading"] == 0, "the aborted id never came back as received"
        assert s["free_blocks"] == total
    finally:
        assert decode.stop() == 0
