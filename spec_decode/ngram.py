"""The ``ngram`` proposer: prompt lookup decoding.

For each request, the longest suffix of its tokens (between ``prompt_lookup_min`` and
``prompt_lookup_max`` long) that also occurs earlier in its prompt or output; the tokens that
followed its first earlier occurrence are the drafts. Vectorised over the batch with numpy on
the runner's persistent token arrays (``TokenView``). The proposers with a model of their own draft from the
same lookup first when ``prompt_lookup_*`` is given (``model_proposer.py``).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tokenmill.interfaces.proposer import Proposal, ProposalBatch, Proposer, TokenView


class NgramProposer(Proposer):
    def propose(self, batch: ProposalBatch) -> Proposal:
        lookup_min, lookup_max = self.spec.prompt_lookup_min, self.spec.prompt_lookup_max
        assert lookup_min is not None and lookup_max is not None
        return prompt_lookup(batch.input_batch, batch.rows, batch.num_speculative_tokens, lookup_min, lookup_max)


def prompt_lookup(
    input_batch: TokenView, rows: np.ndarray, k: int, lookup_min: int, lookup_max: int
) -> Proposal:
    """Up to ``k`` drafts for each of ``rows``: the tokens after the first earlier occurrence
    of its longest suffix of ``lookup_min``..``lookup_max`` tokens (none where no suffix recurs)."""
    num_reqs = len(rows)
    drafts = np.zeros((num_reqs, k), dtype=np.int64)
    num_drafts = np.zeros(num_reqs, dtype=np.int64)
    if num_reqs == 0:
        return Proposal(drafts, num_drafts)
    lengths = input_batch.num_tokens[rows]
    tokens = input_batch.token_ids[rows, : int(lengths.max())]
    found = np.full(num_reqs, -1, dtype=np.int64)
    for n in range(min(lookup_max, int(lengths.max()) - 1), lookup_min - 1, -1):
        todo = (found < 0) & (lengths > n)
        if not todo.any():
            break
        idx = np.nonzero(todo)[0]
        sub, sub_len = tokens[idx], lengths[idx]
        suffix = sub[np.arange(len(idx))[:, None], sub_len[:, None] - n + np.arange(n)]
        windows = sliding_window_view(sub, n, axis=1)
        starts = np.arange(windows.shape[1])
        match = (windows == suffix[:, None, :]).all(axis=2)
        match &= starts[None, :] + n < sub_len[:, None]
        has = match.any(axis=1)
        found[idx[has]] = match[has].argmax(axis=1) + n
    for j in np.nonzero(found >= 0)[0]:
        start = found[j]
        end = min(start + k, lengths[j])
        num_drafts[j] = end - start
        drafts[j, : end - start] = tokens[j, start:end]
    return Proposal(drafts, num_drafts)
