"""Reference attention backend in plain PyTorch; runs anywhere torch runs.

KV layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (keys, values).
New K/V are scattered into the cache by slot mapping; every request then attends over its whole
context gathered back through its block table. Single-token (decode) requests are batched into
one padded SDPA call (padding re-reads the request's own first slot, which is always written,
so an uninitialised cache is never read); multi-token chunks run one SDPA call each with a causal mask offset by the
cached prefix. A layer with a sliding window masks out keys that fell out of it (the whole context
is still gathered: this backend is the reference, not the fast path). An FP8 cache is quantized
on write and read back as the query's dtype (``tokenmill.layers.kv_cache_quant``).
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
from tokenmill.layers import kv_cache_quant as kv_quant
from tokenmill.kv_cache_dtype import KV_CACHE_DTYPES


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


def token_major_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """SDPA on token-major tensors: ``q`` [Q, H, D] over ``k`` [S, KVH, D] and ``v``
    [S, KVH, Dv] (each KV head shared by ``H / KVH`` query heads) with ``mask`` [Q, S]:
    [Q, H, Dv]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1)


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
    """Writes the step's K/V, attends the decode rows in one batch and each multi-token chunk
    on its own. The MLA reference keeps this plan and changes what each part does."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TorchRefMetadata | None,
    ) -> torch.Tensor:
        output = self.new_output(query)
        if attn_metadata is None:
            return output
        md = attn_metadata
        cache = self.write(key, value, kv_cache, md.slot_mapping)
        if md.decode_token_idx is not None:
            rows = md.decode_token_idx
            output[rows] = self.decode(query[rows], cache, md)
        for chunk in md.chunks:
            s, e = chunk.token_start, chunk.token_end
            output[s:e] = self.attend_chunk(query[s:e], cache, chunk)
        return output

    def new_output(self, query: torch.Tensor) -> torch.Tensor:
        """The zeroed output for ``query``'s rows."""
        return torch.zeros_like(query)

    def write(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scatter the first ``len(slots)`` tokens' K/V into the cache; returns the key and
        value caches as flat [num_slots, kv_heads, head_size] rows."""
        key_cache = kv_cache[0].view(-1, self.num_kv_heads, self.head_size)
        value_cache = kv_cache[1].view(-1, self.num_kv_heads, self.head_size)
        n = slots.shape[0]
        kv_quant.write(key_cache, slots, key[:n], self.k_scale)
        kv_quant.write(value_cache, slots, value[:n], self.v_scale)
        return key_cache, value_cache

    def read(
        self, cache: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached keys and values at ``slots`` as ``dtype``."""
        key_cache, value_cache = cache
        return (
            kv_quant.read(key_cache[slots], self.k_scale, dtype),
            kv_quant.read(value_cache[slots], self.v_scale, dtype),
        )

    def decode(
        self, q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], md: TorchRefMetadata
    ) -> torch.Tensor:
        """The decode rows' outputs [B, H, head_size]."""
        assert md.decode_slots is not None and md.decode_pos is not None
        k, v = self.read(cache, md.decode_slots, q.dtype)  # [B, S, KVH, D]
        k_pos = torch.arange(k.shape[1], device=q.device)
        mask = causal_mask(md.decode_pos, k_pos, self.sliding_window)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out.squeeze(2)

    def attend_chunk(
        self, q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], chunk: ChunkInfo
    ) -> torch.Tensor:
        """One multi-token chunk's outputs [Q, H, head_size]."""
        k, v = self.read(cache, chunk.slots, q.dtype)  # [S, KVH, D]
        k_pos = torch.arange(k.shape[0], device=q.device)
        mask = causal_mask(chunk.q_pos, k_pos, self.sliding_window)
        return token_major_attention(q, k, v, mask, self.scale)


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
