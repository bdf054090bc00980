"""Applying a grammar bitmask to a batch of logits."""

from __future__ import annotations

import numpy as np
import torch


def apply_grammar_bitmask(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
    """In place: set to ``-inf`` the logits of tokens the grammar forbids.

    ``bitmask`` row i (int32 words, bit ``t % 32`` of word ``t // 32`` set when token t is
    allowed) masks ``logits`` row ``rows[i]``; other rows are left alone. Uses xgrammar's
    kernel for the logits' device."""
    import xgrammar as xgr

    if not rows:
        return
    full = np.full((logits.shape[0], bitmask.shape[1]), -1, dtype=np.int32)
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(logits, torch.from_numpy(full).to(logits.device), indices=rows)
