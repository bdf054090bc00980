"""DP attention + EP MoE: data-parallel engine cores whose workers form one expert-parallel
group and step together (an idle core runs dummy steps so the MoE collectives meet)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import zmq
from prometheus_client import CollectorRegistry

from conftest import save_byte_tokenizer
from support.deepseek_checkpoints import save_deepseek
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.config_resolver import resolve_config
from tokenmill.distributed.device_communicator import ALL2ALL_BACKENDS, DeviceCommunicator
from tokenmill.distributed import parallel_state
from tokenmill.distributed.parallel_state import (
    destroy_distributed_environment,
    init_distributed_environment,
)
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.engine.core_proc import SHUTDOWN, EngineCoreProc, encoder
from tokenmill.engine.engine_core import EngineCoreOutputs
from tokenmill.engine.output_processor import RequestOutputKind
from tokenmill.entrypoints.openai.metrics import EngineStatsCollector
from tokenmill.worker.multiproc_executor import get_open_port
from worker.test_distributed import (
    kill_mid_stream,
    ROUND_PARAMS,
    ROUND_PROMPTS,
    SMALL_CACHE,
    alive,
    child_processes,
    engine_samples,
    run_rounds,
    run_rounds_async,
    worker_processes,
)
from worker.test_pipeline_parallel import moe_layer


def _core_rank(core: int, port: int, out: str) -> None:
    """Core 0 runs the layer on 1, 7 and 16 tokens; core 1 on none (dummy steps), then on
    5 tokens while core 0 runs 16 (unequal counts)."""
    torch.set_num_threads(1)
    results = {}
    for backend in ALL2ALL_BACKENDS:
        init_distributed_environment(
            "gloo", f"tcp://127.0.0.1:{port}", 0, 1, 1, DeviceCommunicator, torch.device("cpu"),
            backend, expert_parallel_cores=2, core_index=core,
        )
        layer, inputs = moe_layer(expert_parallel=True)
        got = []
        for x, logits in inputs:
            if core == 0:
                got.append(layer(x, logits))
            else:
                layer.dummy_forward(torch.float32, torch.device("cpu"))
        x, logits = inputs[-1]
        got.append(layer(x, logits) if core == 0 else layer(x[:5], logits[:5]))
        results[backend] = got
        destroy_distributed_environment()
        port += 1
    torch.save(results, f"{out}.{core}")


def test_moe_across_two_cores_with_one_idle_then_unequal_token_counts(tmp_path):
    """Two engine cores of one rank each, 4 of 8 experts each: the busy core's MoE output
    equals one process's while the idle core runs dummy steps, and both cores' outputs do
    when they bring 16 and 5 tokens, with every all-to-all backend."""
    layer, inputs = moe_layer(expert_parallel=False)
    expected = [layer(x, logits) for x, logits in inputs]
    out = str(tmp_path / "ep")
    mp.spawn(_core_rank, args=(get_open_port(), out), nprocs=2)
    results = [torch.load(f"{out}.{core}") for core in (0, 1)]
    for backend in ALL2ALL_BACKENDS:
        busy, idle = results[0][backend], results[1][backend]
        for got, want in zip(busy, expected + [expected[-1]]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=backend)
        assert len(idle) == 1
        torch.testing.assert_close(idle[0], expected[-1][:5], rtol=1e-5, atol=1e-5, msg=backend)


class _ScriptedCore:
    """An engine core whose steps follow a script: each entry says whether the step sends
    anything to the workers (a step waiting for a grammar to compile sends nothing). Every
    step that does and every dummy step is one MoE collective over the cores' group."""

    def __init__(self, script: list[bool]) -> None:
        self.script = script
        self.num_executed_steps = 0
        self.num_dummy_steps = 0

    def has_unfinished_requests(self) -> bool:
        return bool(self.script)

    def step(self) -> EngineCoreOutputs:
        if self.script.pop(0):
            self._moe_collective()
        return EngineCoreOutputs()

    def execute_dummy_batch(self) -> None:
        self.num_dummy_steps += 1
        self._moe_collective()

    def _moe_collective(self) -> None:
        self.num_executed_steps += 1
        dist.all_reduce(torch.ones(1))

    def abort_all_requests(self) -> list[str]:
        self.script.clear()
        return []

    def get_stats(self) -> dict[str, int]:
        return {}


