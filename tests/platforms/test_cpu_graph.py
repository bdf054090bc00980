"""CPU decode graphs (``platforms/cpu_graph.py``): captured where a decode forward is only C kernel
calls, refused where it runs torch compute, and a replayed step gives the eager engine's
tokens, padded batch sizes included."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.interfaces.decode_graph import DecodeGraphRunner
from tokenmill.platforms.cpu_graph import MAX_SIZE, CpuGraphRunner
from tokenmill.quant.fp8 import Fp8LinearMethod

ENGINE = dict(block_size=8, max_model_len=256, num_kv_blocks=640, enable_prefix_caching=False)
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(5 + 3 * (i % 18))] for i in range(MAX_SIZE + 2)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")


def graph_runner(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.graphs


def generate(llm: LLM, n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:n]], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny) -> dict[str, str]:
    """Llama, Qwen2 (biased q/k/v) and Mistral with a sliding window shorter than the prompts."""
    return {
        "llama": tiny,
        "qwen2": make_tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2"),
        "mistral-window": make_tiny_checkpoint(tmp_path_factory.mktemp("mistral"), "mistral", sliding_window=12),
    }


@pytest.mark.parametrize(
    "arch, quantization",
    [("llama", "int8"), ("llama", "w8a8"), ("llama", "fp8"), ("qwen2", "int8"), ("mistral-window", "int8")],
)
def test_replays_give_the_eager_tokens(checkpoints, arch, quantization, monkeypatch, tokenmill_log):
    model = checkpoints[arch]
    llm = LLM(model=model, quantization=quantization, **ENGINE)
    runner = graph_runner(llm)
    # FP8 dequantizes its weights for a float GEMM from Fp8LinearMethod.gemm_rows rows on.
    largest = MAX_SIZE if quantization != "fp8" else min(MAX_SIZE, Fp8LinearMethod.gemm_rows - 1)
    sizes = [s for s in CpuGraphRunner.sizes_for(MAX_SIZE) if s <= largest]
    assert isinstance(runner, CpuGraphRunner) and sorted(runner.graphs) == sizes
    steps_of = f"CPU decode graphs for steps of {', '.join(map(str, sizes))} tokens"
    assert any(m.startswith(steps_of) for _, _, m in tokenmill_log)
    size_of = {id(graph): size for size, graph in runner.graphs.items()}
    replayed: list[int] = []
    replay = CpuGraphRunner.replay
    monkeypatch.setattr(
        CpuGraphRunner, "replay", lambda self, graph: (replayed.append(size_of[id(graph)]), replay(self, graph))
    )
    eager = LLM(model=model, quantization=quantization, enforce_eager=True, **ENGINE)
    assert graph_runner(eager) is None
    for n in (1, 3, 18, largest, MAX_SIZE + 2):
        assert generate(llm, n) == generate(eager, n), f"{n} requests"
    # Decode steps of 1, 3 and `largest` requests replay their own graphs, 18 the graph of 20
    # (padded); more run eagerly.
    assert {1, 3, largest} <= set(replayed)
    assert 20 in replayed or largest < 20


def test_smaller_graphs_allocate_on_the_largest_graphs_memory(tiny):
    """The graphs' intermediate tensors take the largest graph's memory, not every size's: each
    smaller graph's allocations lie on the largest's storages, a distinct one each."""
    llm = LLM(model=tiny, quantization="int8", **ENGINE)
    runner = graph_runner(llm)
    largest = runner.graphs[MAX_SIZE]
    pool = {t.untyped_storage().data_ptr() for t in largest.allocations}
    assert len(pool) == len(largest.allocations) > 0
    for size, graph in runner.graphs.items():
        storages = [t.untyped_storage().data_ptr() for t in graph.allocations]
        assert len(storages) == len(largest.allocations) and set(storages) == pool, size


def test_graph_sizes_are_every_size_to_16_then_every_4th_to_32_then_every_8th():
    assert CpuGraphRunner.sizes_for(10) == list(range(1, 11))
    assert CpuGraphRunner.sizes_for(30) == [*range(1, 17), 20, 24, 28, 30]
    assert CpuGraphRunner.sizes_for(1000) == [*range(1, 17), 20, 24, 28, 32, 40, 48, 56, 64]


def test_float32_decode_is_captured_while_it_streams_the_weights(tiny):
    """Float32 layers multiply up to STREAM_MAX_ROWS rows by the C kernel, so those decode
    sizes are graphs; above it oneDNN runs and the capture stops."""
    from tokenmill.platforms.cpu_linear import STREAM_MAX_ROWS

    llm = LLM(model=tiny, **ENGINE)
    runner = graph_runner(llm)
    assert runner is not None and max(runner.graphs) == STREAM_MAX_ROWS
    eager = LLM(model=tiny, enforce_eager=True, **ENGINE)
    for n in (1, 3):
        assert generate(llm, n) == generate(eager, n)


def test_a_torch_op_in_the_forward_runs_eagerly(tiny, tokenmill_log, monkeypatch):
    """An op-table entry that computes in torch (here SiLU-and-mul) refuses the capture, by the
    name of its first op."""
    from tokenmill.platforms.cpu import CpuPlatform

    monkeypatch.setitem(CpuPlatform.custom_ops, "silu_and_mul", lambda layer, x: layer.forward_native(x))
    llm = LLM(model=tiny, quantization="int8", **ENGINE)
    assert graph_runner(llm) is None
    assert any("CPU decode graphs off: the forward runs torch op aten.silu" in m for _, _, m in tokenmill_log)
    assert generate(llm, 2) == generate(LLM(model=tiny, quantization="int8", enforce_eager=True, **ENGINE), 2)


def test_a_float8_kv_cache_runs_eagerly(tiny, tokenmill_log):
    """A float8 KV cache is written by torch (the valid-slot mask, quantize, index_copy_): the
    capture of the padded dummy batch runs, and stops at the first of those ops, the mask's
    ``ge``."""
    llm = LLM(model=tiny, quantization="int8", kv_cache_dtype="fp8", **ENGINE)
    assert graph_runner(llm) is None
    assert any(
        "CPU decode graphs off: the forward runs torch op aten.ge" in m
        for _, _, m in tokenmill_log
    )
    eager = LLM(model=tiny, quantization="int8", kv_cache_dtype="fp8", enforce_eager=True, **ENGINE)
    assert generate(llm, 3) == generate(eager, 3)


def test_kernel_calls_of_other_threads_are_not_recorded():
    """Another engine running in another thread while one captures: its calls run, unrecorded."""
    import threading

    import torch

    from tokenmill.ops import cpu as cpu_ops
    from tokenmill.platforms.cpu_graph import _Recorder

    x, weight = torch.randn(2, 16), torch.ones(16)
    with _Recorder() as recorder:
        other = threading.Thread(target=cpu_ops.rms_norm, args=(x, weight, 1e-5))
        other.start()
        other.join()
        cpu_ops.silu_and_mul(x)
    assert [kernel.__name__ for kernel, _ in recorder.calls] == ["silu_and_mul"]


def test_calculated_kv_scales_come_from_a_real_step(tiny, tokenmill_log):
    """A capture's dummy batch must not be the first step ``calculate_kv_scales`` reads."""
    llm = LLM(model=tiny, quantization="int8", kv_cache_dtype="fp8", calculate_kv_scales=True, **ENGINE)
    assert graph_runner(llm) is None
    assert any("decode graphs off: calculate_kv_scales" in m for _, _, m in tokenmill_log)
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    assert all(layer.impl.k_scale == 1.0 for layer in runner.attention_layers().values())
    generate(llm, 1)
    assert all(layer.impl.k_scale != 1.0 for layer in runner.attention_layers().values())


