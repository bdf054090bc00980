"""Activation functions models share."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """Gated SiLU for fused gate/up projections: ``[..., 2d] -> silu(x[..., :d]) * x[..., d:]``."""

    op_name = "silu_and_mul"

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)


_ACTIVATIONS = {
    "gelu": lambda: nn.GELU(),
    "gelu_new": lambda: nn.GELU(approximate="tanh"),
    "gelu_fast": lambda: nn.GELU(approximate="tanh"),
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": lambda: nn.SiLU(),
    "swish": lambda: nn.SiLU(),
    "relu": lambda: nn.ReLU(),
}


def get_act_fn(name: str) -> nn.Module:
    """The activation a HF config names in ``hidden_act``."""
    try:
        return _ACTIVATIONS[name.lower()]()
    except KeyError:
        raise ValueError(
            f"unsupported activation {name!r}; supported: {', '.join(sorted(_ACTIVATIONS))}"
        ) from None
