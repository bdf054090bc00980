"""Triton MLA decode kernel: absorbed queries attend over paged latents.

Each program takes one decode request and ``BLOCK_H`` heads, streams the request's latents
(rows of ``[kv_c, k_pe]`` at the flat cache slots given per position) in tiles of ``BLOCK_N``
with an online softmax, and writes the attended latent ``o_lat`` [B, H, kv_lora_rank]; the
caller folds ``W_UV`` in afterwards. The latent and rope parts load separately, so
``kv_lora_rank`` and ``qk_rope_head_dim`` each pad to their own power of two.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernel runs on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _mla_decode_kernel(
    out_ptr,
    q_ptr,
    cache_ptr,
    slots_ptr,
    seq_lens_ptr,
    qk_scale,
    num_heads,
    stride_q_b,
    stride_q_h,
    stride_o_b,
    stride_o_h,
    stride_c_row,
    stride_slots_b,
    KV_LORA: tl.constexpr,
    KV_LORA_P2: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_P2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_valid = head < num_heads
    seq_len = tl.load(seq_lens_ptr + req)
    offs_l = tl.arange(0, KV_LORA_P2)
    offs_r = tl.arange(0, ROPE_P2)
    l_valid = offs_l < KV_LORA
    r_valid = offs_r < ROPE
    q_row = q_ptr + req * stride_q_b + head[:, None] * stride_q_h
    q_lat = tl.load(q_row + offs_l[None, :], mask=h_valid[:, None] & l_valid[None, :], other=0.0)
    q_pe = tl.load(
        q_row + KV_LORA + offs_r[None, :], mask=h_valid[:, None] & r_valid[None, :], other=0.0
    )

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, KV_LORA_P2], dtype=tl.float32)
    for start_n in range(0, seq_len, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < seq_len
        slot = tl.load(slots_ptr + req * stride_slots_b + offs_n, mask=n_valid, other=0)
        row = cache_ptr + slot.to(tl.int64) * stride_c_row
        kv = tl.load(
            row[:, None] + offs_l[None, :], mask=n_valid[:, None] & l_valid[None, :], other=0.0
        )
        k_pe = tl.load(
            row[:, None] + KV_LORA + offs_r[None, :],
            mask=n_valid[:, None] & r_valid[None, :],
            other=0.0,
        )
        s = tl.dot(q_lat, tl.trans(kv), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        s = tl.where(n_valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + req * stride_o_b + head[:, None] * stride_o_h + offs_l[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=h_valid[:, None] & l_valid[None, :],
    )


def mla_decode(
    q_cat: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    """Absorbed decode attention: ``q_cat`` [B, H, L+R] (``q_nope·W_UK`` then ``q_pe``) over the
    latents of ``cache`` [num_slots, L+R] at ``slots`` [B, max_len] (request ``b`` uses its
    first ``seq_lens[b]``). Returns the attended latents [B, H, L]."""
    batch, num_heads, width = q_cat.shape
    rope = width - kv_lora_rank
    out = q_cat.new_empty(batch, num_heads, kv_lora_rank)
    block_h = 16
    grid = (batch, triton.cdiv(num_heads, block_h))
    _mla_decode_kernel[grid](
        out,
        q_cat,
        cache,
        slots,
        seq_lens,
        scale * LOG2E,
        num_heads,
        q_cat.stride(0),
        q_cat.stride(1),
        out.stride(0),
        out.stride(1),
        cache.stride(0),
        slots.stride(0),
        KV_LORA=kv_lora_rank,
        KV_LORA_P2=max(16, triton.next_power_of_2(kv_lora_rank)),
        ROPE=rope,
        ROPE_P2=max(16, triton.next_power_of_2(rope)),
        BLOCK_H=block_h,
        BLOCK_N=16 if kv_lora_rank > 256 else 32,
        DOT_PRECISION="ieee" if q_cat.dtype == torch.float32 else None,
    )
    return out
