"""What the speculative-decoding test modules share: random prompts (two with a common
prefix, for prefix-cache hits), the engines they compare, a generate that checks every KV
block came back, a tiny model with a byte tokenizer, and the every-field comparison."""

from __future__ import annotations

import math
import random

import pytest
from conftest import make_tiny_checkpoint

from tokenmill import LLM, SamplingParams
from tokenmill.outputs import CompletionOutput, RequestOutput

EOS = 255
"""The EOS id of ``make_tiny_checkpoint_with_tokenizer``'s model and tokenizer."""

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


def make_tiny_checkpoint_with_tokenizer(path, **overrides) -> str:
    """``make_tiny_checkpoint`` with EOS id 255 and a byte-level tokenizer whose 256 ids are
    the 256 bytes, 255 its EOS (so that a structured-output constraint can end)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(byte_chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    make_tiny_checkpoint(path, eos_token_id=EOS, **overrides)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=byte_chars[EOS]).save_pretrained(str(path))
    return str(path)


def assert_same(a: CompletionOutput, b: CompletionOutput, where: str) -> None:
    """Every field equal (logprobs to float tolerance: the batches differ)."""
    assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (
        b.text, b.token_ids, b.finish_reason, b.stop_reason
    ), where
    assert (a.logprobs is None) == (b.logprobs is None), where
    if a.logprobs is None:
        return
    assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, rel=1e-4, abs=1e-4), where
    assert len(a.logprobs) == len(b.logprobs), where
    for t, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
        # Which of several -inf (masked) tokens fill a top-N is arbitrary: only their number counts.
        x, y = (({k: v for k, v in d.items() if v.logprob != -math.inf}, len(d)) for d in (x, y))
        assert x[1] == y[1] and x[0].keys() == y[0].keys(), f"{where}, token {t}"
        for token, lx in x[0].items():
            ly = y[0][token]
            assert (lx.rank, lx.decoded_token) == (ly.rank, ly.decoded_token), f"{where}, token {t}"
            assert lx.logprob == pytest.approx(ly.logprob, rel=1e-4, abs=1e-4), f"{where}, token {t}"
