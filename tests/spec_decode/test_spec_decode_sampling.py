"""Speculative decoding samples through the one sampler: processed logprobs are those of the
non-speculative run, a seeded request's output depends neither on its batch nor (with
deterministic drafts) on whether its steps speculate, and a proposer's draft probabilities are
used: a draft model passes the distribution it drew from, so that drafting for itself every
draft is accepted at any temperature, and the outputs keep the target's distribution."""

from __future__ import annotations

import collections

import pytest
import torch
from support.spec_decode_common import assert_same, make_tiny_checkpoint_with_tokenizer

from tokenmill import LLM, SamplingParams, plugins
from tokenmill.interfaces.proposer import Proposal, ProposalBatch
from tokenmill.spec_decode.ngram import NgramProposer, prompt_lookup

PROMPT = {"prompt_token_ids": [7, 40, 9, 7, 40, 9, 7, 40, 9, 7, 40]}
NGRAM = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_checkpoint_with_tokenizer(tmp_path_factory.mktemp("sampling"))


def _self_draft(tiny: str, **spec) -> dict:
    return {"method": "draft_model", "model": tiny, "num_speculative_tokens": 3, "adaptive_draft_length": False, **spec}


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
               speculative_config={**NGRAM, "disable_by_batch_size": 0})
    for extra in ({"temperature": 0.8, "top_k": 1}, {"temperature": 0.5}):
        params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2, seed=5, **extra)
        expected, _ = _run(plain, params)
        out, drafted = _run(spec, params)
        assert drafted
        assert_same(out, expected, str(extra))
        if extra.get("top_k") == 1 and mode == "processed_logprobs":
            assert [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)] == [0.0] * 16


def test_seeded_request_alone_beside_others_and_without_speculation(tiny):
    """Under the default cut-offs the request speculates alone and not beside 8 others; with
    deterministic drafts (n-gram) its output (every field) is the same both ways and the same as
    with speculation off."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=32, ignore_eos=True, logprobs=2)
    expected, _ = _run(LLM(model=tiny, max_model_len=256, num_kv_blocks=128), params)
    llm = LLM(model=tiny, max_model_len=256, num_kv_blocks=128, speculative_config=NGRAM)
    alone, drafted = _run(llm, params)
    assert drafted
    beside, drafted = _run(llm, params, others=8)
    assert not drafted
    assert_same(alone, expected, "alone")
    assert_same(beside, expected, "beside 8 others")


def test_draft_model_seeded_request_alone_and_beside_others(tiny):
    """A draft model's drafts are draws (seeded by the request's seed): a seeded request's
    output, speculating, is the same alone, again, and beside 8 others."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=32, ignore_eos=True, logprobs=2)
    llm = LLM(model=tiny, max_model_len=256, num_kv_blocks=128,
              speculative_config=_self_draft(tiny, disable_by_batch_size=0))
    alone, drafted = _run(llm, params)
    assert drafted
    again, _ = _run(llm, params)
    beside, drafted = _run(llm, params, others=8)
    assert drafted
    assert_same(again, alone, "again")
    assert_same(beside, alone, "beside 8 others")


@pytest.mark.parametrize(
    "extra", [{"temperature": 0.8}, {"temperature": 1.3, "top_k": 20, "top_p": 0.9, "min_p": 0.01}]
)
def test_self_draft_accepts_every_draft_at_any_temperature(tiny, extra):
    """The draft model passes the distribution q it drew each draft from; drafting for itself
    q equals the target's p, so every draft is accepted (argmax drafts: only with p(argmax))."""
    llm = LLM(model=tiny, max_model_len=256, num_kv_blocks=128,
              speculative_config=_self_draft(tiny, disable_by_batch_size=0))
    params = [SamplingParams(max_tokens=40, ignore_eos=True, seed=s, **extra) for s in range(4)]
    llm.generate([PROMPT] * 4, params, use_tqdm=False)
    stats = llm.get_stats()
    assert stats["spec_num_draft_tokens"] >= 4 * 24
    assert stats["spec_num_accepted_tokens"] >= 0.98 * stats["spec_num_draft_tokens"]


def test_draft_model_keeps_the_target_distribution(tmp_path_factory, tiny):
    """A different draft model (one layer) at temperature 1: its drafts' acceptance is partial
    and the tokens at drafted positions follow the target's distribution (two-sample
    chi-square against the non-speculative run over 600 seeds, per output position)."""
    draft = make_tiny_checkpoint_with_tokenizer(tmp_path_factory.mktemp("draft"), num_hidden_layers=1)
    params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=s) for s in range(600)]
    prompts = [{"prompt_token_ids": [7, 40, 9, 12]}] * len(params)
    samples = {}
    for name, spec in (("plain", None), ("draft", {"method": "draft_model", "model": draft,
                                                    "num_speculative_tokens": 3, "disable_by_batch_size": 0})):
        llm = LLM(model=tiny, max_model_len=64, num_kv_blocks=1024, max_num_seqs=256, speculative_config=spec)
        samples[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    stats = llm.get_stats()
    assert 0.05 < stats["spec_num_accepted_tokens"] / stats["spec_num_draft_tokens"] < 0.95
    for position in (1, 2, 3):
        counts = [collections.Counter(s[position] for s in samples[name]) for name in ("plain", "draft")]
        assert chi_square_p_value(*counts) > 1e-3, f"output position {position}"


def chi_square_p_value(a: collections.Counter, b: collections.Counter) -> float:
    """The p-value of Pearson's two-sample chi-square test that ``a`` and ``b`` (equal totals)
    count draws from one distribution; tokens drawn fewer than 10 times in all are pooled."""
    rare = [t for t in a.keys() | b.keys() if a[t] + b[t] < 10]
    cells = [(a[t], b[t]) for t in a.keys() | b.keys() if t not in rare]
    cells.append((sum(a[t] for t in rare), sum(b[t] for t in rare)))
    cells = [c for c in cells if sum(c)]
    statistic = sum((x - y) ** 2 / (x + y) for x, y in cells)
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2)))


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
