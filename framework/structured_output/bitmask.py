"""Applying a grammar bitmask to a batch of logits."""

from __future__ import annotations

import numpy as np
import torch


def apply_grammar_bitmask(
    logits: torch.Tensor,
    row_req_ids: list[str],
    bitmask_req_ids: list[str],
    bitmask: np.ndarray,
) -> None:
    """In place: set to ``-inf`` the logits of tokens the grammar forbids.

    ``logits`` row i belongs to request ``row_req_ids[i]``; ``bitmask`` row j (int32 words,
    bit ``t % 32`` of word ``t // 32`` set when token t is allowed) to ``bitmask_req_ids[j]``.
    Rows of requests without a bitmask row are left alone. Uses xgrammar's kernel for the
    logits' device."""
    import xgrammar as xgr

    position = {req_id: i for i, req_id in enumerate(row_req_ids)}
    pairs = [(position[r], j) for j, r in enumerate(bitmask_req_ids) if r in position]
    if not pairs:
        return
    sorted_bitmask = np.full((logits.shape[0], bitmask.shape[1]), -1, dtype=np.int32)
    rows = [i for i, _ in pairs]
    sorted_bitmask[rows] = bitmask[[j for _, j in pairs]]
    xgr.apply_token_bitmask_inplace(
        logits, torch.from_numpy(sorted_bitmask).to(logits.device), indices=rows
    )
