"""Triton fused-MoE: grouped GEMMs over (token, expert) pairs sorted by expert.

The pairs are sorted by expert and each expert's run is padded to a multiple of ``BLOCK_M``, so
every ``BLOCK_M`` rows of the sorted order belong to one expert (``block_expert``); padding rows
hold the sentinel ``num_pairs`` and are neither read nor written. One kernel serves both GEMMs:
``x[token] @ w13[e].T`` (rows gathered by token) and ``act[pair] @ w2[e].T`` scaled by the
pair's routing weight; the ``top_k`` rows of each token are then summed.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernels run on CPU tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    weights_ptr,
    num_pairs,
    N,
    K,
    stride_a_m,
    stride_b_e,
    stride_b_n,
    stride_c_m,
    TOP_K_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``c[pair, :] = a[pair // TOP_K_DIV, :] @ b[expert].T`` for the ``BLOCK_M`` sorted pairs
    of program row ``pid_m`` (one expert), times the pair's weight when ``MUL_WEIGHT``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + offs_m).to(tl.int64)
    m_valid = pair < num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    row = pair // TOP_K_DIV
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        a = tl.load(
            a_ptr + row[:, None] * stride_a_m + offs_k[None, :],
            mask=m_valid[:, None] & k_valid[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + expert * stride_b_e + offs_n[None, :] * stride_b_n + offs_k[:, None],
            mask=k_valid[:, None] & n_valid[None, :],
            other=0.0,
        )
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    if MUL_WEIGHT:
        acc *= tl.load(weights_ptr + pair, mask=m_valid, other=0.0)[:, None]
    tl.store(
        c_ptr + pair[:, None] * stride_c_m + offs_n[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=m_valid[:, None] & n_valid[None, :],
    )


def align_pairs_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_pairs, block_expert)``: pair indices (``token * top_k + slot``) sorted by
    expert, each expert's run padded with the sentinel ``num_pairs`` to a multiple of
    ``block_m``; and the expert of each ``block_m`` rows. Experts without pairs take no
    blocks."""
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    rank_in_expert = torch.arange(num_pairs, device=flat.device) - start[sorted_experts]
    total = int(padded.sum())
    sorted_pairs = torch.full((total,), num_pairs, dtype=torch.int64, device=flat.device)
    sorted_pairs[padded_start[sorted_experts] + rank_in_expert] = order
    block_expert = torch.repeat_interleave(
        torch.arange(num_experts, device=flat.device), padded // block_m
    )
    return sorted_pairs, block_expert


def _gemm(a, b, sorted_pairs, block_expert, weights, num_pairs, top_k_div, block_m):
    num_experts, n, k = b.shape
    c = a.new_empty(num_pairs, n)
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a,
        b,
        c,
        sorted_pairs,
        block_expert,
        weights,
        num_pairs,
        n,
        k,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        TOP_K_DIV=top_k_div,
        MUL_WEIGHT=weights is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else None,
    )
    return c


def fused_experts_triton(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_m: int = 16,
) -> torch.Tensor:
    """SwiGLU experts as :func:`~tokenmill.layers.fused_moe.stacked_expert_mlp` computes
    them, in two grouped-GEMM launches. [T, H] in, [T, H] out."""
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    sorted_pairs, block_expert = align_pairs_by_expert(topk_ids, w13.shape[0], block_m)
    x = hidden_states.contiguous()
    gate_up = _gemm(x, w13, sorted_pairs, block_expert, None, num_pairs, top_k, block_m)
    inter = w2.shape[2]
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    weights = topk_weights.flatten().to(torch.float32).contiguous()
    out = _gemm(act, w2, sorted_pairs, block_expert, weights, num_pairs, 1, block_m)
    return out.view(num_tokens, top_k, -1).sum(dim=1)
