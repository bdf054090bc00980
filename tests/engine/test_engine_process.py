"""``AsyncLLM`` and ``tokenmill serve`` run the engine core in a child process by default: the
outputs are those of the in-process engine, and a killed engine process turns in-flight and
new requests into clean errors (HTTP 500) and ``/health`` unhealthy, without a hang."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import threading
import time

import httpx
import pytest

from conftest import make_tiny_checkpoint, save_byte_tokenizer
from server.test_server import RemoteServer
from tokenmill import LLM, SamplingParams
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.engine.core_client import EngineDeadError
from tokenmill.engine.output_processor import RequestOutputKind

ENGINE = dict(num_kv_blocks=64, block_size=8, max_model_len=256)
PROMPTS = ["hello world", "abc", "the quick brown fox"]
GREEDY = [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=20, stop=["e"], ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[65], logprobs=2),
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
    save_byte_tokenizer(path)
    return path


def parent_pid_of(pid: int) -> int:
    return int(subprocess.check_output(["ps", "-o", "ppid=", "-p", str(pid)]))


def engine_children(pid: int) -> list[int]:
    """Process ids of ``pid``'s children that run the engine core (multiprocessing spawn)."""
    ps = ["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)]
    out = subprocess.run(ps, capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "spawn_main" in line]


def summary(outputs) -> list[tuple]:
    return [
        (c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs)
        for o in outputs
        for c in o.outputs
    ]


async def final(engine: AsyncLLM, prompt: str, params: SamplingParams):
    stream = engine.generate(prompt, params, output_kind=RequestOutputKind.FINAL_ONLY)
    return [o async for o in stream][-1]


def async_outputs(tiny_dir: str, engine_process: bool) -> tuple[list[tuple], int]:
    engine = AsyncLLM.from_engine_args(model=tiny_dir, engine_process=engine_process, **ENGINE)

    async def main():
        return await asyncio.gather(*(final(engine, p, s) for p, s in zip(PROMPTS, GREEDY)))

    try:
        outputs = asyncio.run(main())
        pid = engine.engine_core.pid
        if engine_process:
            assert parent_pid_of(pid) == os.getpid()
            assert engine_children(os.getpid()) == [pid]
    finally:
        engine.shutdown()
    return summary(outputs), pid


def test_engine_process_gives_in_process_outputs(tiny_dir):
    offline = LLM(model=tiny_dir, **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)
    in_process, thread_pid = async_outputs(tiny_dir, engine_process=False)
    in_child, child_pid = async_outputs(tiny_dir, engine_process=True)
    assert thread_pid == os.getpid() != child_pid
    assert in_child == in_process == summary(offline)


def test_killed_engine_process_fails_requests_cleanly(tiny_dir):
    engine = AsyncLLM.from_engine_args(model=tiny_dir, **ENGINE)
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def main() -> float:
        stream = engine.generate("hello", params)
        await stream.__anext__()
        os.kill(engine.engine_core.pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(EngineDeadError, match="died with exit code -9"):
            async for _ in stream:
                pass
        failed_after = time.monotonic() - killed
        assert not engine.is_running()
        with pytest.raises(EngineDeadError, match="died"):
            await engine.add_request("hello", params)
        return failed_after

    try:
        assert asyncio.run(asyncio.wait_for(main(), 30)) < 3
    finally:
        engine.shutdown()


def _wait_until_running(server: RemoteServer) -> None:
    """Until the server's /metrics shows a running request (a fixed sleep let the tiny model
    finish its 1,000 tokens before the kill)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = httpx.get(server.url + "/metrics", timeout=5).text
        if re.search(r"^tokenmill:num_requests_running\{[^}]*\} [1-9]", text, re.M):
            return
        time.sleep(0.005)
    raise AssertionError("the request never ran")


def test_server_runs_engine_in_child_and_survives_its_death(tiny_dir):
    server = RemoteServer("--model", tiny_dir, "--num-kv-blocks", "160", "--max-model-len", "1024")
    try:
        [core_pid] = engine_children(server.proc.pid)
        body = {"prompt": "hello", "max_tokens": 1000, "ignore_eos": True}
        in_flight: dict[str, httpx.Response] = {}
        request = threading.Thread(
            target=lambda: in_flight.update(response=server.post("/v1/completions", body))
        )
        request.start()
        _wait_until_running(server)
        os.kill(core_pid, signal.SIGKILL)
        killed = time.monotonic()
        health = httpx.get(server.url + "/health", timeout=5).status_code
        while health == 200:
            assert time.monotonic() - killed < 1, "/health still 200 a second after the kill"
            health = httpx.get(server.url + "/health", timeout=5).status_code
        request.join(10)
        assert not request.is_alive(), "the in-flight request hangs"
        for response in (in_flight["response"], server.post("/v1/completions", body)):
            assert response.status_code == 500, response.text
            assert "engine core" in response.json()["error"]["message"]
        assert server.proc.poll() is None
    finally:
        server.stop()


def test_server_without_engine_process(tiny_dir):
    server = RemoteServer("--model", tiny_dir, "--num-kv-blocks", "64", "--no-engine-process")
    try:
        assert engine_children(server.proc.pid) == []
        response = server.post("/v1/completions", {"prompt": "hello", "max_tokens": 3})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3
    finally:
        server.stop()
