"""``tokenmill router``: instance choice (prefix affinity from KV events, least-loaded), the
prefill request it makes, and its answers when instances are down. The end-to-end run over
real prefill and decode instances is in test_disaggregated.py."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from tokenmill.entrypoints.router import REMOTE_DECODE_PARAMS, prefill_body
from tokenmill.entrypoints.router_pool import InstancePool, NoInstanceError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RouterProcess:
    """A ``tokenmill router`` subprocess, up once it answers on its port."""

    def __init__(self, prefill: list[str], decode: list[str], *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        cmd = [sys.executable, "-m", "tokenmill", "router", "--port", str(self.port)]
        cmd += ["--prefill", *prefill, "--decode", *decode, "--uvicorn-log-level", "warning"]
        self.proc = subprocess.Popen([*cmd, *args], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                output = self.output()
                self.stop()
                raise RuntimeError(f"router did not start:\n{output}")
            try:
                httpx.get(self.url + "/health", timeout=2)
                return
            except httpx.HTTPError:
                time.sleep(0.3)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-5000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()


def stored(*hashes: str) -> dict:
    return {
        "log_id": "x",
        "seq": 1,
        "reset": False,
        "events": [{"type": "BlockStored", "block_hashes": list(hashes)}],
    }


def test_decode_instance_holding_the_longest_prefix_wins_over_the_least_loaded():
    pool = InstancePool(["http://p"], ["http://d1", "http://d2"])
    d1, d2 = pool.of_role("decode")
    for i in pool.instances:
        i.up = True
    d1.apply_kv_events(stored("a", "b", "c"))
    d2.apply_kv_events(stored("a"))
    d1.in_flight = 5
    assert pool.pick("decode", ["a", "b", "x"]) is d1
    assert pool.pick("decode", ["x", "b"]) is d2
    assert pool.pick("decode") is d2
    d2.apply_kv_events(
        {"log_id": "x", "seq": 2, "reset": True, "blocks": ["a", "b", "c"], "events": []}
    )
    assert pool.pick("decode", ["a", "b", "c"]) is d2
    d2.apply_kv_events(
        {
            "log_id": "x",
            "seq": 3,
            "reset": False,
            "events": [{"type": "BlockRemoved", "block_hashes": ["b"]}],
        }
    )
    assert pool.pick("decode", ["a", "b", "c"]) is d1 and d2.kv_seq == 3


def test_no_instance_up_names_each_reason():
    pool = InstancePool(["http://p1", "http://p2"], ["http://d"])
    pool.instances[0].mark_down("refused")
    with pytest.raises(NoInstanceError, match=r"no prefill instance is up .*http://p1: refused"):
        pool.pick("prefill")
    assert pool.all_up().startswith("no prefill instance is up")


def test_prefill_request_asks_for_one_unstreamed_token_and_kept_kv():
    body = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out = prefill_body(body)
    assert out == {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": REMOTE_DECODE_PARAMS,
    }
    assert body["max_tokens"] == 50 and body["stream"] is True
    chat = prefill_body({"messages": [], "max_completion_tokens": 9})
    assert chat["max_completion_tokens"] == 1 and chat["max_tokens"] == 1


def test_router_answers_503_with_a_reason_when_a_role_has_no_instance_up():
    dead = f"http://127.0.0.1:{free_port()}"
    router = RouterProcess([dead], [dead], "--connect-timeout", "1")
    try:
        start = time.monotonic()
        for path in ("/v1/completions", "/v1/chat/completions"):
            answer = httpx.post(router.url + path, json={"model": "m", "prompt": "hi"}, timeout=10)
            assert answer.status_code == 503
            assert answer.json()["error"]["message"].startswith(
                f"no prefill instance is up ({dead}: ConnectError"
            )
        health = httpx.get(router.url + "/health", timeout=10)
        assert health.status_code == 503 and "no prefill instance is up" in health.text
        models = httpx.get(router.url + "/v1/models", timeout=10)
        assert models.status_code == 503 and "no decode instance is up" in models.text
        assert time.monotonic() - start < 10
        bad = httpx.post(router.url + "/v1/completions", content=b"{", timeout=10)
        assert bad.status_code == 400 and "not valid JSON" in bad.text
    finally:
        router.stop()
