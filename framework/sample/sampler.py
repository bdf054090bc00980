"""Batched token sampling from float32 logits, with vLLM V1's semantics: the one sampling path.

Every step samples through ``Sampler`` over the sampling positions of its requests: one per
request, or ``k + 1`` for a request with ``k`` draft tokens, where position ``j`` sees the
request's tokens plus its first ``j`` drafts (the caller builds each position's metadata from
that history: penalty counts, bad-word prefixes, ``min_tokens``, grammar mask). Order of
operations for logits ``[P, V]`` (the grammar bitmask is applied by the caller beforehand):

1. logits processing, vLLM's order: tokens outside ``allowed_token_ids`` and forbidden token
   ids (``min_tokens`` not yet reached, bad words) get ``-inf``; ``logit_bias`` is added; then
   the repetition penalty divides (positive) or multiplies (negative) the logits of tokens seen
   in the prompt or output, and ``frequency * count + presence * (count > 0)`` of the output
   tokens is subtracted;
2. greedy rows take the argmax; random rows divide by their temperature, apply min-p,
   then top-k, then top-p (renormalising after each), take the softmax and draw with the
   exponential race ``argmax(probs / q)``, ``q ~ Exponential(1)``, which samples from
   ``probs`` exactly. A seeded request draws the ``q`` of its output position ``t`` from a
   generator seeded from ``(seed, t)`` alone (``position_seed``), so its samples depend
   neither on the batch nor on whether a step speculates;
3. positions with a draft token then compare it with their token (``rejection_sampler.py``:
   the drafts are accepted while equal); with draft probabilities the standard
   accept-or-recover rule shapes the distribution before the race;
4. logprobs of each position's token, when asked: by default (``logprobs_mode="raw_logprobs"``,
   vLLM's default) the ``log_softmax`` of the logits before step 1; ``"processed_logprobs"``
   after step 1 and, for random rows, after temperature, min-p, top-k and top-p (masked tokens
   ``-inf``); the ``*_logits`` modes return the logits themselves instead.

A step without drafts is exactly one position per request and no step 3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from tokenmill.engine_args import LOGPROBS_MODES, LogprobsMode
from tokenmill.sample.rejection_sampler import Drafts, apply_draft_probs
from tokenmill.sampling_params import GREEDY_TEMPERATURE_EPS

if TYPE_CHECKING:
    from tokenmill.interfaces.proposer import TokenView


@dataclass
class Penalties:
    """Penalty settings of the rows of one batch; rows without penalties hold the off values.

    Attributes:
        presence: ``[B]`` float32.
        frequency: ``[B]`` float32.
        repetition: ``[B]`` float32.
        prompt_mask: ``[B, V]`` bool: the token occurs in the row's prompt.
        output_counts: ``[B, V]`` int32: how often the token occurs in the row's output.
    """

    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    prompt_mask: torch.Tensor
    output_counts: torch.Tensor


@dataclass
class SamplingMetadata:
    """Per-row sampling settings of one batch, as tensors on the logits' device.

    Attributes:
        temperature: ``[B]`` float32; rows below 1e-5 (0) are greedy.
        all_greedy: every row is greedy.
        all_random: no row is greedy.
        top_p: ``[B]`` float32 (1.0 where off); None when no row uses it.
        top_k: ``[B]`` int64 (V where off); None when no row uses it.
        min_p: ``[B]`` float32 (0.0 where off); None when no row uses it.
        seeds: row -> the seed of a seeded random row's draws (``position_seed``).
        max_num_logprobs: largest top-N any row asks for; None when no row wants logprobs.
        suppress_token_ids: row -> token ids that row may not sample (EOS and
            ``stop_token_ids`` while ``min_tokens`` is not reached).
        disallowed_mask: ``[B, V]`` bool, True for tokens outside a row's
            ``allowed_token_ids``; None when no row restricts them.
        logit_bias: ``(rows, token ids, biases)`` as three 1-D tensors; None when no row has one.
        penalties: None when no row uses presence, frequency or repetition penalties.
    """

    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None
    top_k: torch.Tensor | None
    min_p: torch.Tensor | None
    seeds: dict[int, int]
    max_num_logprobs: int | None
    suppress_token_ids: dict[int, list[int]]
    disallowed_mask: torch.Tensor | None = None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    penalties: Penalties | None = None


@dataclass
class SamplerOutput:
    """The token of each sampling position and, when asked, its log-probabilities.

    Attributes:
        sampled_token_ids: ``[B]`` int64 (at a draft position: the draft when accepted).
        logprob_token_ids: ``[B, 1 + N]`` int64: the sampled token, then the top-N tokens
            by log-probability (descending), ``N = max_num_logprobs``.
        logprobs: ``[B, 1 + N]`` float32 log-probabilities of ``logprob_token_ids``.
        sampled_token_ranks: ``[B]`` int64 rank of each sampled token (1 = most likely).
    """

    sampled_token_ids: torch.Tensor
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_token_ranks: torch.Tensor | None = None


class Sampler(nn.Module):
    """Samples one token per row of ``logits`` (see the module docstring for the order);
    ``drafts`` are the step's draft tokens by row, None in a step without drafts."""

    def __init__(self, logprobs_mode: LogprobsMode = "raw_logprobs") -> None:
        super().__init__()
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode

    def forward(
        self, logits: torch.Tensor, metadata: SamplingMetadata, drafts: Drafts | None = None
    ) -> SamplerOutput:
        logits = logits.to(torch.float32)
        wants_logprobs = metadata.max_num_logprobs is not None
        raw = self.logprobs_mode.startswith("raw")
        reported = logits if wants_logprobs and raw else None
        logits = process_logits(logits, metadata)
        if metadata.all_greedy:
            # Same first-index tie rule as argmax, and several times faster on the CPU.
            sampled = logits.max(dim=-1).indices
            if wants_logprobs and not raw:
                reported = logits
        else:
            processed = processed_logits(logits, metadata)
            if wants_logprobs and not raw:
                reported = processed
            probs = to_probs(processed, logits, metadata)
            with_q = drafts is not None and drafts.probs is not None
            q, uniforms = random_draws(probs, metadata.seeds, with_q)
            if with_q:
                probs = apply_draft_probs(probs, drafts, uniforms)
            sampled = probs.div_(q).argmax(dim=-1)
        if reported is None:
            return SamplerOutput(sampled)
        if self.logprobs_mode.endswith("logprobs"):
            reported = reported.log_softmax(dim=-1)
        token_ids, logprobs, ranks = gather_logprobs(reported, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled, token_ids, logprobs, ranks)