@pytest.fixture
def replayed_steps(monkeypatch) -> list[tuple[int, int]]:
    """(tokens, longest query) of each step a graph ran."""
    steps: list[tuple[int, int]] = []
    run = CpuGraphRunner.run

    def spy(self, input_ids, positions, common):
        out = run(self, input_ids, positions, common)
        if out is not None:
            steps.append((common.num_actual_tokens, common.max_query_len))
        return out

    monkeypatch.setattr(CpuGraphRunner, "run", spy)
    return steps


def test_verification_steps_replay_a_graph_per_token(tiny, replayed_steps):
    """A verification step's k + 1 tokens of one request run as k + 1 decode rows of a graph,
    and the tokens are the eager engine's (which equal the non-speculative run's); a prompt of
    more than k + 1 tokens, though within the graphs' 8 rows, runs eagerly."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 0}
    llm = LLM(model=tiny, quantization="int8", speculative_config=spec, **ENGINE)
    eager = LLM(model=tiny, quantization="int8", enforce_eager=True, **ENGINE)
    for n in (1, 2):
        assert generate(llm, n) == generate(eager, n)
    assert llm.get_stats()["spec_num_drafts"] > 0
    assert any(query > 1 for _, query in replayed_steps)
    assert max(query for _, query in replayed_steps) <= 4 < len(PROMPTS[0])


def test_an_eagle3_target_is_captured_with_its_residual_streams(tmp_path, replayed_steps):
    """A target that also returns the residual stream at three layers for an EAGLE-3 head: the
    concatenated states are written by a kernel into the graph's memory, so steps replay."""
    from support.eagle_heads import write_eagle_head

    target = make_tiny_checkpoint(tmp_path / "target", num_hidden_layers=6)
    spec = {
        "method": "eagle3",
        "num_speculative_tokens": 2,
        "model": write_eagle_head(tmp_path / "eagle3", target, draft_vocab_size=96),
        "disable_by_batch_size": 0,
        "adaptive_draft_length": False,
    }
    llm = LLM(model=target, quantization="int8", speculative_config=spec, **ENGINE)
    runner = graph_runner(llm)
    assert runner is not None and isinstance(runner.graphs[1].output, tuple)
    eager = LLM(model=target, quantization="int8", enforce_eager=True, **ENGINE)
    for n in (1, 2):
        assert generate(llm, n) == generate(eager, n)
    assert any(query == 3 for _, query in replayed_steps)


def test_an_unresolved_config_is_refused_by_name():
    with pytest.raises(ValueError, match="max_model_len is None"):
        DecodeGraphRunner.create(EngineConfig(), torch.nn.Module(), None, 4, torch.device("cpu"))
