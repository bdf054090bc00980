"""Contract points of a model: transformers' greedy tokens, the same tokens whatever the
scheduler does (prefix-cache hits, chunked prefill, preemption), and weight loading that names
what a checkpoint lacks."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from tokenmill.testing.checkpoints import (
    engine_greedy,
    first_divergence,
    hf_model_class,
    random_prompts,
    save_tiny_checkpoint,
)

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoint(tokenmill_model: str, request, tmp_path_factory):
    """The author's tiny checkpoint (hook ``pytest_tokenmill_tiny_checkpoint``), else one saved by
    transformers."""
    path = tmp_path_factory.mktemp(tokenmill_model)
    made = request.config.hook.pytest_tokenmill_tiny_checkpoint(arch=tokenmill_model, path=path)
    if made is not None:
        return made
    if hf_model_class(tokenmill_model) is None:
        pytest.fail(
            f"no tiny checkpoint for {tokenmill_model!r}: transformers has no such class; "
            f"implement the pytest_tokenmill_tiny_checkpoint(arch, path) hook in your conftest.py"
        )
    return save_tiny_checkpoint(tokenmill_model, path)


@pytest.fixture(scope="module")
def prompts(checkpoint) -> list[list[int]]:
    config = json.loads((checkpoint / "config.json").read_text())
    return random_prompts(config["vocab_size"])


@pytest.fixture(scope="module")
def baseline(checkpoint, prompts):
    """Greedy tokens with the whole prompt in one step and no prefix caching."""
    tokens, _ = engine_greedy(
        checkpoint, prompts, MAX_TOKENS, enable_prefix_caching=False, max_num_batched_tokens=256
    )
    return tokens


def test_greedy_matches_transformers(tokenmill_model, checkpoint, prompts, baseline):
    """generates transformers' greedy tokens"""
    if hf_model_class(tokenmill_model) is None:
        pytest.skip(f"transformers has no class {tokenmill_model!r} to compare with")
    for i, (prompt, ours) in enumerate(zip(prompts, baseline)):
        where = first_divergence(checkpoint, prompt, ours)
        assert where is None, f"greedy tokens differ from transformers on prompt {i}: {where}"


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(dict(enable_prefix_caching=True), id="prefix-cache-hits"),
        pytest.param(dict(max_num_batched_tokens=16, enable_prefix_caching=False), id="chunked-prefill"),
        pytest.param(dict(num_kv_blocks=10, enable_prefix_caching=False), id="preemption"),
    ],
)
def test_same_tokens_whatever_the_schedule(checkpoint, prompts, baseline, variant):
    """generates the same greedy tokens with prefix-cache hits, chunked prefill and preemption"""
    from tokenmill import LLM, SamplingParams

    args = {**dict(block_size=8, max_model_len=256, num_kv_blocks=64), **variant}
    llm = LLM(model=str(checkpoint), **args)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    runs = 2 if variant.get("enable_prefix_caching") else 1
    for run in range(runs):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for i, out in enumerate(outputs):
            assert list(out.outputs[0].token_ids) == baseline[i], (
                f"{variant} run {run + 1}, prompt {i}: {list(out.outputs[0].token_ids)} differ "
                f"from the one-step prefill's {baseline[i]}"
            )
    stats = llm.get_stats()
    if "num_kv_blocks" in variant:
        assert stats["num_preemptions"] > 0, "the small cache did not preempt; the check did not run"
    if runs == 2:
        assert stats["prefix_cache_hit_tokens"] > 0, "the rerun hit no cached prefix"
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], "blocks leaked"


def test_missing_weight_is_named(checkpoint, tmp_path):
    """loading a checkpoint that lacks a weight fails and names the parameter left unfilled"""
    from tokenmill import LLM

    files = sorted(checkpoint.glob("*.safetensors"))
    assert files, f"{checkpoint} has no safetensors files"
    tensors = load_file(files[0])
    layer_weights = sorted(n for n in tensors if n.endswith(".weight") and ".1." in n)
    victim = (layer_weights or sorted(tensors))[0]
    del tensors[victim]
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in checkpoint.iterdir():
        if f.is_file() and f != files[0]:
            (broken / f.name).write_bytes(f.read_bytes())
    save_file(tensors, broken / files[0].name, metadata={"format": "pt"})
    parts = victim.split(".")
    layer = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts) - 2)
    owner = ".".join(parts[1 : layer + 1])
    with pytest.raises(Exception) as info:
        LLM(model=str(broken), block_size=8, max_model_len=256, num_kv_blocks=16)
    assert owner in str(info.value), (
        f"the checkpoint lacks {victim!r}; the error does not name a parameter of "
        f"{owner!r}: {info.value}"
    )
