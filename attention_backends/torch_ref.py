"""Reference attention backend in plain PyTorch; runs anywhere torch runs.

KV layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (keys, values).
New K/V are scattered into the cache by slot mapping; every request then attends over its whole
context gathered back through its block table. Single-token (decode) requests are batched into
one padded SDPA call (padding re-reads the request's own first slot, which is always written,
so an uninitialised cache is never read); multi-token chunks run one SDPA call each with a causal mask offset by the
cached prefix. A layer with a sliding window masks out keys that fell out of it (the whole context
is still gathered: this backend is the reference, not the fast path). An FP8 cache is quantized
on write and read back as the query's dtype (``tokenmill.quant.kv_cache``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.interfaces.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from tokenmill.quant import kv_cache as kv_quant
from tokenmill.quant.kv_cache import KV_CACHE_DTYPES


def causal_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """[len(q_pos), len(k_pos)] bool, True where the query at position ``q`` attends the key at
    position ``k``: ``k <= q``, and with a window also ``q - k < sliding_window`` (HF's)."""
    distance = q_pos[:, None] - k_pos[None, :]
    mask = distance >= 0
    if sliding_window is not None:
        mask &= distance < sliding_window
    return mask


@dataclass
class ChunkInfo:
    """One multi-token request: its query rows and positions and its context slots."""

    token_start: int
    token_end: int
    slots: torch.Tensor  # [seq_len] flat cache slots of positions 0..seq_len-1
    q_pos: torch.Tensor  # [query_len] positions of the query tokens


@dataclass
class TorchRefMetadata:
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    decode_token_idx: torch.Tensor | None  # [num_decodes] rows of single-token requests
    decode_slots: torch.Tensor | None  # [num_decodes, max_len]
    decode_pos: torch.Tensor | None  # [num_decodes] position of each decode token
    chunks: list[ChunkInfo]


def _context_slots(block_row: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(seq_len, device=block_row.device)
    return block_row[pos // block_size].long() * block_size + pos % block_size


class TorchRefMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> TorchRefMetadata:
        qsl = common.query_start_loc_cpu.tolist()
        seq_lens = common.seq_lens_cpu.tolist()
        bs = self.kv_cache_spec.block_size
        decodes: list[int] = []
        chunks: list[ChunkInfo] = []
        for i in range(common.num_reqs):
            start, end = qsl[i], qsl[i + 1]
            if end - start == 1:
                decodes.append(i)
                continue
            seq_len = seq_lens[i]
            chunks.append(
                ChunkInfo(
                    start,
                    end,
                    _context_slots(common.block_table[i], seq_len, bs),
                    torch.arange(seq_len - (end - start), seq_len, device=self.device),
                )
            )
        decode_token_idx = decode_slots = decode_pos = None
        if decodes:
            rows = torch.tensor(decodes, device=self.device)
            lens = common.seq_lens[rows].long()
            max_len = int(lens.max())
            pos = torch.arange(max_len, device=self.device)
            blocks = common.block_table[rows][:, pos // bs].long()
            decode_slots = blocks * bs + pos % bs
            valid = pos[None, :] < lens[:, None]
            decode_slots = torch.where(valid, decode_slots, decode_slots[:, :1])
            decode_pos = lens - 1
            decode_token_idx = common.query_start_loc[rows].long()
        return TorchRefMetadata(
            common.slot_mapping,
            common.num_actual_tokens,
            decode_token_idx,
            decode_slots,
            decode_pos,
            chunks,
        )


class TorchRefImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TorchRefMetadata | None,
    ) -> torch.Tensor:
        output = torch.zeros_like(query)
        if attn_metadata is None:
            return output
        n = attn_metadata.num_actual_tokens
        key_cache = kv_cache[0].view(-1, self.num_kv_heads, self.head_size)
        value_cache = kv_cache[1].view(-1, self.num_kv_heads, self.head_size)
        kv_quant.write(key_cache, attn_metadata.slot_mapping, key[:n], self.k_scale)
        kv_quant.write(value_cache, attn_metadata.slot_mapping, value[:n], self.v_scale)
        gqa = self.num_heads != self.num_kv_heads

        if attn_metadata.decode_token_idx is not None:
            rows = attn_metadata.decode_token_idx
            q = query[rows].unsqueeze(2)  # [B, H, 1, D]
            slots = attn_metadata.decode_slots
            k = kv_quant.read(key_cache[slots], self.k_scale, query.dtype).transpose(1, 2)
            v = kv_quant.read(value_cache[slots], self.v_scale, query.dtype).transpose(1, 2)
            k_pos = torch.arange(k.shape[2], device=query.device)
            mask = causal_mask(attn_metadata.decode_pos, k_pos, self.sliding_window)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask[:, None, None, :], scale=self.scale, enable_gqa=gqa
            )
            output[rows] = out.squeeze(2)

        for chunk in attn_metadata.chunks:
            q = query[chunk.token_start : chunk.token_end].transpose(0, 1)  # [H, Q, D]
            k = kv_quant.read(key_cache[chunk.slots], self.k_scale, query.dtype).transpose(0, 1)
            v = kv_quant.read(value_cache[chunk.slots], self.v_scale, query.dtype).transpose(0, 1)
            k_pos = torch.arange(k.shape[1], device=query.device)
            mask = causal_mask(chunk.q_pos, k_pos, self.sliding_window)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa
            )
            output[chunk.token_start : chunk.token_end] = out.transpose(0, 1)
        return output


class TorchRefBackend(AttentionBackend):
    supports_sliding_window = True
    supported_kv_cache_dtypes = tuple(KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return "torch"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchRefImpl

    @staticmethod
    def get_metadata_builder_cls() -> type[AttentionMetadataBuilder]:
        return TorchRefMetadataBuilder
