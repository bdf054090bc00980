"""Prompt logprobs and ``Logprob`` objects against HF's log-softmax of the same forward pass."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.logprobs import Logprob

TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow."
)
TOP = 3


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """``[len(ids), V]``: row ``p`` is the log-softmax predicting position ``p + 1``."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_prompt_logprobs(prompt_logprobs, ids: list[int], ref: torch.Tensor, tokenizer=None) -> None:
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for p in range(1, len(ids)):
        step, row = prompt_logprobs[p], ref[p - 1]
        token = ids[p]
        assert step[token].logprob == pytest.approx(float(row[token]), abs=1e-4), f"position {p}"
        assert step[token].rank == int((row >= row[token]).sum())
        top = sorted((t for t in step if step[t].rank <= TOP), key=lambda t: step[t].rank)
        assert top == row.topk(TOP).indices.tolist()
        assert len(step) in (TOP, TOP + 1)
        for t, lp in step.items():
            assert lp.logprob == pytest.approx(float(row[t]), abs=1e-4)
            if tokenizer is not None:
                assert lp.decoded_token == tokenizer.decode([t])


@pytest.fixture(scope="module")
def prompt_ids(default_tokenizer) -> list[int]:
    return default_tokenizer.encode(TEXT)


@pytest.fixture(scope="module")
def reference(hf_default_model, prompt_ids) -> torch.Tensor:
    return hf_logprobs(hf_default_model, prompt_ids)


@pytest.fixture(scope="module", params=[None, 32], ids=["default", "max_num_batched_tokens=32"])
def llm(request):
    kwargs = {} if request.param is None else {"max_num_batched_tokens": request.param}
    return LLM(dtype="float32", kv_cache_memory_bytes=64 << 20, **kwargs)


def test_prompt_logprobs_equal_hf(llm, prompt_ids, reference, default_tokenizer):
    assert len(prompt_ids) > 32
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=TOP)
    out = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0]
    check_prompt_logprobs(out.prompt_logprobs, prompt_ids, reference, default_tokenizer)
    completion = out.outputs[0]
    total = 0.0
    for token, step in zip(completion.token_ids, completion.logprobs):
        assert isinstance(step[token], Logprob) and step[token].rank == 1
        assert step[token].decoded_token == default_tokenizer.decode([token])
        total += step[token].logprob
    assert completion.cumulative_logprob == pytest.approx(total)


def test_prompt_logprobs_after_a_prefix_cache_warming_request(llm, prompt_ids, reference):
    plain = SamplingParams(temperature=0, max_tokens=1)
    llm.generate({"prompt_token_ids": prompt_ids}, plain, use_tqdm=False)
    warm = llm.generate({"prompt_token_ids": prompt_ids}, plain, use_tqdm=False)[0]
    assert warm.num_cached_tokens >= 32, "the cache holds the prompt"
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=TOP)
    out = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    check_prompt_logprobs(out.prompt_logprobs, prompt_ids, reference)


def test_without_prompt_logprobs_there_are_none(llm, prompt_ids):
    out = llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.prompt_logprobs is None
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")


def test_prompt_logprobs_survive_preemption_and_mixed_batches(tiny_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    prompts = [[(7 * i + 3 * k) % 256 for k in range(40 + 9 * i)] for i in range(4)]
    llm = LLM(
        tiny_path,
        num_kv_blocks=32,
        block_size=4,
        max_num_batched_tokens=24,
        watermark=0.0,
    )
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=TOP if i % 2 == 0 else None)
        for i in range(4)
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.get_stats()["num_preemptions"] > 0
    for i, (ids, out) in enumerate(zip(prompts, outputs)):
        if i % 2:
            assert out.prompt_logprobs is None
        else:
            check_prompt_logprobs(out.prompt_logprobs, ids, hf_logprobs(hf, ids))


def test_one_token_prompt_has_only_the_first_none(tiny_path):
    llm = LLM(tiny_path, num_kv_blocks=16, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1, n=1)
    out = llm.generate({"prompt_token_ids": [9]}, params, use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]
