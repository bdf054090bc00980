"""What the speculative-decoding test modules share: random prompts (two with a common
prefix, for prefix-cache hits), the engines they compare, and a generate that checks every
KV block came back."""

from __future__ import annotations

import random

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.outputs import CompletionOutput, RequestOutput

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ENGINES = {
    "plain": {"num_kv_blocks": 256},
    "chunked": {"num_kv_blocks": 256, "max_num_batched_tokens": 32},
    "preempting": {"num_kv_blocks": 24},
}
"""Engine settings every proposer is checked under: plain, chunked prefill, preempting."""


def random_prompts() -> list[dict]:
    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(20)]
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(3, 60))] for _ in range(6)]
    prompts += [shared + [rng.randrange(256) for _ in range(n)] for n in (2, 40)]
    return [{"prompt_token_ids": p} for p in prompts]


def generate(llm: LLM, prompts, params: SamplingParams | list[SamplingParams] = GREEDY) -> list[list[int]]:
    """Output token ids per prompt; asserts every KV block is free afterwards."""
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    return [o.outputs[0].token_ids for o in outputs]


def generate_toggling(
    llm: LLM, long_prompt: list[int], short_prompts: list[list[int]], max_tokens: int = 64
) -> tuple[list[RequestOutput], dict[str, int], dict[str, int]]:
    """Concurrency 1 -> 3 -> 1 under a cut-off (``disable_by_batch_size``) of 2 or 3: a long
    greedy request runs alone (speculating), two short ones join (no step speculates while
    three run: asserted, the long one gets one token per step) and finish together, then the
    long one runs alone again. Returns the outputs (the long request's first), the change of
    the engine's ``spec_*`` counters over the run, and over the steps after the short ones left."""
    engine = llm.llm_engine
    start = llm.get_stats()
    long_params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    short_params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    engine.add_request("long", {"prompt_token_ids": long_prompt}, long_params)
    for _ in range(3):
        engine.step()
    for i, prompt in enumerate(short_prompts):
        engine.add_request(f"short-{i}", {"prompt_token_ids": prompt}, short_params)
    finished: dict[str, RequestOutput] = {}
    num_long_tokens = []
    while len(finished) < len(short_prompts):
        outputs = {o.request_id: o for o in engine.step()}
        num_long_tokens.append(len(outputs["long"].outputs[0].token_ids))
        finished.update({k: o for k, o in outputs.items() if o.finished})
    # The first of these steps may still verify drafts proposed while the long one was alone.
    assert len(num_long_tokens) > 2
    assert all(b == a + 1 for a, b in zip(num_long_tokens, num_long_tokens[1:]))
    resumed = llm.get_stats()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    end = llm.get_stats()
    assert end["kv_blocks_free"] == end["kv_blocks_total"]
    outputs = [finished["long"], *(finished[f"short-{i}"] for i in range(len(short_prompts)))]

    def change(before: dict[str, int]) -> dict[str, int]:
        return {key: end[key] - before.get(key, 0) for key in end if key.startswith("spec_")}

    return outputs, change(start), change(resumed)


def assert_same_completion(a: CompletionOutput, b: CompletionOutput) -> None:
    """Every field equal: text, token ids, finish and stop reason, logprobs (ids and ranks
    exactly, values to 1e-4) and cumulative logprob."""
    assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (b.text, b.token_ids, b.finish_reason, b.stop_reason)
    assert (a.logprobs is None) == (b.logprobs is None)
    if a.logprobs is not None:
        assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys()
            for token in x:
                assert x[token].rank == y[token].rank
                assert x[token].logprob == pytest.approx(y[token].logprob, abs=1e-4)
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)
