"""The rejection sampler emits tokens distributed exactly as the target's, on small vocabularies."""

from __future__ import annotations

import pytest
import torch

from tokenmill.sample.sampler import SamplingMetadata, compute_probs
from tokenmill.spec_decode.rejection_sampler import rejection_sample

V = 6


def _metadata(num_positions: int, temperature: float, top_k: int | None = None, logprobs: int | None = None) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.full((num_positions,), temperature),
        all_greedy=temperature == 0,
        all_random=temperature > 0,
        top_p=None,
        top_k=None if top_k is None else torch.full((num_positions,), top_k),
        min_p=None,
        generators={},
        max_num_logprobs=logprobs,
        suppress_token_ids={},
    )


def _tv(samples: torch.Tensor, probs: torch.Tensor) -> float:
    freq = torch.bincount(samples, minlength=probs.numel()).double() / len(samples)
    return 0.5 * (freq - probs.double()).abs().sum().item()


@pytest.mark.parametrize("k, top_k, with_q", [(1, None, True), (3, None, True), (2, 3, True), (3, None, False)])
def test_output_distribution_equals_target(k, top_k, with_q):
    """Per position, the emitted token's distribution is the target's p (after temperature and
    top-k), whatever the draft's q; the acceptance rate is sum(min(p, q)) in closed form."""
    torch.manual_seed(k * 10 + (top_k or 0))
    n = 60_000
    logits = torch.randn(k + 1, V) * 2
    meta1 = _metadata(k + 1, 0.8, top_k)
    p = compute_probs(logits, meta1)
    q = torch.softmax(torch.randn(k, V) * 2, dim=-1)
    if with_q:
        drafts = torch.multinomial(q, n, replacement=True).T.contiguous()
        draft_probs = q.expand(n, k, V).contiguous()
    else:
        fixed = torch.randint(0, V, (k,))
        q = torch.nn.functional.one_hot(fixed, V).float()
        drafts = fixed.expand(n, k).contiguous()
        draft_probs = None
    out = rejection_sample(
        logits.repeat(n, 1),
        _metadata(n * (k + 1), 0.8, top_k),
        drafts,
        torch.full((n,), k),
        draft_probs,
        {},
    )
    tokens, emitted = out.token_ids, out.num_emitted
    assert ((tokens >= 0).sum(dim=1) == emitted).all()
    accepted_first = (emitted > 1).double().mean().item()
    assert abs(accepted_first - torch.minimum(p[0], q[0]).sum().item()) < 0.01
    assert _tv(tokens[:, 0], p[0]) < 0.015
    has_second = emitted > 1
    assert _tv(tokens[has_second, 1], p[1]) < 0.03
    assert (tokens[has_second, 0] == drafts[has_second, 0]).all()


def test_greedy_accepts_while_draft_is_argmax_then_takes_target():
    logits = torch.full((4 + 3, V), -5.0)
    target = [2, 4, 1, 0]  # request 0: k=3, argmax at its 4 positions
    for i, t in enumerate(target):
        logits[i, t] = 5.0
    logits[4:, 3] = 5.0  # request 1: k=2, argmax 3 everywhere
    drafts = torch.tensor([[2, 4, 5], [3, 3, 0]])
    out = rejection_sample(logits, _metadata(7, 0.0, logprobs=1), drafts, torch.tensor([3, 2]), None, {})
    assert out.num_emitted.tolist() == [3, 3]
    assert out.token_ids.tolist() == [[2, 4, 1, -1], [3, 3, 3, -1]]
    assert out.logprob_token_ids[0, :3, 0].tolist() == [2, 4, 1]
    expected = logits.log_softmax(-1)
    assert torch.allclose(out.logprobs[1, 2, 0], expected[6, 3])


def test_seeded_rows_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    drafts = torch.tensor([[1, 2]])

    def run(batch_extra: int) -> list[int]:
        g = torch.Generator().manual_seed(7)
        rows = 1 + batch_extra
        return rejection_sample(
            logits.repeat(rows, 1),
            _metadata(3 * rows, 1.0),
            drafts.repeat(rows, 1),
            torch.full((rows,), 2),
            None,
            {batch_extra: g},
        ).token_ids[batch_extra].tolist()

    assert run(0) == run(5)
