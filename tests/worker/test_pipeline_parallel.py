"""Pipeline and expert parallelism on the CPU: the layers split into stages (worker processes
exchanging the residual stream over gloo), the engine core's batch queue keeping a step in
flight per stage, tokens equal to one process's with prefix caching, chunked prefill and
preemption; a killed stage fails the requests fast, naming its rank; MoE experts sharded over
ranks with either all-to-all backend give one process's tokens; the settings either cannot run
are refused by name."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from support.deepseek_checkpoints import save_deepseek, write_mtp_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.config_resolver import resolve_config
from tokenmill.distributed.device_communicator import ALL2ALL_BACKENDS, DeviceCommunicator
from tokenmill.distributed.parallel_state import (
    destroy_distributed_environment,
    get_pp_indices,
    init_distributed_environment,
)
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.interfaces.build_context import BuildContext
from tokenmill.layers.build_context import model_build_context
from tokenmill.layers.fused_moe import FusedMoE
from tokenmill.testing.checkpoints import random_prompts, save_tiny_checkpoint
from tokenmill.worker.multiproc_executor import get_open_port
from worker.test_distributed import (
    kill_mid_stream,
    SMALL_CACHE,
    alive,
    generate,
    run_rounds,
    run_rounds_async,
    shutdown,
    start_local_ray,
    worker_processes,
)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """A 3-layer Llama with a tied LM head (the last stage loads the embedding's weight
    without holding the embedding) and DeepSeek-V3 (a dense then an MoE layer) with an MTP
    layer."""
    root = tmp_path_factory.mktemp("pp")
    llama = save_tiny_checkpoint(
        "LlamaForCausalLM", root / "llama", num_hidden_layers=3, tie_word_embeddings=True, attention_bias=True
    )
    write_mtp_checkpoint(root / "deepseek")
    return {"llama": str(llama), "deepseek-v3-mtp": str(root / "deepseek")}


def overlap_s(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds during which both ranks were busy."""
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def test_stage_layers_even_remainder_before_the_last_or_as_partitioned(monkeypatch):
    assert [get_pp_indices(30, r, 2) for r in range(2)] == [(0, 15), (15, 30)]
    assert [get_pp_indices(5, r, 3) for r in range(3)] == [(0, 2), (2, 4), (4, 5)]
    monkeypatch.setenv("TOKENMILL_PP_LAYER_PARTITION", "10,20")
    assert [get_pp_indices(30, r, 2) for r in range(2)] == [(0, 10), (10, 30)]


def test_settings_pipeline_parallelism_cannot_honour_are_refused(tiny_models, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"distributed_executor_backend='uni' runs one worker.*pipeline_parallel_size=2 needs 'mp' or 'ray'$"):
        EngineConfig(pipeline_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match=r"pipeline parallelism with enable_lora is not implemented yet \(pipeline_parallel_size=2\)"):
        EngineConfig(pipeline_parallel_size=2, enable_lora=True)
    llama = tiny_models["llama"]
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=4 is larger than the model's 3 layers"):
        resolve_config(EngineConfig(model=llama, pipeline_parallel_size=4))
    monkeypatch.setenv("TOKENMILL_PP_LAYER_PARTITION", "1,1")
    with pytest.raises(ValueError, match=r"TOKENMILL_PP_LAYER_PARTITION='1,1' must give each of the pipeline_parallel_size=2 stages at least one layer, 3 in all"):
        resolve_config(EngineConfig(model=llama, pipeline_parallel_size=2))
    monkeypatch.delenv("TOKENMILL_PP_LAYER_PARTITION")
    config = json.loads((Path(llama) / "config.json").read_text())
    config["architectures"] = ["EagleLlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2: model EagleLlamaForCausalLM does not support pipeline parallelism"):
        resolve_config(EngineConfig(model=str(tmp_path), pipeline_parallel_size=2))
    assert resolve_config(EngineConfig(model=llama, pipeline_parallel_size=3)).executor_backend == "mp"


