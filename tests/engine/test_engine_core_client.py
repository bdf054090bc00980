"""Engine-core clients: the multiprocess client runs the core in another process, over ZMQ
and msgpack, with the same outputs as the in-process one; a core that dies or fails to
start is an error, never a hang."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time

import pytest

from conftest import make_tiny_checkpoint
from tokenmill.config import EngineConfig
from tokenmill.config_resolver import resolve_config
from tokenmill.core.request import RequestStatus
from tokenmill.engine.core_client import EngineDeadError, InprocClient, MPClient
from tokenmill.engine.input_processor import InputProcessor
from tokenmill.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], list(range(100, 130))]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def config(path: str, **kwargs) -> EngineConfig:
    return resolve_config(EngineConfig.from_kwargs(
        model=path, num_kv_blocks=64, block_size=8, max_model_len=256, **kwargs
    ))


def core_requests(cfg: EngineConfig, client, max_tokens: int = 12):
    processor = InputProcessor(cfg, None, client.max_model_len, client.max_prompt_tokens)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [
        child
        for i, ids in enumerate(PROMPTS)
        for child in processor.process(str(i), {"prompt_token_ids": ids}, params).core_requests
    ]


def test_mp_client_runs_in_another_process_with_inproc_outputs(tiny_dir):
    cfg = config(tiny_dir)
    inproc = InprocClient(cfg)
    expected: dict[str, list[int]] = {}
    for request in core_requests(cfg, inproc):
        inproc.add_request(request)
    while inproc.engine_core.has_unfinished_requests():
        for out in inproc.get_output().outputs:
            expected.setdefault(out.req_id, []).extend(out.new_token_ids)

    received: queue.SimpleQueue = queue.SimpleQueue()
    client = MPClient(config(tiny_dir), received.put)
    try:
        assert client.pid != os.getpid() and client.is_alive()
        for request in core_requests(cfg, client):
            client.add_request(request)
        got: dict[str, list[int]] = {}
        finished: set[str] = set()
        while len(finished) < len(PROMPTS):
            outputs = received.get(timeout=60)
            for out in outputs.outputs:
                got.setdefault(out.req_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    finished.add(out.req_id)
        assert got == expected
        stats = client.get_stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    finally:
        client.shutdown()
    assert not client.is_alive()
    with pytest.raises(EngineDeadError, match="shut down"):
        client.abort_requests(["0_0"])


def test_finish_and_abort_reach_the_core(tiny_dir):
    cfg = config(tiny_dir)
    received: queue.SimpleQueue = queue.SimpleQueue()
    client = MPClient(cfg, received.put, in_thread=True)
    try:
        assert client.pid == os.getpid()
        first, second, third = core_requests(cfg, client, max_tokens=200)
        for request in (first, second, third):
            client.add_request(request)
        received.get(timeout=30)
        client.finish_requests([first.request_id], RequestStatus.FINISHED_STOPPED, "stop!")
        client.abort_requests([second.request_id, third.request_id])
        deadline = time.monotonic() + 30
        while client.get_stats()["num_running_requests"] or client.get_stats()["num_waiting_requests"]:
            assert time.monotonic() < deadline
            received.get(timeout=30)
        stats = client.get_stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    finally:
        client.shutdown()


def test_killed_core_is_reported_dead(tiny_dir):
    received: queue.SimpleQueue = queue.SimpleQueue()
    client = MPClient(config(tiny_dir), received.put)
    try:
        os.kill(client.pid, signal.SIGKILL)
        start = time.monotonic()
        error = received.get(timeout=5)
        assert isinstance(error, EngineDeadError), error
        assert time.monotonic() - start < 2
        assert "died with exit code -9" in str(error)
        assert not client.is_alive()
        with pytest.raises(EngineDeadError, match="died"):
            client.add_request(core_requests(config(tiny_dir), client)[0])
    finally:
        client.shutdown()


def test_startup_error_is_raised_in_the_parent(tiny_dir):
    with pytest.raises(ValueError, match="holds no block"):
        MPClient(
            resolve_config(EngineConfig.from_kwargs(model=tiny_dir, kv_cache_memory_bytes=1)),
            lambda _: None,
        )


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_core_process_dies_with_its_parent(tiny_dir):
    script = (
        "import sys, time\n"
        "from tokenmill.config import EngineConfig\n"
        "from tokenmill.config_resolver import resolve_config\n"
        "from tokenmill.engine.core_client import MPClient\n"
        "config = resolve_config(EngineConfig.from_kwargs(model=sys.argv[1], num_kv_blocks=8))\n"
        "print(MPClient(config, lambda _: None).pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script, tiny_dir], stdout=subprocess.PIPE)
    try:
        core_pid = int(parent.stdout.readline())
        assert not _gone(core_pid)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 5
    while not _gone(core_pid):
        assert time.monotonic() < deadline, "the engine core outlived its parent"
        time.sleep(0.05)
