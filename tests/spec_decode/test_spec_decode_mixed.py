"""The guard of speculative decoding beside every other sampling feature: randomized mixed
batches (structured outputs, penalties, logit bias, bad words, min_tokens, allowed tokens,
seeded random sampling, n > 1, logprobs in every mode) on a tiny random model with a byte
tokenizer, run with speculation off and on (n-gram; the same model as draft model; every step
speculates, fixed draft lengths: adaptive ones depend on step timings), must give the same
outputs in every field. A draft model's drafts of random
requests are draws from its distribution ``q``, verified with ``min(1, p / q)``: equal to the
plain run in distribution, not draw for draw, so those requests are compared with themselves
run alone instead (their output depends only on their seed)."""

from __future__ import annotations

import random

import pytest
from support.spec_decode_common import EOS, assert_same, make_tiny_checkpoint_with_tokenizer

from tokenmill import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.engine_args import LOGPROBS_MODES

VOCAB = 256
SPECS = {
    "off": None,
    "ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "draft": {"method": "draft_model"},
}
CONSTRAINTS = [
    StructuredOutputsParams(regex=r"[a-z]{2,6}( [a-z]{2,6}){0,3}"),
    StructuredOutputsParams(choice=["yes", "no", "maybe so", "yes and no"]),
    StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        disable_any_whitespace=True,
    ),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("mixed")
    return make_tiny_checkpoint_with_tokenizer(path)


@pytest.fixture(scope="module")
def engines(tiny):
    """``engines(mode, spec)``: one engine per logprobs mode and speculation setting, built
    when first asked for."""
    built: dict[tuple[str, str], LLM] = {}

    def get(mode: str, spec: str) -> LLM:
        if (mode, spec) not in built:
            config = SPECS[spec]
            if config is not None:
                config = {**config, "num_speculative_tokens": 3, "disable_by_batch_size": 0,
                          "adaptive_draft_length": False}
                if config["method"] == "draft_model":
                    config["model"] = tiny
            built[mode, spec] = LLM(
                model=tiny, max_model_len=256, num_kv_blocks=256, logprobs_mode=mode,
                speculative_config=config,
            )
        return built[mode, spec]

    return get


def random_params(rng: random.Random) -> SamplingParams:
    """One request's settings: greedy or seeded random, and a random mix of features."""
    kw: dict = {"max_tokens": rng.randint(2, 16), "ignore_eos": rng.random() < 0.3}
    if rng.random() < 0.5:
        kw |= {"temperature": rng.choice([0.3, 0.8, 1.0, 1.5]), "seed": rng.randrange(2**32)}
        if rng.random() < 0.4:
            kw["top_k"] = rng.choice([1, 5, 40])
        if rng.random() < 0.4:
            kw["top_p"] = rng.choice([0.5, 0.9])
        if rng.random() < 0.3:
            kw["min_p"] = rng.choice([0.05, 0.2])
        if rng.random() < 0.2:
            kw["n"] = rng.randint(2, 3)
    else:
        kw["temperature"] = 0.0
    if rng.random() < 0.5:
        kw["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.25:
        kw["structured_outputs"] = rng.choice(CONSTRAINTS)
        kw["max_tokens"] = 24
        return SamplingParams(**kw)
    if rng.random() < 0.3:
        kw["presence_penalty"] = rng.choice([0.0, 0.5, 1.5])
        kw["frequency_penalty"] = rng.choice([0.0, 0.4, 1.0])
        kw["repetition_penalty"] = rng.choice([1.0, 1.3, 0.8])
    if rng.random() < 0.25:
        kw["logit_bias"] = {rng.randrange(VOCAB): rng.choice([-5.0, 3.0, 8.0]) for _ in range(3)}
    if rng.random() < 0.25:
        kw["bad_words"] = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 2))) for _ in range(3)]
    if rng.random() < 0.25:
        kw["min_tokens"] = rng.randint(1, kw["max_tokens"])
        kw["logit_bias"] = {EOS: 6.0}
    if rng.random() < 0.2:
        kw["allowed_token_ids"] = rng.sample(range(VOCAB), 24) + [EOS]
    if rng.random() < 0.15:
        kw["stop_token_ids"] = [rng.randrange(VOCAB)]
    return SamplingParams(**kw)


def random_prompt(rng: random.Random) -> dict:
    """Token ids that repeat a random phrase, so that n-gram lookup finds drafts."""
    phrase = [rng.randrange(VOCAB - 1) for _ in range(rng.randint(2, 6))]
    ids = (phrase * 8)[: rng.randint(4, 40)] + [rng.randrange(VOCAB - 1) for _ in range(rng.randint(0, 4))]
    return {"prompt_token_ids": ids}


def run_case(seed: int, engines) -> None:
    rng = random.Random(seed)
    mode = rng.choice(LOGPROBS_MODES)
    n = rng.randint(3, 8)
    prompts = [random_prompt(rng) for _ in range(n)]
    params = [random_params(rng) for _ in range(n)]
    reference = engines(mode, "off").generate(prompts, params, use_tqdm=False)
    for spec in ("ngram", "draft"):
        llm = engines(mode, spec)
        before = llm.get_stats()["spec_num_drafts"]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        # A draft model drafts at every step; n-gram lookup only where a suffix recurs.
        if spec == "draft":
            assert llm.get_stats()["spec_num_drafts"] > before
        for i, (ref, out) in enumerate(zip(reference, outputs)):
            if spec == "draft" and params[i].temperature > 0:
                ref = llm.generate([prompts[i]], [params[i]], use_tqdm=False)[0]
            assert len(ref.outputs) == len(out.outputs)
            for ref_c, out_c in zip(ref.outputs, out.outputs):
                assert_same(out_c, ref_c, f"seed {seed}, {spec}, mode {mode}, request {i}: {params[i]}")
        stats = llm.get_stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.mark.parametrize("seed", range(16))
def test_mixed_batches_equal_with_and_without_speculation(seed, engines):
    run_case(seed, engines)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(16, 64))
def test_mixed_batches_equal_with_and_without_speculation_long(seed, engines):
    run_case(seed, engines)