class _Input:
    """An input socket that delivers a shutdown once ``core`` has finished its script."""

    def __init__(self, core: _ScriptedCore) -> None:
        self.core = core
        self.sent = False

    def poll(self, timeout_ms: int) -> bool:
        return not self.core.script and not self.sent

    def recv_multipart(self, flags: int) -> list[bytes]:
        if self.core.script or self.sent:
            raise zmq.Again()
        self.sent = True
        return [SHUTDOWN, encoder.encode(None)]


class _Output:
    def send_multipart(self, frames: list[bytes]) -> None:
        pass


def _scripted_core(core_index: int, port: int, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=core_index, world_size=2,
        timeout=timedelta(seconds=20),
    )
    core = _ScriptedCore([False, True, True, False, True] if core_index == 0 else [])
    EngineCoreProc(core, _Input(core), _Output(), None, dist.group.WORLD).run_busy_loop()  # type: ignore[arg-type]
    torch.save((core.num_executed_steps, core.num_dummy_steps), f"{out}.{core_index}")
    dist.destroy_process_group()


def test_cores_meet_every_moe_collective_with_dummy_steps_and_stop_together(tmp_path):
    """Core 0 steps five times, two of them sending nothing to its workers; core 1 has no
    requests: core 1 runs a dummy step for each of core 0's steps, core 0 one for each step
    of its own that sent nothing, so both meet the same five MoE collectives (a missing
    dummy step would leave the other core waiting until the gloo timeout); then both leave
    together."""
    out = str(tmp_path / "steps")
    mp.spawn(_scripted_core, args=(get_open_port(), out), nprocs=2)
    assert torch.load(f"{out}.0") == (5, 2)
    assert torch.load(f"{out}.1") == (5, 5)


class _Frames:
    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def send_multipart(self, frames: list[bytes]) -> None:
        self.frames += frames


