"""Per-engine forward context: a context is seen only by the thread that set it, each attention
layer holds its own KV cache, and two engines (different models) in one process — stepping in
alternation or on two threads at once — generate what each generates alone."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import make_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.config_resolver import resolve_config
from tokenmill.forward_context import get_forward_context, set_forward_context
from tokenmill.layers.attention import Attention
from tokenmill.worker.model_runner import ModelRunner

PROMPTS = {
    "llama": [[7, 3, 9], list(range(40, 61)), [200] * 11],
    "qwen2": [list(range(100, 133)), [5, 6], [1, 2, 3, 4, 5, 6, 7]],
}
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ENGINE_ARGS = dict(
    num_kv_blocks=64, block_size=8, max_num_batched_tokens=16, enable_prefix_caching=False
)


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict[str, LLM]:
    """A tiny Llama (2 KV heads) and a tiny Qwen2 (1 KV head, QKV biases): their KV caches
    have different shapes, so one model reading the other's cache or metadata fails."""
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": LLM(model=make_tiny_checkpoint(root / "llama", "llama"), **ENGINE_ARGS),
        "qwen2": LLM(
            model=make_tiny_checkpoint(root / "qwen2", "qwen2", num_key_value_heads=1),
            **ENGINE_ARGS,
        ),
    }


def _generate(llm: LLM, name: str) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[name]], PARAMS, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs]


@pytest.fixture(scope="module")
def alone(engines) -> dict[str, list[list[int]]]:
    return {name: _generate(llm, name) for name, llm in engines.items()}


def test_context_is_invisible_to_other_threads():
    seen: dict[str, object] = {}

    def other_thread() -> None:
        try:
            seen["before"] = get_forward_context().attn_metadata
        except RuntimeError:
            seen["before"] = None
        with set_forward_context("other"):
            seen["own"] = get_forward_context().attn_metadata

    with set_forward_context("main"):
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        assert get_forward_context().attn_metadata == "main"
    assert seen == {"before": None, "own": "other"}
    with pytest.raises(RuntimeError, match="outside set_forward_context"):
        get_forward_context()


def test_each_attention_layer_holds_its_kv_cache(tmp_path):
    config = resolve_config(EngineConfig(
        model=make_tiny_checkpoint(tmp_path, "llama"), block_size=8, max_model_len=64
    ))
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    layers = list(runner.attention_layers().values())
    assert len(layers) == 2 and all(layer.kv_cache is None for layer in layers)
    runner.initialize_kv_cache(10)
    shape = layers[0].backend.get_kv_cache_shape(10, 8, layers[0].num_kv_heads, layers[0].head_size)
    assert all(isinstance(layer, Attention) for layer in layers)
    assert [tuple(layer.kv_cache.shape) for layer in layers] == [tuple(shape)] * 2
    assert layers[0].kv_cache.data_ptr() != layers[1].kv_cache.data_ptr()


def test_two_engines_stepping_in_alternation(engines, alone):
    for name, llm in engines.items():
        for i, prompt in enumerate(PROMPTS[name]):
            llm.llm_engine.add_request(f"{name}-{i}", {"prompt_token_ids": prompt}, PARAMS)
    finished: dict[str, list[int]] = {}
    while any(llm.llm_engine.has_unfinished_requests() for llm in engines.values()):
        for llm in engines.values():
            if llm.llm_engine.has_unfinished_requests():
                for out in llm.llm_engine.step():
                    if out.finished:
                        finished[out.request_id] = out.outputs[0].token_ids
    for name in engines:
        assert [finished[f"{name}-{i}"] for i in range(len(PROMPTS[name]))] == alone[name]


def test_two_engines_on_two_threads_at_once(engines, alone, monkeypatch):
    """Each thread's first attention call waits until both engines are inside a forward pass,
    so each has set its forward context before either reads one."""
    barrier = threading.Barrier(2, timeout=30)
    waited: set[int] = set()
    forward = Attention.forward

    def synchronized_forward(self, q, k, v):
        if threading.get_ident() not in waited:
            waited.add(threading.get_ident())
            barrier.wait()
        return forward(self, q, k, v)

    monkeypatch.setattr(Attention, "forward", synchronized_forward)
    results: dict[str, object] = {}

    def run(name: str) -> None:
        try:
            results[name] = _generate(engines[name], name)
        except Exception as e:
            results[name] = e
            barrier.abort()

    threads = [threading.Thread(target=run, args=(name,)) for name in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(waited) == 2
    assert results == alone
