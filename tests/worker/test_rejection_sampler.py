"""Verifying drafts through the one sampler: the emitted tokens are distributed exactly as the
target's, on small vocabularies, with and without draft probabilities."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.sample.rejection_sampler import Drafts, num_accepted
from tokenmill.sample.sampler import Sampler, SamplingMetadata, position_seed, processed_logits, to_probs

V = 6


def _metadata(
    num_positions: int,
    temperature: float,
    top_k: int | None = None,
    logprobs: int | None = None,
    seeds: dict[int, int] | None = None,
) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.full((num_positions,), temperature),
        all_greedy=temperature == 0,
        all_random=temperature > 0,
        top_p=None,
        top_k=None if top_k is None else torch.full((num_positions,), top_k),
        min_p=None,
        seeds=seeds or {},
        max_num_logprobs=logprobs,
        suppress_token_ids={},
    )


def _tv(samples: torch.Tensor, probs: torch.Tensor) -> float:
    freq = torch.bincount(samples, minlength=probs.numel()).double() / len(samples)
    return 0.5 * (freq - probs.double()).abs().sum().item()


def _verify(logits: torch.Tensor, metadata: SamplingMetadata, drafts: torch.Tensor, draft_probs=None):
    """``n`` requests with the same ``k + 1`` positions of ``logits``; drafts ``[n, k]``:
    the emitted tokens ``[n, k + 1]`` (-1 after the emitted ones) and the counts."""
    n, k = drafts.shape
    draft_ids = torch.cat([drafts, torch.full((n, 1), -1)], dim=1).flatten()
    probs = None
    if draft_probs is not None:
        probs = torch.cat([draft_probs, torch.zeros(n, 1, V)], dim=1).reshape(n * (k + 1), V)
    out = Sampler()(logits.repeat(n, 1), metadata, Drafts(draft_ids, probs))
    tokens = out.sampled_token_ids.numpy()
    emitted = 1 + num_accepted(tokens, draft_ids.numpy(), np.full(n, k + 1))
    tokens = torch.from_numpy(tokens).view(n, k + 1)
    keep = torch.arange(k + 1).unsqueeze(0) < torch.from_numpy(emitted).unsqueeze(1)
    return torch.where(keep, tokens, -1), torch.from_numpy(emitted), out


@pytest.mark.parametrize("k, top_k, with_q", [(1, None, True), (3, None, True), (2, 3, True), (3, None, False), (2, 3, False)])
def test_output_distribution_equals_target(k, top_k, with_q):
    """Per position, the emitted token's distribution is the target's p (after temperature and
    top-k), whatever the draft's q; the acceptance rate is sum(min(p, q)) in closed form (p(d)
    for a deterministic draft d)."""
    torch.manual_seed(k * 10 + (top_k or 0))
    n = 60_000
    logits = torch.randn(k + 1, V) * 2
    meta1 = _metadata(k + 1, 0.8, top_k)
    p = to_probs(processed_logits(logits, meta1), logits, meta1)
    q = torch.softmax(torch.randn(k, V) * 2, dim=-1)
    if with_q:
        drafts = torch.multinomial(q, n, replacement=True).T.contiguous()
        draft_probs = q.expand(n, k, V).contiguous()
    else:
        fixed = torch.multinomial(p[:k], 1).squeeze(1)
        q = torch.nn.functional.one_hot(fixed, V).float()
        drafts = fixed.expand(n, k).contiguous()
        draft_probs = None
    tokens, emitted, _ = _verify(logits, _metadata(n * (k + 1), 0.8, top_k), drafts, draft_probs)
    assert ((tokens >= 0).sum(dim=1) == emitted).all()
    accepted_first = (emitted > 1).double().mean().item()
    assert abs(accepted_first - torch.minimum(p[0], q[0]).sum().item()) < 0.01
    assert _tv(tokens[:, 0], p[0]) < 0.015
    has_second = emitted > 1
    assert _tv(tokens[has_second, 1], p[1]) < 0.03
    assert (tokens[has_second, 0] == drafts[has_second, 0]).all()


def test_greedy_accepts_while_draft_is_argmax_then_takes_target():
    logits = torch.full((4, V), -5.0)
    for i, t in enumerate([2, 4, 1, 0]):
        logits[i, t] = 5.0
    drafts = torch.tensor([[2, 4, 5], [2, 3, 0]])
    tokens, emitted, out = _verify(logits, _metadata(8, 0.0, logprobs=1), drafts)
    assert emitted.tolist() == [3, 2]
    assert tokens.tolist() == [[2, 4, 1, -1], [2, 4, -1, -1]]
    assert out.logprob_token_ids[:3, 0].tolist() == [2, 4, 1]
    torch.testing.assert_close(out.logprobs[2, 0], logits.log_softmax(-1)[2, 1])


def test_num_accepted_counts_leading_matches_per_request():
    tokens = np.array([5, 6, 7, 1, 2, 9, 3])
    drafts = np.array([5, 6, -1, 4, 2, -1, -1])
    assert num_accepted(tokens, drafts, np.array([3, 3, 1])).tolist() == [2, 0, 0]


def test_a_seeded_position_draws_the_same_token_with_and_without_drafts():
    """A seeded request's token at output position t comes from (seed, t) alone: the same
    whether it is sampled one position per step or verified after drafts, and whatever else
    is in the batch."""
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    seeds = {j: position_seed(7, 10 + j) for j in range(4)}
    plain = [
        Sampler()(logits[j : j + 1], _metadata(1, 1.0, seeds={0: seeds[j]})).sampled_token_ids.item()
        for j in range(4)
    ]
    batch = torch.cat([torch.randn(2, V), logits])
    drafted = Sampler()(
        batch,
        _metadata(6, 1.0, seeds={2 + j: s for j, s in seeds.items()}),
        Drafts(torch.tensor([0, -1, plain[0], plain[1], (plain[2] + 1) % V, -1])),
    ).sampled_token_ids[2:]
    assert drafted.tolist() == plain
