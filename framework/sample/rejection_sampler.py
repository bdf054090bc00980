"""Verifying draft tokens: the rule the sampler applies at the positions of a request's drafts.

A request with ``k`` drafts ``d_0 .. d_{k-1}`` has ``k + 1`` sampling positions; position ``j``
sees the request's tokens plus ``d_0 .. d_{j-1}``. The sampler (``sampler.py``) processes every
position's logits in its one order and draws each position's token ``x_j`` from the target's
distribution ``p_j``; the drafts are then accepted while ``x_j == d_j`` and the request emits
``x_0 .. x_a`` (``a`` accepted drafts, then the target's own token at the first mismatch, or
the bonus token after the last draft). For deterministic drafts (the proposer gives no
``draft_probs``: n-gram, EAGLE, MTP, a draft model for greedy requests) ``x_j`` is the sampler's ordinary
draw, so ``P(accept d_j) = p_j(d_j)`` and on a rejection the token is ``p_j`` restricted to
``!= d_j``: exactly ``p_j``. Greedy rows accept while the draft is the argmax.

With ``draft_probs`` (a draft distribution ``q``: a draft model's for random requests, see
``sampler.sample_draft``), ``apply_draft_probs`` makes ``x_j`` follow
the standard rule instead: ``d_j`` with probability ``min(1, p_j(d_j) / q_j(d_j))``, else a draw
from ``normalize(max(p_j - q_j, 0))`` (``p_j`` when that is empty), again exactly ``p_j``.

Seeds: a seeded request's randomness at output position ``t`` (its race's ``q`` and, with
``draft_probs``, the acceptance uniform) comes from ``(seed, t)`` alone. With deterministic
drafts its output is therefore identical with and without speculation and in any batch. With
``draft_probs`` it is still independent of the batch and distributed as without speculation,
but not draw for draw the same: whether a draft is accepted also depends on its ``q``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Drafts:
    """The draft tokens of one step, by sampling position.

    Attributes:
        token_ids: ``[P]`` int64: the draft each position's token is compared with, -1 at a
            request's last position (its bonus position).
        probs: ``[P, V]`` the draft distribution each draft was drawn from (rows of bonus
            positions are not read), or None for deterministic drafts.
    """

    token_ids: torch.Tensor
    probs: torch.Tensor | None = None


def apply_draft_probs(probs: torch.Tensor, drafts: Drafts, uniforms: torch.Tensor) -> torch.Tensor:
    """What each position's token is drawn from under the standard rule: one-hot at the draft
    when ``uniform * q(d) < p(d)`` (accepted), else the residual ``max(p - q, 0)`` (``p`` when
    it is empty), unnormalised; bonus positions keep ``p``. ``probs`` is ``[P, V]``, ``uniforms``
    ``[P]``; returns a new tensor."""
    assert drafts.probs is not None
    has_draft = (drafts.token_ids >= 0).unsqueeze(1)
    d = drafts.token_ids.clamp_min(0).unsqueeze(1)
    q = drafts.probs.to(torch.float32)
    accept = (uniforms.unsqueeze(1) * q.gather(1, d) < probs.gather(1, d)) & has_draft
    residual = (probs - q).clamp_min_(0)
    use_residual = has_draft & (residual.sum(dim=1, keepdim=True) > 0)
    one_hot = torch.zeros_like(probs).scatter_(1, d, 1.0)
    return torch.where(accept, one_hot, torch.where(use_residual, residual, probs))


def num_accepted(tokens: np.ndarray, draft_ids: np.ndarray, num_positions: np.ndarray) -> np.ndarray:
    """Accepted drafts per request: how many of its positions, from its first, drew their
    draft. ``tokens`` and ``draft_ids`` are ``[P]``, request by request, ``num_positions[r]``
    each; a bonus position's draft is -1 and never matches."""
    match = tokens == draft_ids
    starts = np.cumsum(num_positions) - num_positions
    # The first mismatch of each request: every request has one (its bonus position).
    mismatch = np.flatnonzero(~match)
    first = mismatch[np.searchsorted(mismatch, starts)]
    return first - starts
