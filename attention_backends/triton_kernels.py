"""Triton kernels for paged attention: the KV-cache write and one unified attention kernel.

Both address the cache through strides, so any layout whose key and value caches index as
``[block, slot_in_block, kv_head, dim]`` with a contiguous last dimension works (the reference
layout ``kv_cache[0]``/``kv_cache[1]`` and FlashInfer's ``kv_cache[:, 0]``/``kv_cache[:, 1]``).

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernels run on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
KV_TILE = 32
"""Keys per inner-loop step: K and V tiles stay small enough for every GPU's shared memory."""


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    d = tl.arange(0, HEAD_SIZE_P2)
    mask = d < HEAD_SIZE
    k = tl.load(key_ptr + token * stride_k_t + head * stride_k_h + d, mask=mask)
    v = tl.load(value_ptr + token * stride_v_t + head * stride_v_h + d, mask=mask)
    kc = key_cache_ptr + block * stride_kc_b + offset * stride_kc_s + head * stride_kc_h + d
    vc = value_cache_ptr + block * stride_vc_b + offset * stride_vc_s + head * stride_vc_h + d
    tl.store(kc, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` [T, kv_heads, head_size] into the caches
    [num_blocks, block_size, kv_heads, head_size] at flat slots ``slot_mapping`` [T];
    negative slots (padding) are skipped."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        HEAD_SIZE=head_size,
        HEAD_SIZE_P2=triton.next_power_of_2(head_size),
        BLOCK_SIZE=key_cache.shape[1],
    )


@triton.jit
def _unified_attention_kernel(
    out_ptr,
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    qk_scale,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    stride_bt,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_QUERIES_PER_KV: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program: ``BLOCK_Q`` query tokens of one request times the ``NUM_QUERIES_PER_KV``
    query heads sharing one KV head (``BLOCK_M`` rows), streamed over that request's keys in
    tiles of ``BLOCK_N`` with an online softmax (exp2 domain; ``qk_scale`` includes log2 e).
    float32 inputs use exact ("ieee") dots rather than TF32."""
    req = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    tile_start = q_tile * BLOCK_Q
    if tile_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    q_tok = tile_start + offs_m // NUM_QUERIES_PER_KV
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    row_valid = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_tok < q_len)
    offs_d = tl.arange(0, HEAD_SIZE_P2)
    d_valid = offs_d < HEAD_SIZE
    token = (q_start + q_tok).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    q_pos = context_len + q_tok

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_P2], dtype=tl.float32)
    kv_end = tl.minimum(seq_len, context_len + tl.minimum(tile_start + BLOCK_Q, q_len))
    block_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < kv_end
        block = tl.load(block_row + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        k = tl.load(
            key_cache_ptr
            + block[None, :] * stride_kc_b
            + in_block[None, :] * stride_kc_s
            + kv_head * stride_kc_h
            + offs_d[:, None],
            mask=d_valid[:, None] & n_valid[None, :],
            other=0.0,
        )
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        visible = row_valid[:, None] & n_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            value_cache_ptr
            + block[:, None] * stride_vc_b
            + in_block[:, None] * stride_vc_s
            + kv_head * stride_vc_h
            + offs_d[None, :],
            mask=n_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_valid[None, :],
    )


def unified_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_reqs: int,
    max_query_len: int,
    scale: float,
) -> None:
    """Paged attention for a mixed batch of prefill chunks and decode tokens.

    ``query``/``out`` [T, heads, head_size]; request ``i`` owns query rows
    ``query_start_loc[i]:query_start_loc[i+1]``, the last ones of its ``seq_lens[i]`` positions,
    and attends causally to its cached prefix and its own earlier rows through ``block_table``.
    A request with ``seq_lens[i] == 0`` (CUDA-graph padding) gets zeros.
    The launch grid depends only on ``num_reqs``, ``max_query_len`` and the head counts, so a
    decode-only launch can be captured in a CUDA graph and replayed with new lengths."""
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    queries_per_kv = num_heads // num_kv_heads
    head_size_p2 = max(16, triton.next_power_of_2(head_size))
    wide_heads = head_size_p2 > 128
    min_rows = 16 if max_query_len == 1 else (32 if wide_heads else 64)
    block_m = max(min_rows, triton.next_power_of_2(queries_per_kv))
    block_q = block_m // queries_per_kv
    grid = (num_reqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _unified_attention_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_table.stride(0),
        HEAD_SIZE=head_size,
        HEAD_SIZE_P2=head_size_p2,
        BLOCK_SIZE=key_cache.shape[1],
        NUM_QUERIES_PER_KV=queries_per_kv,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=KV_TILE,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
        num_stages=2 if wide_heads else 3,
    )
