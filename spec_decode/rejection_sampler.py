"""The rejection sampler: verifies draft tokens against the target model's distributions.

Request ``r`` brings ``k_r`` draft tokens and ``k_r + 1`` target positions (the logits after
its last accepted token and after each draft). ``p`` is the distribution the normal sampler
would draw from at each position (``compute_probs``: temperature, min-p, top-k, top-p; one-hot
at the argmax for greedy rows) and ``q`` the draft's (one-hot at the draft token when the
proposer gives no probabilities, as n-gram and greedy drafting do).

- Draft ``j`` is accepted with probability ``min(1, p(d_j) / q(d_j))`` while all before it
  were; greedy rows accept while the draft equals the target's argmax.
- At the first rejection the token is drawn from ``normalize(max(p - q, 0))`` ("recovered").
- When all ``k_r`` pass, a bonus token is drawn from ``p`` at the last position.

The emitted tokens are then distributed exactly as tokens sampled one at a time from ``p``.
Seeded requests draw their uniforms and their exponential race from their own generator, in
an order fixed by their own drafts, so their samples do not depend on the batch; a request
without drafts draws exactly what the normal sampler draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.sample.sampler import (
    SamplingMetadata,
    compute_probs,
    exponential_race,
    gather_logprobs,
)
from tokenmill.sampling_params import GREEDY_TEMPERATURE_EPS


@dataclass
class RejectionOutput:
    """Tokens emitted per request and, when asked, their log-probabilities.

    Attributes:
        token_ids: ``[R, K + 1]`` int64: accepted drafts, then the recovered or bonus token;
            -1 after the ``num_emitted[r]`` tokens of row ``r``.
        num_emitted: ``[R]`` int64, ``1 + accepted drafts``.
        logprob_token_ids: ``[R, K + 1, 1 + N]``: each emitted token, then the top-N.
        logprobs: ``[R, K + 1, 1 + N]`` float32, from ``reported`` (see ``rejection_sample``).
        ranks: ``[R, K + 1]`` the rank of each emitted token.
    """

    token_ids: torch.Tensor
    num_emitted: torch.Tensor
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None


def rejection_sample(
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generators: dict[int, torch.Generator],
    reported: torch.Tensor | None = None,
) -> RejectionOutput:
    """Verify drafts for ``R`` requests.

    Args:
        logits: ``[P, V]`` float32 target logits after logits processing, ``P = sum(k_r + 1)``,
            request by request.
        metadata: the sampling settings of each of the ``P`` positions (a request's repeated);
            its ``generators`` are not used.
        draft_token_ids: ``[R, K]`` int64, row ``r`` valid in its first ``k_r`` entries.
        num_draft_tokens: ``[R]`` int64, ``k_r <= K``.
        draft_probs: ``[R, K, V]`` draft distributions, or None for deterministic drafts.
        generators: request index -> generator of a seeded random request.
        reported: ``[P, V]`` what logprobs report, by the engine's ``logprobs_mode`` (default:
            the log-softmax of ``logits``).
    """
    num_reqs, max_k = draft_token_ids.shape
    device = logits.device
    starts = torch.cumsum(num_draft_tokens + 1, 0) - (num_draft_tokens + 1)
    steps = torch.arange(max_k, device=device)
    valid = steps.unsqueeze(0) < num_draft_tokens.unsqueeze(1)
    pos = starts.unsqueeze(1) + torch.minimum(steps.unsqueeze(0), num_draft_tokens.unsqueeze(1))
    drafts = torch.where(valid, draft_token_ids, 0)
    if metadata.all_greedy:
        argmax = logits.max(dim=-1).indices
        accept = (argmax[pos] == drafts) & valid
        num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
        final = argmax[starts + num_accepted]
    else:
        num_accepted, final = _random_verify(
            logits, metadata, drafts, valid, pos, starts, num_draft_tokens, draft_probs, generators
        )

    token_ids = torch.full((num_reqs, max_k + 1), -1, dtype=torch.int64, device=device)
    token_ids[:, :max_k] = torch.where(steps.unsqueeze(0) < num_accepted.unsqueeze(1), drafts, -1)
    token_ids.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
    out = RejectionOutput(token_ids, num_accepted + 1)
    if metadata.max_num_logprobs is not None:
        emitted_pos = starts.unsqueeze(1) + torch.arange(max_k + 1, device=device).unsqueeze(0)
        emitted_pos = torch.minimum(emitted_pos, (starts + num_draft_tokens).unsqueeze(1))
        source = logits.log_softmax(dim=-1) if reported is None else reported
        ids, values, ranks = gather_logprobs(
            source[emitted_pos.flatten()], token_ids.clamp_min(0).flatten(), metadata.max_num_logprobs
        )
        out.logprob_token_ids = ids.view(num_reqs, max_k + 1, -1)
        out.logprobs = values.view(num_reqs, max_k + 1, -1)
        out.ranks = ranks.view(num_reqs, max_k + 1)
    return out


def _random_verify(
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    drafts: torch.Tensor,
    valid: torch.Tensor,
    pos: torch.Tensor,
    starts: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generators: dict[int, torch.Generator],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted drafts per request and the recovered or bonus token after them."""
    num_reqs, max_k = drafts.shape
    device = logits.device
    probs = compute_probs(logits, metadata)
    p_draft = probs[pos.flatten(), drafts.flatten()].view(num_reqs, max_k)
    greedy = (metadata.temperature[starts] < GREEDY_TEMPERATURE_EPS).unsqueeze(1)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2).to(torch.float32)
    uniforms = _uniforms(num_reqs, max_k, num_draft_tokens, generators, device)
    accept = torch.where(greedy, p_draft > 0, uniforms * q_draft < p_draft) & valid
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)

    dist = probs[starts + num_accepted]
    rejected = num_accepted < num_draft_tokens
    if rejected.any():
        rows = torch.nonzero(rejected).squeeze(1)
        at = num_accepted[rows]
        if draft_probs is None:
            recovered = dist[rows]
            recovered[torch.arange(len(rows), device=device), drafts[rows, at]] = 0.0
        else:
            recovered = (dist[rows] - draft_probs[rows, at].to(torch.float32)).clamp_min_(0)
        empty = recovered.sum(dim=1, keepdim=True) <= 0
        dist[rows] = torch.where(empty, dist[rows], recovered)
    return num_accepted, exponential_race(dist, generators)


def _uniforms(
    num_reqs: int,
    max_k: int,
    num_draft_tokens: torch.Tensor,
    generators: dict[int, torch.Generator],
    device: torch.device,
) -> torch.Tensor:
    """``[R, K]`` uniforms in [0, 1); a seeded row draws exactly its ``k_r`` from its generator."""
    uniforms = torch.rand(num_reqs, max_k, device=device)
    counts = num_draft_tokens.tolist() if generators else []
    for row, generator in generators.items():
        k = counts[row]
        if k:
            uniforms[row, :k] = torch.rand(k, device=device, generator=generator)
    return uniforms
