"""The embedded default model against HF transformers on the same weights."""

from __future__ import annotations

import pytest

from conftest import assert_greedy_close, hf_greedy
from tokenmill import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time,",
    "The three primary colors are",
    "In 1969, humans",
    "The quick brown fox",
    "Water boils at",
    "My favorite food is",
]


@pytest.fixture(scope="module")
def llm(default_llm):
    return default_llm


def test_greedy_matches_hf(llm, hf_default_model, default_tokenizer):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    exact = 0
    for prompt, out in zip(PROMPTS, outputs):
        prompt_ids = default_tokenizer.encode(prompt)
        assert out.prompt_token_ids == prompt_ids
        ref, scores = hf_greedy(hf_default_model, prompt_ids, 32)
        ours = out.outputs[0].token_ids
        assert len(ours) == 32 and out.outputs[0].finish_reason == "length"
        assert_greedy_close(ours, out.outputs[0].logprobs, ref, scores)
        exact += ours == ref
    assert exact >= len(PROMPTS) // 2
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_chat_answers_with_template(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=24),
        use_tqdm=False,
    )[0]
    assert out.prompt_token_ids[0] == llm.get_tokenizer().convert_tokens_to_ids("<|im_start|>")
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def test_logprobs_are_normalised_log_probabilities(llm):
    import math

    out = llm.generate("Water boils at", SamplingParams(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False)[0]
    for step, token in zip(out.outputs[0].logprobs, out.outputs[0].token_ids):
        values = [v.logprob for v in step.values()]
        assert token in step and len(step) == 3
        assert all(v <= 0 for v in values)
        assert max(values) == step[token].logprob and step[token].rank == 1
        assert sum(math.exp(v) for v in values) <= 1 + 1e-5
