"""The whole engine on the GPU: each GPU backend gives the reference backend's greedy tokens, and
decode steps replayed from CUDA graphs give the eager tokens."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_checkpoint
from support.paged_batches import usable_backend
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.gpu

# (backend, dtype, block_size)
CASES = [
    ("triton", "float32", 16),
    ("triton", "bfloat16", 16),
    ("flashinfer", "bfloat16", 16),
    ("flash_attn", "bfloat16", 256),
]
PARAMS = SamplingParams(temperature=0, max_tokens=12, logprobs=5)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny"),
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def _generate(model: str, **kwargs) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Greedy outputs of prompts of varied lengths, with chunked prefill mixing in decodes."""
    llm = LLM(model=model, num_kv_blocks=64, max_model_len=512, max_num_batched_tokens=64, **kwargs)
    prompts = [
        {"prompt_token_ids": [(7 * i + 3 * j) % 256 for j in range(5 + 23 * i)]} for i in range(6)
    ]
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    del llm
    torch.cuda.empty_cache()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def _assert_greedy_close(ours, ref) -> None:
    """Equal tokens, or at the first divergence each side's token is in the other's top-5."""
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(ours, ref):
        for k, (a, b) in enumerate(zip(tokens, ref_tokens)):
            if a != b:
                assert a in ref_logprobs[k] and b in logprobs[k], f"position {k}: {a} vs {b}"
                break


@pytest.mark.parametrize("name, dtype, block_size", CASES)
def test_backend_greedy_matches_reference(model, name, dtype, block_size):
    usable_backend(name, 64, getattr(torch, dtype), block_size)
    common = dict(dtype=dtype, block_size=block_size, enforce_eager=True)
    ours = _generate(model, attention_backend=name, **common)
    ref = _generate(model, attention_backend="torch", **common)
    if dtype == "float32":
        assert [t for t, _ in ours] == [t for t, _ in ref]
    else:
        _assert_greedy_close(ours, ref)


@pytest.mark.parametrize("name, dtype, block_size", CASES)
def test_cuda_graphs_give_eager_tokens(model, name, dtype, block_size):
    usable_backend(name, 64, getattr(torch, dtype), block_size)
    common = dict(attention_backend=name, dtype=dtype, block_size=block_size, max_num_seqs=8)
    graphs = _generate(model, **common)
    eager = _generate(model, enforce_eager=True, **common)
    _assert_greedy_close(graphs, eager)


def test_default_backend_runs(model):
    assert len(_generate(model)[0][0]) == PARAMS.max_tokens
