"""The model runner's side of speculative decoding: verifying the drafts a step scheduled and
asking the proposer for the next ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.interfaces.proposer import ProposalBatch, Proposer, TargetStep
from tokenmill.logprobs import LogprobsLists
from tokenmill.sample.sampler import process_logits
from tokenmill.sampling_params import GREEDY_TEMPERATURE_EPS

if TYPE_CHECKING:
    from tokenmill.worker.model_runner import ModelRunner


@dataclass
class Verified:
    """Tokens emitted per sampling row after verification, and rejected drafts per row."""

    sampled: dict[str, list[int]]
    logprobs: dict[str, LogprobsLists]
    num_rejected: np.ndarray


def verify(
    runner: ModelRunner,
    req_ids: list[str],
    sampling: np.ndarray,
    rows: np.ndarray,
    cu: np.ndarray,
    hidden: torch.Tensor,
    spec_tokens: dict[str, list[int]],
) -> Verified:
    """Run the rejection sampler over the ``k_r + 1`` last positions of each sampling row."""
    from tokenmill.spec_decode.rejection_sampler import rejection_sample

    batch = runner.batch
    assert batch is not None and runner.model is not None
    num_draft = np.array([len(spec_tokens.get(req_ids[i], ())) for i in sampling], dtype=np.int64)
    max_k = int(num_draft.max())
    drafts = np.zeros((len(sampling), max_k), dtype=np.int64)
    for j, i in enumerate(sampling):
        drafts[j, : num_draft[j]] = spec_tokens.get(req_ids[i], ())
    counts = num_draft + 1
    ends = cu[sampling]
    offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    positions = np.repeat(ends - counts, counts) + offsets
    logits = runner.model.compute_logits(hidden[runner._tensor(positions, torch.int64)])
    expanded = np.repeat(sampling, counts)
    metadata = runner._sampling_metadata(req_ids, expanded, np.repeat(rows, counts))
    greedy = batch.temperature[rows] < GREEDY_TEMPERATURE_EPS
    generators = {
        j: batch.requests[req_ids[i]].generator
        for j, i in enumerate(sampling)
        if batch.requests[req_ids[i]].generator is not None and not greedy[j]
    }
    processed = process_logits(logits, metadata)
    reported = None
    if metadata.max_num_logprobs is not None:
        mode = runner.sampler.logprobs_mode
        reported = logits.float() if mode.startswith("raw") else processed
        if mode.endswith("logprobs"):
            reported = reported.log_softmax(dim=-1)
    out = rejection_sample(
        processed,
        metadata,
        runner._tensor(drafts, torch.int64),
        runner._tensor(num_draft, torch.int64),
        None,
        generators,
        reported,
    )
    token_ids = out.token_ids.cpu().numpy()
    emitted = out.num_emitted.cpu().numpy()
    sampled = {req_ids[i]: token_ids[j, : emitted[j]].tolist() for j, i in enumerate(sampling)}
    logprobs: dict[str, LogprobsLists] = {}
    if out.logprobs is not None:
        ids, values = out.logprob_token_ids.cpu().tolist(), out.logprobs.cpu().tolist()
        ranks = out.ranks.cpu().tolist()
        for j, i in enumerate(sampling):
            params = batch.requests[req_ids[i]].sampling_params
            if params.logprobs is not None:
                n, emitted_j = 1 + params.logprobs, range(emitted[j])
                logprobs[req_ids[i]] = LogprobsLists(
                    [ids[j][t][:n] for t in emitted_j],
                    [values[j][t][:n] for t in emitted_j],
                    [ranks[j][t] for t in emitted_j],
                )
    return Verified(sampled, logprobs, num_draft + 1 - emitted)


def append_emitted(runner: ModelRunner, rows: np.ndarray, emitted: list[list[int]]) -> None:
    """Append each row's emitted tokens to the input batch, position by position."""
    batch = runner.batch
    assert batch is not None
    lengths = np.array([len(t) for t in emitted])
    padded = np.zeros((len(rows), int(lengths.max())), dtype=np.int64)
    for j, tokens in enumerate(emitted):
        padded[j, : len(tokens)] = tokens
    for t in range(padded.shape[1]):
        alive = lengths > t
        batch.append_sampled(rows[alive], padded[alive, t])


def propose(
    runner: ModelRunner,
    proposer: Proposer,
    req_ids: list[str],
    sampled_req_ids: list[str],
    step: TargetStep | None,
) -> dict[str, list[int]]:
    """Drafts, after a step that speculates, for the requests that sampled and may: not those
    with penalties (their logits depend on every earlier token) or bad words (their bans depend
    on the tokens before), those still under ``min_tokens``, nor those under a structured-output
    constraint (its mask is built for one position per step)."""
    batch = runner.batch
    assert batch is not None
    k = proposer.spec.num_speculative_tokens
    max_len = runner.config.max_model_len
    eligible: list[str] = []
    for req_id in sampled_req_ids:
        state = batch.requests[req_id]
        num_tokens = batch.num_tokens[state.row]
        if batch.uses_penalties[state.row] or num_tokens + k >= max_len:
            continue
        if num_tokens - state.num_prompt_tokens < state.sampling_params.min_tokens:
            continue
        params = state.sampling_params
        if params.structured_outputs is not None or params.bad_words_token_ids:
            continue
        eligible.append(req_id)
    if not eligible and not proposer.uses_target_step:
        return {}
    rows = np.array([batch.requests[r].row for r in eligible], dtype=np.int64)
    proposal = proposer.propose(ProposalBatch(eligible, rows, batch, k, step))
    drafts = {}
    for j, req_id in enumerate(eligible):
        n = int(proposal.num_draft_tokens[j])
        if n:
            drafts[req_id] = proposal.draft_token_ids[j, :n].tolist()
    return drafts