def test_pp2_llama_matches_one_process_with_the_stages_overlapping(tiny_models, monkeypatch):
    """Stages of 1 and 2 layers (an explicit partition), chunked prefill: one process's tokens
    and stats with preemption and prefix hits. The KV cache is sized per stage: the budget of
    16 blocks of the larger stage's 2 layers gives 16 blocks (10 over all 3 layers). Both
    stages were busy at once; no worker outlives the engine."""
    path = tiny_models["llama"]
    args = dict(SMALL_CACHE, long_prefill_token_threshold=16, enforce_eager=True)
    reference = LLM(path, **args)
    expected, expected_stats = run_rounds(reference)
    assert expected_stats["num_preemptions"] > 0 and expected_stats["prefix_cache_hit_tokens"] > 0
    specs = reference.llm_engine.engine_core.engine_core.executor.get_kv_cache_specs()
    layer_bytes = next(iter(specs.values())).page_size_bytes
    monkeypatch.setenv("TOKENMILL_PP_LAYER_PARTITION", "1,2")
    pp_args = {k: v for k, v in args.items() if k != "num_kv_blocks"}
    llm = LLM(path, pipeline_parallel_size=2, kv_cache_memory_bytes=16 * 2 * layer_bytes, **pp_args)
    core = llm.llm_engine.engine_core.engine_core
    workers = worker_processes(os.getpid())
    try:
        assert len(workers) == 2
        tokens, stats = run_rounds(llm)
        assert tokens == expected
        for key in ("num_preemptions", "prefix_cache_hit_tokens", "kv_blocks_total"):
            assert stats[key] == expected_stats[key], key
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == 16
        first, last = core.executor.step_intervals()
        assert overlap_s(first, last) > 0
        assert not core.scheduler.in_flight and not core.batch_queue
    finally:
        shutdown(llm)
    assert not any(alive(p) for p in workers)