def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Step 1 of the module docstring: float32 logits with ``allowed_token_ids``, suppressed
    tokens, ``logit_bias`` and penalties applied (a new tensor)."""
    logits = logits.to(torch.float32)
    if metadata.disallowed_mask is not None:
        logits = logits.masked_fill(metadata.disallowed_mask, float("-inf"))
    logits = apply_suppression(logits, metadata.suppress_token_ids)
    if metadata.logit_bias is not None:
        rows, token_ids, biases = metadata.logit_bias
        logits = logits.index_put((rows, token_ids), biases, accumulate=True)
    if metadata.penalties is not None:
        logits = apply_penalties(logits, metadata.penalties)
    return logits


def apply_suppression(logits: torch.Tensor, suppress_token_ids: dict[int, list[int]]) -> torch.Tensor:
    """Return ``logits`` with each row's forbidden token ids set to ``-inf`` (a new tensor).

    Ids outside the vocabulary are ignored: they can never be sampled anyway.
    """
    vocab_size = logits.shape[-1]
    pairs = [(row, t) for row, ids in suppress_token_ids.items() for t in ids if t < vocab_size]
    if not pairs:
        return logits
    index = torch.tensor(pairs, dtype=torch.long, device=logits.device).T
    return logits.index_put((index[0], index[1]), torch.tensor(float("-inf"), device=logits.device))


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """Return ``logits`` with the repetition, then the frequency and presence penalties applied
    (vLLM's and HF's semantics; a new tensor)."""
    output_mask = penalties.output_counts > 0
    repetition = penalties.repetition.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(penalties.prompt_mask | output_mask, penalised, logits)
    logits = logits - penalties.frequency.unsqueeze(1) * penalties.output_counts
    return logits - penalties.presence.unsqueeze(1) * output_mask


def processed_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """``logits / temperature`` (1 for greedy rows) with min-p, then top-k, then top-p applied
    (masked tokens ``-inf``): what random rows draw from. A new tensor."""
    temperature = metadata.temperature
    if not metadata.all_random:
        temperature = torch.where(temperature < GREEDY_TEMPERATURE_EPS, 1.0, temperature)
    scaled = logits / temperature.unsqueeze(1)
    if metadata.min_p is not None:
        apply_min_p_(scaled, metadata.min_p)
    if metadata.top_k is not None or metadata.top_p is not None:
        scaled = apply_top_k_top_p(scaled, metadata.top_k, metadata.top_p)
    return scaled


def to_probs(processed: torch.Tensor, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The softmax of ``processed``, with greedy rows one-hot at the argmax of
    ``logits``."""
    probs = processed.softmax(dim=-1)
    if not metadata.all_random:
        greedy = (metadata.temperature < GREEDY_TEMPERATURE_EPS).unsqueeze(1)
        argmax = logits.argmax(dim=-1, keepdim=True)
        kept = torch.where(greedy, 1.0, probs.gather(1, argmax))
        probs.masked_fill_(greedy, 0.0).scatter_(1, argmax, kept)
    return probs


