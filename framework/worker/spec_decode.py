"""The model runner's side of speculative decoding: asking the proposer for drafts. They are
verified by the one sampling path (``tokenmill.sample``) in the model runner's ``_sample``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tokenmill.interfaces.proposer import ProposalBatch, Proposer, TargetStep

if TYPE_CHECKING:
    from tokenmill.worker.model_runner import ModelRunner


def propose(
    runner: ModelRunner,
    proposer: Proposer,
    req_ids: list[str],
    sampled_req_ids: list[str],
    step: TargetStep | None,
) -> dict[str, list[int]]:
    """Drafts, after a step that speculates, for the requests that sampled and have room for
    ``k`` more tokens. Every sampling feature combines with drafts: each verified position's
    logits are processed with the drafts before it (penalties, bad words, ``min_tokens``, the
    grammar, which also cuts a constrained request's drafts in the engine core). A proposer's
    ``draft_probs`` are kept in ``runner.draft_probs`` for the next step's verification."""
    batch = runner.batch
    assert batch is not None
    k = proposer.spec.num_speculative_tokens
    max_len = runner.config.max_model_len
    eligible: list[str] = []
    for req_id in sampled_req_ids:
        state = batch.requests[req_id]
        if batch.num_tokens[state.row] + k < max_len:
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
            if proposal.draft_probs is not None:
                runner.draft_probs[req_id] = proposal.draft_probs[j, :n]
    return drafts
