"""MoE experts on CUDA: the Triton fused-MoE kernel (``tokenmill.layers.fused_moe_triton``), one
launch per GEMM over every (token, expert) pair, as the CUDA platform's ``unquantized_fused_moe``
op."""

from __future__ import annotations

import torch

from tokenmill.layers.fused_moe import FusedMoE, UnquantizedFusedMoEMethod
from tokenmill.layers.fused_moe_triton import fused_experts_triton


class TritonFusedMoEMethod(UnquantizedFusedMoEMethod):
    """The Triton kernel for CUDA tensors; the generic sorted-expert path for any other."""

    def apply(
        self,
        layer: FusedMoE,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        if not hidden_states.is_cuda:
            return super().apply(layer, hidden_states, topk_weights, topk_ids)
        return fused_experts_triton(hidden_states, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)
