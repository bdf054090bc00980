"""A paged attention backend with a head-major KV layout, in plain PyTorch.

One layer's cache is ``[2, num_blocks, num_kv_heads, block_size, head_size]``: within a block,
each KV head's tokens are contiguous (vLLM's "HND"), unlike the built-in ``torch`` backend's
token-major ``[2, num_blocks, block_size, num_kv_heads, head_size]``. The core only counts
blocks and hands over slot mappings and block tables, so either layout serves the same engine.

New keys and values are written by slot mapping (``slot = block * block_size + offset``); each
request then reads its context back whole blocks at a time through its block table and attends
causally: query ``i`` of a chunk of ``q`` new tokens sees the cached prefix and the chunk up to
itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.interfaces import (
    AttentionBackend,
    AttentionConfig,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)


@dataclass
class RequestSpan:
    """One request's query rows, the blocks holding its context and its causal mask."""

    token_start: int
    token_end: int
    seq_len: int
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)] int64
    mask: torch.Tensor | None  # [query_len, seq_len] bool, True = attend; None for one token


@dataclass
class HeadMajorMetadata:
    block_ids: torch.Tensor  # [num_tokens] block of each new token
    block_offsets: torch.Tensor  # [num_tokens] offset of each new token in its block
    num_actual_tokens: int
    requests: list[RequestSpan]


class HeadMajorMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> HeadMajorMetadata:
        block_size = self.kv_cache_spec.block_size
        qsl = common.query_start_loc_cpu.tolist()
        seq_lens = common.seq_lens_cpu.tolist()
        requests = []
        for i in range(common.num_reqs):
            start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
            num_blocks = -(-seq_len // block_size)
            mask = None
            if end - start > 1:
                q_pos = torch.arange(seq_len - (end - start), seq_len, device=self.device)
                mask = torch.arange(seq_len, device=self.device)[None, :] <= q_pos[:, None]
            requests.append(
                RequestSpan(start, end, seq_len, common.block_table[i, :num_blocks].long(), mask)
            )
        slots = common.slot_mapping
        return HeadMajorMetadata(
            slots // block_size, slots % block_size, common.num_actual_tokens, requests
        )


class HeadMajorImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: HeadMajorMetadata | None,
    ) -> torch.Tensor:
        output = torch.zeros_like(query)
        if attn_metadata is None:
            return output
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        blocks, offsets = attn_metadata.block_ids, attn_metadata.block_offsets
        # Indices around a slice put the token dim first: [n, num_kv_heads, head_size].
        key_cache[blocks, :, offsets] = key[:n].to(key_cache.dtype)
        value_cache[blocks, :, offsets] = value[:n].to(value_cache.dtype)
        gqa = self.num_heads != self.num_kv_heads

        for req in attn_metadata.requests:
            q = query[req.token_start : req.token_end].transpose(0, 1)  # [H, Q, D]
            k = self._gather(key_cache, req).to(query.dtype)  # [KVH, S, D]
            v = self._gather(value_cache, req).to(query.dtype)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=req.mask, scale=self.scale, enable_gqa=gqa
            )
            output[req.token_start : req.token_end] = out.transpose(0, 1)
        return output

    def _gather(self, cache: torch.Tensor, req: RequestSpan) -> torch.Tensor:
        """The request's context, per KV head: [num_kv_heads, seq_len, head_size]."""
        blocks = cache[req.block_ids]  # [B, KVH, block_size, D]
        per_head = blocks.transpose(0, 1).reshape(self.num_kv_heads, -1, self.head_size)
        return per_head[:, : req.seq_len]


class HeadMajorBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "example-hnd"

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, num_kv_heads, block_size, head_size)

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return HeadMajorImpl

    @staticmethod
    def get_metadata_builder_cls() -> type[AttentionMetadataBuilder]:
        return HeadMajorMetadataBuilder

    @classmethod
    def validate_configuration(cls, config: AttentionConfig) -> list[str]:
        reasons = []
        if config.use_mla:
            reasons.append("MLA models need an MLA backend")
        if config.kv_cache_dtype != "auto":
            reasons.append(f"KV-cache dtype {config.kv_cache_dtype!r} is not supported")
        if config.sliding_window is not None:
            reasons.append("sliding-window attention is not implemented")
        return reasons
