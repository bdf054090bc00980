"""Speculative decoding samples through the one sampler: processed logprobs are those of the
non-speculative run, a seeded request's output depends neither on its batch nor on whether
its steps speculate, and a proposer's draft probabilities are used."""

from __future__ import annotations

import pytest
import torch
from support.spec_decode_common import assert_same, make_tiny_checkpoint_with_tokenizer

from tokenmill import LLM, SamplingParams, plugins
from tokenmill.interfaces.proposer import Proposal, ProposalBatch
from tokenmill.spec_decode.ngram import NgramProposer, prompt_lookup

PROMPT = {"prompt_token_ids": [7, 40, 9, 7, 40, 9, 7, 40, 9, 7, 40]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_checkpoint_with_tokenizer(tmp_path_factory.mktemp("sampling"))


def _self_draft(tiny: str, **spec) -> dict:
    return {"method": "draft_model", "model": tiny, "num_speculative_tokens": 3, **spec}


def _run(llm: LLM, params: SamplingParams, others: int = 0):
    """The completion of ``PROMPT`` run beside ``others`` other requests, and whether the
    engine verified drafts meanwhile."""
    before = llm.get_stats().get("spec_num_drafts", 0)
    prompts = [PROMPT] + [{"prompt_token_ids": [3 + i, 90, 11 * i % 250]} for i in range(others)]
    extra = SamplingParams(temperature=1.0, seed=1, max_tokens=params.max_tokens, ignore_eos=True)
    out = llm.generate(prompts, [params] + [extra] * others, use_tqdm=False)[0].outputs[0]
    return out, llm.get_stats().get("spec_num_drafts", 0) > before


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits"])
def test_processed_logprobs_under_speculation_equal_the_plain_run(tiny, mode):
    """Drafted positions report logprobs after temperature and top-k, as the plain sampler
    does (temperature 0.8 with top_k 1: every sampled logprob 0.0 in the processed_logprobs
    mode)."""
    plain = LLM(model=tiny, max_model_len=256, num_kv_blocks=64, logprobs_mode=mode)
    spec = LLM(model=tiny, max_model_len=256, num_kv_blocks=64, logprobs_mode=mode,
               speculative_config=_self_draft(tiny, disable_by_batch_size=0))
    for extra in ({"temperature": 0.8, "top_k": 1}, {"temperature": 0.5}):
        params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2, seed=5, **extra)
        expected, _ = _run(plain, params)
        out, drafted = _run(spec, params)
        assert drafted
        assert_same(out, expected, str(extra))
        if extra.get("top_k") == 1 and mode == "processed_logprobs":
            assert [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)] == [0.0] * 16


@pytest.mark.parametrize(
    "spec",
    [{"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, "num_speculative_tokens": 3}, "self-draft"],
    ids=["ngram", "draft_model"],
)
def test_seeded_request_alone_beside_others_and_without_speculation(tiny, spec):
    """Under the default cut-offs the request speculates alone and not beside 8 others; its
    output (every field) is the same both ways and the same as with speculation off."""
    spec = _self_draft(tiny) if spec == "self-draft" else spec
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=32, ignore_eos=True, logprobs=2)
    expected, _ = _run(LLM(model=tiny, max_model_len=256, num_kv_blocks=128), params)
    llm = LLM(model=tiny, max_model_len=256, num_kv_blocks=128, speculative_config=spec)
    alone, drafted = _run(llm, params)
    assert drafted
    beside, drafted = _run(llm, params, others=8)
    assert not drafted
    assert_same(alone, expected, "alone")
    assert_same(beside, expected, "beside 8 others")


class SmoothedLookup(NgramProposer):
    """Prompt-lookup drafts that claim a uniform draft distribution."""

    def propose(self, batch: ProposalBatch) -> Proposal:
        proposal = prompt_lookup(batch.input_batch, batch.rows, batch.num_speculative_tokens, 1, 3)
        vocab = batch.input_batch.vocab_size
        q = torch.full((*proposal.draft_token_ids.shape, vocab), 1 / vocab)
        return Proposal(proposal.draft_token_ids, proposal.num_draft_tokens, q)


def test_draft_probs_reach_the_sampler(tiny):
    """A proposer's ``draft_probs`` are used at verification: greedy rows still equal the plain
    run (accepted while the argmax), and at a high temperature random rows accept far more
    (min(1, p(d) / q(d)) with q(d) = 1 / V) than with deterministic drafts (p(d))."""
    plugins.register_proposer("smoothed-lookup", SmoothedLookup)
    spec = {"method": "smoothed-lookup", "num_speculative_tokens": 3, "disable_by_batch_size": 0}
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    expected, _ = _run(LLM(model=tiny, max_model_len=256, num_kv_blocks=64), greedy)
    llm = LLM(model=tiny, max_model_len=256, num_kv_blocks=64, speculative_config=spec)
    out, drafted = _run(llm, greedy)
    assert drafted
    assert_same(out, expected, "greedy")
    hot = SamplingParams(temperature=3.0, seed=2, max_tokens=48, ignore_eos=True)
    rates = []
    for config in (spec, {**spec, "method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}):
        llm = LLM(model=tiny, max_model_len=256, num_kv_blocks=64, speculative_config=config)
        _run(llm, hot)
        stats = llm.get_stats()
        rates.append(stats["spec_num_accepted_tokens"] / stats["spec_num_draft_tokens"])
    assert rates[0] > 0.3 > 0.1 > rates[1]
