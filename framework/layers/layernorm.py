"""RMSNorm with an optional fused residual add (vLLM semantics)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.build_context import current_build_context
from tokenmill.layers.custom_op import CustomOp


class RMSNorm(CustomOp):
    """``x / rms(x) * weight``, computed in float32 and returned in the input dtype.

    ``forward(x)`` returns the normed tensor. ``forward(x, residual)`` first forms
    ``x + residual`` and returns ``(normed, x + residual)``: the sum is the next layer's
    residual, so a decoder layer needs no separate add. As in vLLM, the fused form may write
    its results into ``x`` and ``residual`` (the CPU kernel does): use the returned tensors.
    """

    op_name = "rms_norm"

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=current_build_context().dtype), requires_grad=False
        )

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32:
            out = F.rms_norm(x, self.weight.shape, self.weight, self.variance_epsilon)
        else:
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            out = xf.to(x.dtype) * self.weight
        return out if residual is None else (out, residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"


class ResidualSum(CustomOp):
    """The residual stream between two decoder layers: ``forward(x, residual, out)`` writes
    ``x + residual`` (``x`` before the first layer) into ``out``, a [T, hidden] view that may
    be a column slice of a wider buffer."""

    op_name = "residual_sum"

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor) -> None:
        if residual is None:
            out.copy_(x)
        else:
            torch.add(x, residual, out=out)
