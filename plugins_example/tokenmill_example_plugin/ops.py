"""The example platform's own RMSNorm op, swapped in through its op table.

It computes RMSNorm in one expression (plain torch, never in place) and counts its calls in
``CALLS``, so a test can see that the platform's op, not the layer's ``forward_native``, ran.
"""

from __future__ import annotations

from collections import Counter

import torch

from tokenmill.layers.layernorm import RMSNorm

CALLS: Counter[str] = Counter()


def rms_norm(
    layer: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm.forward_native``'s contract."""
    CALLS["rms_norm"] += 1
    if residual is not None:
        x = x + residual
    xf = x.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + layer.variance_epsilon)).to(x.dtype)
    out = out * layer.weight
    return out if residual is None else (out, x)