def _core_beside_a_dead_one(core_index: int, port: int, out: str) -> None:
    """Core 1 leaves at once (its expert-parallel rank dies); core 0, with requests, finds
    the step agreement broken and reports to the front end."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=core_index, world_size=2,
        timeout=timedelta(seconds=20),
    )
    pids = torch.zeros(2, dtype=torch.int64)
    pids[core_index] = os.getpid()
    dist.all_reduce(pids)
    if core_index == 1:
        os._exit(0)
    parallel_state._EP_PIDS = pids.tolist()
    core = _ScriptedCore([True] * 3)
    core.executor = parallel_state  # type: ignore[attr-defined]  # its dead_expert_parallel_ranks
    output = _Frames()
    with pytest.raises(RuntimeError):
        EngineCoreProc(core, _Input(core), output, None, dist.group.WORLD).run_busy_loop()  # type: ignore[arg-type]
    Path(out).write_bytes(b"".join(output.frames))
    dist.destroy_process_group()


def test_a_core_that_loses_another_names_the_dead_expert_rank(tmp_path):
    """The step agreement breaks before any MoE collective does (core 0's workers are idle):
    core 0 fails its requests naming the expert-parallel rank whose process is gone, as a
    broken collective does (in CI the message named no rank)."""
    out = tmp_path / "outputs"
    mp.spawn(_core_beside_a_dead_one, args=(get_open_port(), str(out)), nprocs=2)
    sent = out.read_bytes()
    assert b"expert-parallel rank 1 (pid " in sent and b"died; the data-parallel engine cores" in sent, sent


def _children() -> set[int]:
    """This process's live children started by multiprocessing's spawn."""
    return set(child_processes(os.getpid(), b"spawn_main"))


def test_a_core_that_dies_while_starting_stops_the_others_start(tmp_path):
    """One of two engine cores is killed as soon as it is spawned: the other, whose worker
    waits for the dead one's in the expert-parallel group's set-up, is stopped at once (it
    waited for the group's 5-minute set-up timeout before), and the start fails naming the
    dead core; no process is left."""
    path = save_deepseek(tmp_path / "m", "v3", n_routed_experts=32)[0]
    before = _children()
    killed: list[int] = []

    def kill_one() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            cores = _children() - before
            if len(cores) == 2:
                killed.append(min(cores))
                os.kill(killed[0], 9)
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_one)
    killer.start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"the engine core \(.*\) died with exit code -9 while starting"):
        AsyncLLM.from_engine_args(model=path, data_parallel_size=2, enable_expert_parallel=True, **SMALL_CACHE)
    assert time.monotonic() - start < 30
    killer.join()
    assert killed
    deadline = time.monotonic() + 10
    while _children() - before:
        assert time.monotonic() < deadline, _children() - before
        time.sleep(0.1)


def test_settings_experts_across_data_parallel_cores_cannot_honour_are_refused(tmp_path):
    path = save_deepseek(tmp_path / "m", "v3", n_routed_experts=6, n_group=2, topk_group=1)[0]
    with pytest.raises(ValueError, match=r"6 routed experts are not divisible by the expert-parallel size 4 \(tensor_parallel_size=2 x data_parallel_size=2\)"):
        resolve_config(EngineConfig(model=path, tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True))
    for name, value in (
        ("data_parallel_backend", "ray"),
        ("distributed_executor_backend", "uni"),
        ("pipeline_parallel_size", 2),
        ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2}),
    ):
        with pytest.raises(ValueError, match=rf"enable_expert_parallel with data_parallel_size=2 and {name}=.* is not implemented"):
            EngineConfig(data_parallel_size=2, enable_expert_parallel=True, **{name: value})
    assert EngineConfig(data_parallel_size=2, enable_expert_parallel=True).executor_backend == "mp"


async def generate_one(engine: AsyncLLM, prompt: list[int]) -> list[int]:
    async for out in engine.generate(
        {"prompt_token_ids": prompt}, ROUND_PARAMS, output_kind=RequestOutputKind.FINAL_ONLY
    ):
        last = out
    return list(last.outputs[0].token_ids)


def test_dp2_ep2_deepseek_v3_matches_one_process_then_an_expert_rank_is_killed(tmp_path):
    """Two engine cores of one worker each, 16 of the 32 experts each (chunked prefill,
    prefix caching, a KV cache small enough to preempt). One request at a time first: each
    goes to core 0, and core 1, which has none, keeps meeting its MoE collectives with dummy
    steps; then all at once, over both cores. Tokens equal one process's, every block comes
    back. Then core 1's worker (expert-parallel rank 1) is killed while core 0 streams: the
    stream fails within seconds naming the rank, and no process is left."""
    path = save_deepseek(tmp_path / "m", "v3", n_routed_experts=32)[0]
    args = dict(SMALL_CACHE, long_prefill_token_threshold=16)
    expected, expected_stats = run_rounds(LLM(path, **args))

    async def run() -> None:
        engine = AsyncLLM.from_engine_args(
            model=path, data_parallel_size=2, enable_expert_parallel=True, **args
        )
        cores = engine.engine_core.cores
        workers = [worker_processes(core.pid) for core in cores]
        try:
            assert [len(w) for w in workers] == [1, 1]
            one_at_a_time = [await generate_one(engine, p) for p in ROUND_PROMPTS]
            assert one_at_a_time == expected[: len(ROUND_PROMPTS)]
            first, second = engine.engine_core.get_engine_stats()
            assert first["num_requests_routed"] == len(ROUND_PROMPTS) and second["num_requests_routed"] == 0

            assert await run_rounds_async(engine) == expected
            per_core = engine.engine_core.get_engine_stats()
            assert per_core[1]["num_dummy_steps"] > 0, per_core
            registry = CollectorRegistry()
            registry.register(
                EngineStatsCollector(engine.engine_core.get_stats, engine.engine_core.get_engine_stats, "m", "vllm")
            )
            dummy = [
                registry.get_sample_value("tokenmill:num_dummy_steps_total", {"engine": str(i), "model_name": "m"})
                for i in range(2)
            ]
            assert dummy[1] is not None and dummy[1] >= per_core[1]["num_dummy_steps"] > 0, dummy
            assert all(s["num_requests_routed"] > len(ROUND_PROMPTS) // 4 for s in per_core[1:]), per_core
            assert sum(s["num_preemptions"] for s in per_core) > 0
            assert sum(s["prefix_cache_hit_tokens"] for s in per_core) > 0
            assert all(s["kv_blocks_free"] == s["kv_blocks_total"] for s in per_core), per_core

            await kill_mid_stream(engine, workers[1][0], r"expert-parallel rank 1 .*(was killed by signal 9|died)")
        finally:
            engine.shutdown()
        pids = [core.pid for core in cores] + [p for w in workers for p in w]
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids):
            assert time.monotonic() < deadline, [p for p in pids if alive(p)]
            await asyncio.sleep(0.1)

    asyncio.run(run())


@pytest.mark.slow
def test_serve_dp2_ep2_matches_one_process(tmp_path):
    """``tokenmill serve --data-parallel-size 2 --enable-expert-parallel``: concurrent
    greedy completions, spread over both cores, read as one process's. (A server and 5
    processes: slow.)"""
    from server.test_server import RemoteServer

    path = save_deepseek(tmp_path / "m", "v3", n_routed_experts=32)[0]
    save_byte_tokenizer(path)
    prompts = [f"request {i}: " + "x" * (3 * i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].text for o in LLM(path, max_model_len=256).generate(prompts, params, use_tqdm=False)]
    server = RemoteServer(
        "--model", path, "--data-parallel-size", "2", "--enable-expert-parallel", "--max-model-len", "256"
    )
    try:
        client = server.async_client()

        async def run_all() -> list[str]:
            results = await asyncio.gather(
                *(
                    client.completions.create(model=path, prompt=p, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
                    for p in prompts
                )
            )
            return [r.choices[0].text for r in results]

        assert asyncio.run(run_all()) == expected
        routed = engine_samples(server, "tokenmill:num_requests_routed_total")
        assert set(routed) == {"0", "1"} and all(n > 0 for n in routed.values()), routed
    finally:
        server.stop()


@pytest.mark.slow
def test_tp2_x_dp2_ep4_deepseek_v3_matches_one_process(tmp_path):
    """Two engine cores of two tensor-parallel workers each: 8 of the 32 experts per rank,
    moved by the true all-to-all; one process's tokens with preemption and prefix hits, and
    every block back. (6 processes on 2 cores: slow.)"""
    path = save_deepseek(tmp_path / "m", "v3", n_routed_experts=32)[0]
    expected, _ = run_rounds(LLM(path, **SMALL_CACHE))

    async def run() -> None:
        engine = AsyncLLM.from_engine_args(
            model=path, data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True,
            all2all_backend="all_to_all", **SMALL_CACHE,
        )
        try:
            assert await run_rounds_async(engine) == expected
            per_core = engine.engine_core.get_engine_stats()
            assert all(s["num_requests_routed"] > 0 for s in per_core), per_core
            assert sum(s["num_preemptions"] for s in per_core) > 0
            assert sum(s["prefix_cache_hit_tokens"] for s in per_core) > 0
            assert all(s["kv_blocks_free"] == s["kv_blocks_total"] for s in per_core), per_core
        finally:
            engine.shutdown()

    asyncio.run(run())
