"""Stop conditions inside a speculative step: a step that emits several tokens ends a request
exactly where the same tokens arriving one per step would, in every output field.

The default model continues a list it was shown, so prompt lookup (``ngram``) drafts are all
accepted and every step brings up to k + 1 tokens; each stop below completes inside a step."""

from __future__ import annotations

import asyncio

import pytest

from support.spec_decode_common import assert_same
from tokenmill import LLM, SamplingParams
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.outputs import CompletionOutput

PROMPT = (
    "The colors of the rainbow, again and again: red orange yellow green blue indigo violet, "
    "red orange yellow green blue indigo violet, red orange yellow green blue indigo violet, red"
)
ENGINE = {"max_model_len": 512, "num_kv_blocks": 128}
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
    "disable_by_batch_size": 0,
}
CASES = {
    "overlapping": {"stop": ["yellow green blue", "w g"]},
    "overlapping-included": {"stop": ["yellow green blue", "w g"], "include_stop_str_in_output": True},
    "one-token": {"stop": [" indigo"]},
    "one-token-included": {"stop": [" indigo"], "include_stop_str_in_output": True},
    "after-min-tokens": {"stop": ["yellow"], "min_tokens": 4},
    "never": {"stop": ["purple"]},
    "stop-token": {"stop_token_ids": ["violet"]},
    "stop-token-after-min-tokens": {"stop_token_ids": ["violet"], "min_tokens": 2},
    "stop-token-and-string": {"stop_token_ids": ["violet"], "stop": ["ue in"]},
    "max-tokens": {"max_tokens": 7},
}
"""Sampling parameters per case (stop token ids named by the word whose token they are)."""


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(**ENGINE)


@pytest.fixture(scope="module")
def speculative() -> LLM:
    return LLM(**ENGINE, speculative_config=NGRAM)


def _params(tokenizer, case: dict) -> SamplingParams:
    case = dict(case)
    if "stop_token_ids" in case:
        case["stop_token_ids"] = [tokenizer.encode(" " + word)[0] for word in case["stop_token_ids"]]
    return SamplingParams(**{"temperature": 0, "max_tokens": 30, "logprobs": 2, **case})


@pytest.mark.parametrize("case", list(CASES))
def test_stop_inside_a_speculative_step_equals_one_token_per_step(default_tokenizer, plain, speculative, case):
    params = _params(default_tokenizer, CASES[case])
    expected = plain.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    before = speculative.get_stats()["spec_num_accepted_tokens"]
    got = speculative.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert speculative.get_stats()["spec_num_accepted_tokens"] > before
    assert_same(got, expected, "speculative vs plain")
    if case != "never":
        assert len(expected.token_ids) < 12


def test_streamed_deltas_end_at_the_stop(default_tokenizer, plain):
    """``AsyncLLM``'s DELTA outputs add up to the one-token-per-step completion."""
    params = _params(default_tokenizer, CASES["overlapping"])
    expected = plain.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]

    async def stream() -> CompletionOutput:
        engine = AsyncLLM.from_engine_args(engine_process=False, speculative_config=NGRAM, **ENGINE)
        try:
            total = CompletionOutput(0, "", [], logprobs=[], cumulative_logprob=0.0)
            async for output in engine.generate(PROMPT, params):
                (delta,) = output.outputs
                total.text += delta.text
                total.token_ids += delta.token_ids
                total.logprobs += delta.logprobs
                total.cumulative_logprob = delta.cumulative_logprob
                total.finish_reason, total.stop_reason = delta.finish_reason, delta.stop_reason
            assert engine.get_stats()["spec_num_accepted_tokens"] > 0
            return total
        finally:
            engine.shutdown()

    assert_same(asyncio.run(stream()), expected, "speculative vs plain")
