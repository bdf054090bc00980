"""The CPU platform's adaptive thread count (platforms/cpu_threads.py) and the C kernels
following it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
from conftest import make_tiny_checkpoint

from tokenmill import LLM, SamplingParams
from tokenmill.platforms.cpu import CpuPlatform
from tokenmill.platforms.cpu_threads import AdaptiveThreads, Sample, read_idle

CPUS = frozenset(os.sched_getaffinity(0))
TWO_CPUS = frozenset({0, 1})


class Clock:
    """Samples in which, per second, the CPUs were idle ``free`` cores and this process used
    ``ours``."""

    def __init__(self) -> None:
        self.now = Sample(0.0, 0.0, 0.0)

    def advance(self, free: float, ours: float, seconds: float = 1.0) -> Sample:
        n = self.now
        self.now = Sample(n.wall + seconds, n.idle + free * seconds, n.process + ours * seconds)
        return self.now


def chooser(max_threads: int = 2, cpus: frozenset[int] = TWO_CPUS) -> tuple[AdaptiveThreads, Clock]:
    clock = Clock()
    return AdaptiveThreads(max_threads, cpus, sample=lambda _: clock.now), clock


@pytest.mark.parametrize(
    "windows, expected",
    [
        ([(0.0, 2.0)], 2),  # idle machine, both threads computing
        ([(1.9, 0.1)], 2),  # idle machine, engine idle
        ([(0.1, 1.6)], 2),  # the API server used 0.3 of a core: not worth a thread
        ([(0.0, 1.1)], 1),  # a busy process beside two spinning threads
        ([(0.0, 1.1), (0.0, 1.0)], 1),  # it stays
        ([(0.0, 1.1), (0.1, 1.2)], 1),  # a little idle time is not a free core
        ([(0.0, 1.1), (0.9, 1.0)], 2),  # it ended: a core is idle again
        ([(0.0, 0.7)], 1),  # two busy processes: never below one thread
    ],
)
def test_the_count_follows_the_cores_left(windows, expected):
    adaptive, clock = chooser()
    for free, ours in windows:
        adaptive.update(clock.advance(free, ours))
    assert adaptive.threads == expected


def test_the_count_never_exceeds_the_configured_one():
    adaptive, clock = chooser(max_threads=3, cpus=frozenset(range(4)))
    adaptive.update(clock.advance(free=4.0, ours=0.0))
    assert adaptive.threads == 3
    adaptive.update(clock.advance(free=0.0, ours=1.8))
    assert adaptive.threads == 2


def test_a_window_without_time_changes_nothing():
    adaptive, clock = chooser()
    adaptive.update(clock.now)
    assert adaptive.threads == 2


def test_before_step_sets_the_calling_threads_count():
    """torch's thread count is per thread: the step's thread gets it, others keep theirs."""
    adaptive, clock = chooser()
    adaptive.interval = 0.0
    seen = []

    def step() -> None:
        clock.advance(free=0.0, ours=1.0)
        adaptive.before_step()
        seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    worker = threading.Thread(target=step)
    worker.start()
    worker.join()
    assert seen == [1]
    assert torch.get_num_threads() == before


def test_read_idle_matches_psutil():
    per_cpu = psutil.cpu_times(percpu=True)
    expected = sum(per_cpu[c].idle + per_cpu[c].iowait for c in CPUS)
    assert read_idle(CPUS) == pytest.approx(expected, abs=0.05 * len(CPUS) + 0.5)


def busy_processes(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs")
def test_busy_processes_on_every_core_leave_one_thread():
    adaptive = AdaptiveThreads(len(CPUS), CPUS, interval=0.2)
    procs = busy_processes(len(CPUS))
    try:
        deadline = time.monotonic() + 5
        while adaptive.threads > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
            adaptive.before_step()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert adaptive.threads == 1


RECORD_AND_REPLAY = """
import json, time, torch
from tokenmill.ops import cpu as cpu_ops
from tokenmill.platforms.cpu_graph import _Recorder

assert cpu_ops.load() is not None
x, w = torch.randn(1024, 4096), torch.randn(4096)
torch.set_num_threads(2)
with _Recorder() as recorder:
    cpu_ops.rms_norm(x, w, 1e-6)
[(kernel, args)] = recorder.calls
plan = cpu_ops.pack_plan([(kernel.__name__, args)])
split = {}
for threads in (1, 2):
    torch.set_num_threads(threads)
    cpu_ops.run_plan(plan)
    time.sleep(0.05)  # the other thread's spin after the last region of two ends first
    thread, process = time.thread_time(), time.process_time()
    for _ in range(100):
        cpu_ops.run_plan(plan)
    split[threads] = (time.thread_time() - thread, time.process_time() - process)
print(json.dumps(split))
"""


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs")
def test_a_recorded_kernel_call_runs_on_the_calling_threads_count():
    """Plans take no thread count: a decode graph recorded at two threads replays on one
    after ``before_step`` lowered the count. (In a fresh process, so that no other thread of
    the test process adds CPU time.)"""
    out = subprocess.run([sys.executable, "-c", RECORD_AND_REPLAY], capture_output=True, text=True, check=True)
    split = json.loads(out.stdout.strip().splitlines()[-1])
    alone, total = split["1"]
    assert total - alone < 0.1 * alone
    alone, total = split["2"]
    assert total - alone > 0.3 * alone


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs")
def test_the_worker_adapts_before_each_step(tmp_path):
    """The engine steps with all its threads on free cores and with one beside busy ones, and
    its outputs do not change."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(make_tiny_checkpoint(tmp_path), num_kv_blocks=64, block_size=16)
        adaptive = CpuPlatform.adaptive_threads
        assert adaptive is not None and adaptive.max_threads == 2
        clock, busy = Clock(), False
        adaptive._sample, adaptive._mark, adaptive.interval = (
            (lambda _: clock.advance(0.0, 1.0) if busy else clock.advance(2.0, 0.0)), clock.now, 0.0
        )
        params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
        prompt = [{"prompt_token_ids": [1, 2, 3, 4]}]
        ref = llm.generate(prompt, params)[0].outputs[0]
        assert adaptive.threads == 2 and torch.get_num_threads() == 2
        busy = True
        out = llm.generate(prompt, params)[0].outputs[0]
        assert adaptive.threads == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert out.token_ids == ref.token_ids and out.finish_reason == ref.finish_reason
    for got, want in zip(out.logprobs, ref.logprobs):
        assert got.keys() == want.keys()
        for token in got:
            assert got[token].logprob == pytest.approx(want[token].logprob, abs=1e-4)