def test_pp2_deepseek_v3_with_mtp_matches_one_process(tiny_models):
    """The dense layer and the embedding on the first stage, MLA and the MoE layer on the
    second, which also runs the MTP layer's drafts (verified there; the first stage gets them
    in the scheduler output): one process's tokens (without drafts too), with drafts,
    preemptions and prefix hits; every block comes back."""
    path = tiny_models["deepseek-v3-mtp"]
    spec = {"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 0}
    plain, _ = run_rounds(LLM(path, **SMALL_CACHE))
    expected, expected_stats = run_rounds(LLM(path, speculative_config=spec, **SMALL_CACHE))
    assert expected == plain and expected_stats["spec_num_drafts"] > 0
    llm = LLM(path, pipeline_parallel_size=2, speculative_config=spec, **SMALL_CACHE)
    try:
        tokens, stats = run_rounds(llm)
        assert tokens == expected
        # The batch queue runs the stages on different steps, so which request is preempted
        # when (and so how many drafts there are) may differ from one process.
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0 and stats["spec_num_drafts"] > 0
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == expected_stats["kv_blocks_total"]
    finally:
        shutdown(llm)


def test_pp2_behind_the_engine_process_then_a_stage_is_killed(tiny_models):
    """Served from the engine-core process: one process's tokens. Then a killed last stage
    fails the in-flight stream within seconds naming its rank and stage; nothing is left."""
    path = tiny_models["llama"]
    expected, _ = run_rounds(LLM(path, **SMALL_CACHE))

    async def run() -> None:
        engine = AsyncLLM.from_engine_args(model=path, pipeline_parallel_size=2, **SMALL_CACHE)
        try:
            assert await run_rounds_async(engine) == expected
            core_pid = engine.engine_core.pid
            workers = worker_processes(core_pid)
            assert len(workers) == 2
            await kill_mid_stream(engine, max(workers), r"worker rank 1 \(pipeline stage 1, tensor-parallel rank 0\) \(pid \d+\) was killed by signal 9")
            deadline = time.monotonic() + 5
            while engine.is_running() or any(alive(p) for p in workers + [core_pid]):
                assert time.monotonic() < deadline, "engine or workers still alive"
                await asyncio.sleep(0.1)
        finally:
            engine.shutdown()

    asyncio.run(run())


@pytest.mark.slow
def test_pp2_on_ray_matches_one_process_then_a_stage_dies(tiny_models, monkeypatch):
    """Two stages as Ray actors on a local cluster the test starts, through the same batch
    queue as ``mp`` (chunked prefill): one process's tokens and stats with preemption and
    prefix hits, both stages busy at once. Then the last stage's actor is killed mid-request:
    the next step fails within seconds naming its rank and stage, and every actor and the
    placement are released. (Starting Ray takes seconds: slow.)"""
    path = tiny_models["llama"]
    args = dict(SMALL_CACHE, long_prefill_token_threshold=16, enforce_eager=True)
    expected, expected_stats = run_rounds(LLM(path, **args))
    monkeypatch.setenv("TOKENMILL_PP_LAYER_PARTITION", "1,2")
    ray = start_local_ray(monkeypatch)
    try:
        llm = LLM(path, pipeline_parallel_size=2, distributed_executor_backend="ray", **args)
        core = llm.llm_engine.engine_core.engine_core
        executor = core.executor
        try:
            tokens, stats = run_rounds(llm)
            assert tokens == expected
            for key in ("num_preemptions", "prefix_cache_hit_tokens", "kv_blocks_total"):
                assert stats[key] == expected_stats[key], key
            assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
            first, last = executor.step_intervals()
            assert overlap_s(first, last) > 0

            engine = llm.llm_engine
            params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
            engine.add_request("doomed", {"prompt_token_ids": [1, 2, 3]}, params)
            while not engine.step():
                pass
            ray.kill(executor.workers[1])
            start = time.monotonic()
            with pytest.raises(RuntimeError, match=r"worker rank 1 \(pipeline stage 1, tensor-parallel rank 0\) \(Ray actor\) died during execute_model"):
                while engine.has_unfinished_requests():
                    engine.step()
            assert time.monotonic() - start < 5
        finally:
            shutdown(llm)
        deadline = time.monotonic() + 10
        while ray.available_resources().get("CPU") != 2:
            assert time.monotonic() < deadline, ray.available_resources()
            time.sleep(0.1)
    finally:
        ray.shutdown()


DEFAULT_MODEL_PROMPTS = random_prompts(49152, (7, 19, 33, 50, 3, 26), seed=2)
DEFAULT_MODEL_ARGS = dict(block_size=16, max_model_len=512, num_kv_blocks=128)


@pytest.mark.parametrize(
    "parallel",
    [
        pytest.param(dict(pipeline_parallel_size=2), id="pp2", marks=pytest.mark.slow),
        pytest.param(dict(tensor_parallel_size=3, pipeline_parallel_size=2), id="tp3xpp2", marks=pytest.mark.slow),
    ],
)
def test_default_model_pipeline_matches_one_process(default_model_dir, parallel):
    """The default model's 30 layers as 2 stages of 15 (of 3 tensor-parallel ranks each in
    the second case, 6 processes): 6 prompts x 16 tokens equal one process's (over 60 s on
    2 cores: slow)."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = generate(LLM(**DEFAULT_MODEL_ARGS), DEFAULT_MODEL_PROMPTS, params)
    llm = LLM(**parallel, **DEFAULT_MODEL_ARGS)
    try:
        assert generate(llm, DEFAULT_MODEL_PROMPTS, params) == expected
        stats = llm.get_stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == 128
    finally:
        shutdown(llm)


def test_expert_parallel_settings_are_refused(tmp_path):
    path = save_deepseek(tmp_path / "six", "v3", n_routed_experts=6, n_group=2, topk_group=1)[0]
    with pytest.raises(ValueError, match=r"enable_expert_parallel: the model's 6 routed experts are not divisible by the expert-parallel size 4"):
        resolve_config(EngineConfig(model=path, tensor_parallel_size=4, enable_expert_parallel=True))
    llama = save_tiny_checkpoint("LlamaForCausalLM", tmp_path / "llama")
    with pytest.raises(ValueError, match=r"enable_expert_parallel: the model has no routed experts"):
        resolve_config(EngineConfig(model=str(llama), enable_expert_parallel=True))
    with pytest.raises(ValueError, match=r"all2all_backend must be one of naive, all_to_all, got 'pplx'"):
        EngineConfig(all2all_backend="pplx")


def test_ep2_deepseek_v3_matches_one_process_then_an_expert_rank_is_killed(tmp_path):
    """32 experts, 16 whole ones per rank, tokens dispatched by a true all-to-all (the
    shared expert still sliced by tensor parallelism): one process's tokens, preemptions and
    prefix hits; every block comes back. (The naive backend: the test below.) Then the rank
    holding experts 16-31 is killed mid-request: the next step fails within seconds naming
    it (its peer, blocked in the all-to-all, is killed too)."""
    path = save_deepseek(tmp_path / "ep", "v3", n_routed_experts=32)[0]
    expected, expected_stats = run_rounds(LLM(path, **SMALL_CACHE))
    llm = LLM(path, tensor_parallel_size=2, enable_expert_parallel=True, all2all_backend="all_to_all", **SMALL_CACHE)
    workers = worker_processes(os.getpid())
    try:
        tokens, stats = run_rounds(llm)
        assert tokens == expected
        for key in ("num_preemptions", "prefix_cache_hit_tokens", "kv_blocks_total"):
            assert stats[key] == expected_stats[key], key
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]

        engine = llm.llm_engine
        params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        engine.add_request("doomed", {"prompt_token_ids": [1, 2, 3]}, params)
        while not engine.step():
            pass
        os.kill(max(workers), signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"tensor-parallel worker rank 1 \(pid \d+\) was killed by signal 9 during execute_model"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 5
    finally:
        shutdown(llm)
    assert not any(alive(p) for p in workers)


def _moe_rank(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    results = {}
    for backend in ALL2ALL_BACKENDS:
        init_distributed_environment(
            "gloo", f"tcp://127.0.0.1:{port}", rank, 2, 1, DeviceCommunicator, torch.device("cpu"), backend
        )
        results[backend] = moe_outputs(expert_parallel=True)
        destroy_distributed_environment()
        port += 1
    if rank == 0:
        torch.save(results, out)


def moe_outputs(expert_parallel: bool) -> list[torch.Tensor]:
    """A DeepSeek-V3-style MoE layer's output for 1, 7 (not a multiple of the ranks) and 16
    tokens."""
    layer, inputs = moe_layer(expert_parallel)
    return [layer(x, logits) for x, logits in inputs]


def moe_layer(expert_parallel: bool) -> tuple[FusedMoE, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A DeepSeek-V3-style MoE layer of 8 experts (this rank's, with ``expert_parallel``) and
    its inputs of 1, 7 and 16 tokens, the same on every rank."""
    torch.manual_seed(0)
    with model_build_context(BuildContext(None, enable_expert_parallel=expert_parallel)):
        layer = FusedMoE(8, 2, 16, 8, scoring_func="sigmoid", renormalize=True, num_expert_group=4, topk_group=2)
    w13, w2 = torch.randn(8, 16, 16), torch.randn(8, 16, 8)
    for e in range(8):
        layer.weight_loader(layer.w13_weight, w13[e, :8], e, "w1")
        layer.weight_loader(layer.w13_weight, w13[e, 8:], e, "w3")
        layer.weight_loader(layer.w2_weight, w2[e], e, "w2")
    return layer, [(torch.randn(n, 16), torch.randn(n, 8)) for n in (1, 7, 16)]


def test_all2all_backends_give_the_single_process_moe_output(tmp_path):
    """Two gloo ranks of 4 experts each: every all-to-all backend's MoE output equals the
    layer's on one process holding all 8."""
    expected = moe_outputs(expert_parallel=False)
    out = tmp_path / "ep.pt"
    mp.spawn(_moe_rank, args=(get_open_port(), str(out)), nprocs=2)
    results = torch.load(out)
    assert set(results) == set(ALL2ALL_BACKENDS)
    for backend, outputs in results.items():
        for got, want in zip(outputs, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=backend)
