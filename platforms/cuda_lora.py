"""Batched LoRA on CUDA: a Triton kernel (punica's BGMV) as the CUDA platform's ``lora_apply``.

One program per (token, output slice, block of the slice's columns) reads the token's slot and
its adapter's rank on that slice, shrinks the token's features through the slot's ``A`` rows
(``x . A^T``, the rank padded to ``BLOCK_R`` and masked) and expands the result through the same
rows of ``B`` into its columns of the output, added in place. Tokens without an adapter (slot
-1) and slices an adapter leaves alone (rank 0) return at once. The shrink is recomputed by each
column block of a slice: its cost, ``rank x K``, is small next to a launch.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernel runs on CPU tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from tokenmill.layers.lora import LoRAApply

BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _lora_bgmv_kernel(
    out_ptr,
    x_ptr,
    a_ptr,
    b_ptr,
    slots_ptr,
    ranks_ptr,
    offsets_ptr,
    K,
    N,
    S,
    max_rank,
    stride_out,
    stride_x,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``out[t, cols] += (x[t] . A_{s,i}^T) . B_{s,i}[:, cols]`` for token ``t`` (program 0),
    slice ``i`` (program 1) and its column block (program 2); ``s`` is the token's slot."""
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1).to(tl.int64)
    block = tl.program_id(2)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slot * S + i)
    begin = tl.load(offsets_ptr + i)
    end = tl.load(offsets_ptr + i + 1)
    if rank == 0:
        return
    if begin + block * BLOCK_N >= end:
        return
    cols = begin + block * BLOCK_N + tl.arange(0, BLOCK_N)
    row0 = (slot * S + i) * max_rank
    offs_r = tl.arange(0, BLOCK_R)
    r_valid = offs_r < rank
    shrunk = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        xk = tl.load(x_ptr + t * stride_x + offs_k, mask=k_valid, other=0.0).to(tl.float32)
        a = tl.load(
            a_ptr + (row0 + offs_r)[:, None] * K + offs_k[None, :],
            mask=r_valid[:, None] & k_valid[None, :],
            other=0.0,
        ).to(tl.float32)
        shrunk += tl.sum(a * xk[None, :], axis=1)
    c_valid = cols < end
    b = tl.load(
        b_ptr + (row0 + offs_r)[:, None] * N + cols[None, :],
        mask=r_valid[:, None] & c_valid[None, :],
        other=0.0,
    ).to(tl.float32)
    delta = tl.sum(shrunk[:, None] * b, axis=0)
    dst = out_ptr + t * stride_out + cols
    current = tl.load(dst, mask=c_valid, other=0.0)
    tl.store(dst, (current.to(tl.float32) + delta).to(current.dtype), mask=c_valid)


def lora_bgmv(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    slice_ranks: torch.Tensor,
    slice_offsets: torch.Tensor,
    max_rank: int,
    max_width: int,
) -> None:
    """``out [T, N] +=`` each token's slot adapter applied to ``x [T, K]`` (the layout of
    ``tokenmill.ops.cpu.lora_apply``; rows may be strided, features contiguous);
    ``max_width``: the widest output slice. Accumulates in float32."""
    tokens, num_slices = x.shape[0], slice_ranks.shape[1]
    if tokens == 0:
        return
    grid = (tokens, num_slices, triton.cdiv(max_width, BLOCK_N))
    _lora_bgmv_kernel[grid](
        out,
        x,
        lora_a,
        lora_b,
        token_slots,
        slice_ranks,
        slice_offsets,
        x.shape[1],
        out.shape[1],
        num_slices,
        max_rank,
        out.stride(0),
        x.stride(0),
        BLOCK_R=max(16, triton.next_power_of_2(max_rank)),
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )


def lora_apply(layer: LoRAApply, x: torch.Tensor, out: torch.Tensor) -> None:
    """The CUDA platform's ``lora_apply``: the Triton kernel for CUDA 2-D ``x`` and ``out`` with
    contiguous features; ``forward_native`` for any other."""
    slots = layer.mapping.token_slots
    if slots is None:
        return
    if x.is_cuda and x.dim() == 2 and out.dim() == 2 and x.stride(1) == 1 and out.stride(1) == 1:
        lora_bgmv(
            out, x, layer.lora_a, layer.lora_b, slots, layer.slice_ranks, layer.slice_offsets,
            layer.max_rank, max(layer.output_slices),
        )
    else:
        layer.forward_native(x, out)