def apply_min_p_(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place: mask tokens whose probability is below ``min_p`` times the row's largest.

    Done in log space: ``p_i < min_p * p_max`` iff ``logit_i < logit_max + log(min_p)``.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    logits.masked_fill_(logits < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Return ``logits`` with tokens outside each row's top-k, then outside its top-p, masked.

    One ascending sort serves both. Top-k keeps every token tied with the k-th largest.
    Top-p keeps the smallest set of largest tokens whose probability (after top-k) sums
    to at least p.
    """
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    vocab_size = logits.shape[-1]
    if top_k is not None:
        kth_pos = (vocab_size - top_k.clamp(1, vocab_size)).unsqueeze(1)
        kth_value = logits_sort.gather(1, kth_pos)
        logits_sort.masked_fill_(logits_sort < kth_value, float("-inf"))
    if top_p is not None:
        cum_probs = logits_sort.softmax(dim=-1).cumsum_(dim=-1)
        top_p_mask = cum_probs <= 1 - top_p.unsqueeze(1)
        top_p_mask[:, -1] = False
        logits_sort.masked_fill_(top_p_mask, float("-inf"))
    return torch.empty_like(logits_sort).scatter_(-1, logits_idx, logits_sort)


def random_draws(
    probs: torch.Tensor, seeds: dict[int, int], uniforms: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The exponential race's ``q ~ Exponential(1)``, shaped like ``probs``, and, when asked,
    one uniform in [0, 1) per row (after the row's ``q``).

    Rows in ``seeds`` draw from a generator seeded with their seed, the others from the
    default RNG in one call. ``q`` is clamped away from 0 so that a masked token
    (probability 0) can never win through ``0 / 0 = nan``."""
    q = torch.empty_like(probs)
    u = torch.rand(probs.shape[0], device=probs.device) if uniforms else None
    if len(seeds) != probs.shape[0]:
        q.exponential_()
    if seeds:
        generator = torch.Generator(device=probs.device)
        for row, seed in seeds.items():
            generator.manual_seed(seed)
            q[row].exponential_(generator=generator)
            if u is not None:
                u[row] = torch.rand((), device=probs.device, generator=generator)
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return q, u


_MASK64 = 2**64 - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """The seed of a seeded request's draws for its output token ``position`` (0 = first):
    a mix of both, so that every position's randomness comes from ``(seed, position)`` alone."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ position)


_DRAFT_STREAM = 0x5DEECE66D


def draft_seed(seed: int, position: int) -> int:
    """The seed of a draft model's draw of a seeded request's draft for output token
    ``position``: independent of the target's draws there (``position_seed``), which verify it."""
    return _splitmix64(position_seed(seed, position) ^ _DRAFT_STREAM)


def row_settings(
    temperature: np.ndarray,
    top_p: np.ndarray,
    top_k: np.ndarray,
    min_p: np.ndarray,
    vocab_size: int,
    device: torch.device,
    seeds: dict[int, int],
) -> SamplingMetadata:
    """The metadata of rows that use only the sampling settings (temperature, top-p, top-k
    where 0 is off, min-p, seeds): no logprobs, suppressed tokens, bias or penalties. The model
    runner adds those; ``sample_draft`` samples a draft model's drafts with it."""

    def tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)

    greedy = temperature < GREEDY_TEMPERATURE_EPS
    return SamplingMetadata(
        temperature=tensor(temperature, torch.float32),
        all_greedy=bool(greedy.all()),
        all_random=not bool(greedy.any()),
        top_p=tensor(top_p, torch.float32) if (top_p < 1).any() else None,
        top_k=tensor(np.where(top_k > 0, top_k, vocab_size), torch.int64) if (top_k > 0).any() else None,
        min_p=tensor(min_p, torch.float32) if (min_p > 0).any() else None,
        seeds=seeds,
        max_num_logprobs=None,
        suppress_token_ids={},
    )


def sample_draft(
    logits: torch.Tensor, view: TokenView, rows: np.ndarray, index: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A draft model's draft ``index`` (from 0) for each of ``rows``, from its logits
    ``[R, V]``: the drafts ``[R]`` and the distributions ``q`` ``[R, V]`` they were drawn from
    (one-hot at the argmax for greedy rows), or None when every row is greedy (deterministic
    drafts). ``q`` is the model's softmax after the temperature, min-p, top-k and top-p of the
    row's request (step 2 of the module docstring); a seeded request's draw is seeded by
    ``draft_seed`` at the draft's output position."""
    logits = logits.to(torch.float32)
    temperature = view.temperature[rows]
    if (temperature < GREEDY_TEMPERATURE_EPS).all():
        return logits.argmax(dim=-1), None
    seeds = {}
    for i, row in enumerate(rows.tolist()):
        seed = view.seeds.get(row)
        if seed is not None and temperature[i] >= GREEDY_TEMPERATURE_EPS:
            seeds[i] = draft_seed(seed, int(view.num_tokens[row] - view.num_prompt_tokens[row]) + index)
    settings = row_settings(
        temperature, view.top_p[rows], view.top_k[rows], view.min_p[rows], logits.shape[-1], logits.device, seeds
    )
    probs = to_probs(processed_logits(logits, settings), logits, settings)
    race, _ = random_draws(probs, seeds)
    return (probs / race).argmax(dim=-1), probs


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``([B, 1 + N] ids, [B, 1 + N] logprobs, [B] ranks)``: each row's ``token_ids``
    entry, then its top-N; the rank counts the tokens at least as likely as the row's token."""
    token_ids = token_ids.unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)
    ranks = (logprobs >= token_logprobs).sum(dim=-1)
    if num_logprobs == 0:
        return token_ids, token_logprobs, ranks
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    return (
        torch.cat([token_ids, top_ids], dim=1),
        torch.cat([token_logprobs, top_logprobs], dim=1),
        ranks,
    )
