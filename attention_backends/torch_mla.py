"""Reference MLA backend in plain PyTorch over a paged latent cache.

KV layout per layer: ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``, one latent
per token (``kv_c`` then ``k_pe``). Each step scatters the new tokens' latents by slot mapping,
then:

* multi-token chunks (prefill, chunked prefill, prefix-cache hits) gather their whole context's
  latents, decompress keys and values through ``kv_b_proj`` and attend causally;
* single-token decodes use the absorbed form: ``W_UK`` folds into the query
  (``q_nope·W_UK`` is a query in latent space), attention runs over the cached latents
  directly, and ``W_UV`` turns the attended latent into the heads' values. The history is never
  decompressed.

The metadata is the torch reference backend's (decode rows and padded slots, chunk slots). An
FP8 cache stores ``latent / k_scale`` (one scale for the whole latent, as vLLM's) and the reads
multiply back (``tokenmill.layers.kv_cache_quant``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tokenmill.attention_backends.torch_ref import (
    ChunkInfo,
    TorchRefImpl,
    TorchRefMetadata,
    TorchRefMetadataBuilder,
    causal_mask,
)
from tokenmill.interfaces.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
)
from tokenmill.layers import kv_cache_quant as kv_quant
from tokenmill.layers.linear import float_weight
from tokenmill.kv_cache_dtype import KV_CACHE_DTYPES


class TorchMLAImpl(TorchRefImpl):
    """One MLA layer's kernels. ``forward(q, kv_c_normed, k_pe, kv_cache, metadata)``: ``q``
    [T, H, nope+rope] (rope part rotated), ``kv_c_normed`` [T, kv_lora_rank], ``k_pe``
    [T, rope]; returns [T, H, v_head_dim]. The positional arguments are
    :class:`AttentionImpl`'s; the keywords describe the latent and ``kv_b_proj``."""

    def __init__(
        self,
        *args: Any,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_b_proj: torch.nn.Module,
        **extra: Any,
    ) -> None:
        super().__init__(*args, **extra)
        if self.sliding_window is not None:
            raise ValueError("MLA attention has no sliding window")
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_b_proj = kv_b_proj

    def kv_b_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(W_UK [H, nope, L], W_UV [H, v, L])`` of ``kv_b_proj``'s float weight."""
        w = float_weight(self.kv_b_proj).view(
            self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank
        )
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def new_output(self, query: torch.Tensor) -> torch.Tensor:
        return query.new_zeros(query.shape[0], self.num_heads, self.v_head_dim)

    def write(
        self, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """Scatter ``[kv_c, k_pe]`` of the first ``len(slots)`` tokens into the cache; returns
        the cache as flat [num_slots, L+R] rows."""
        cache = kv_cache.view(-1, self.head_size)
        n = slots.shape[0]
        kv_quant.write(cache, slots, torch.cat((kv_c[:n], k_pe[:n]), dim=-1), self.k_scale)
        return cache

    def read(self, cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The cached latents at ``slots`` as ``dtype``."""
        return kv_quant.read(cache[slots], self.k_scale, dtype)

    def decompress(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of latents [S, L+R] through ``kv_b_proj``, both [S, H, nope+rope]:
        the values zero-padded from ``v_head_dim`` to the keys' size, since PyTorch's fused CPU
        attention kernel runs 2-3x slower when the value head size differs from the query's
        (256 tokens, 16 heads, 96 vs 64)."""
        num_ctx = latents.shape[0]
        kv = self.kv_b_proj(latents[:, : self.kv_lora_rank]).view(
            num_ctx, self.num_heads, self.qk_nope_head_dim + self.v_head_dim
        )
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_pe = latents[:, None, self.kv_lora_rank :].expand(-1, self.num_heads, -1)
        k = torch.cat((k_nope, k_pe), dim=-1)
        return k, F.pad(v, (0, k.shape[-1] - self.v_head_dim))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Queries ``q`` [Q, H, nope+rope] over keys and (padded) values from
        :meth:`decompress` [S, H, nope+rope], with ``mask`` [Q, S], or plain causal attention
        (Q == S) when ``mask`` is None: [Q, H, v]. SDPA gets 4-D inputs (its fused kernel)."""
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
        )
        return out[0, ..., : self.v_head_dim].transpose(0, 1)

    def attend_decompressed(
        self, q: torch.Tensor, latents: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Queries ``q`` [Q, H, nope+rope] over context latents [S, L+R] with ``mask`` [Q, S],
        keys and values decompressed through ``kv_b_proj``: [Q, H, v]."""
        return self.attend(q, *self.decompress(latents), mask)

    def absorb_query(self, q: torch.Tensor) -> torch.Tensor:
        """[B, H, nope+rope] -> [B, H, L+R]: ``q_nope·W_UK`` then the rope part."""
        w_uk, _ = self.kv_b_weights()
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        return torch.cat((q_lat, q_pe), dim=-1)

    def absorb_output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """[B, H, L] attended latents -> [B, H, v] through ``W_UV``."""
        _, w_uv = self.kv_b_weights()
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def attend_absorbed(
        self, q: torch.Tensor, latents: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Single queries ``q`` [B, H, nope+rope] over per-request latents [B, S, L+R] with
        ``mask`` [B, S], in latent space: [B, H, v]. All heads share the latents, so scores and
        the attended latent are two batched GEMMs with the heads as rows (on the CPU about 15×
        faster than SDPA broadcasting one KV head to all query heads)."""
        scores = torch.bmm(self.absorb_query(q), latents.transpose(1, 2)).mul_(self.scale)
        scores.masked_fill_(~mask.unsqueeze(1), float("-inf"))
        o_lat = torch.bmm(scores.softmax(dim=-1), latents[..., : self.kv_lora_rank])
        return self.absorb_output(o_lat)

    def decode(
        self, q: torch.Tensor, cache: torch.Tensor, md: TorchRefMetadata
    ) -> torch.Tensor:
        """The decode rows' outputs [B, H, v]."""
        assert md.decode_slots is not None and md.decode_pos is not None
        k_pos = torch.arange(md.decode_slots.shape[1], device=q.device)
        mask = causal_mask(md.decode_pos, k_pos, None)
        return self.attend_absorbed(q, self.read(cache, md.decode_slots, q.dtype), mask)

    def attend_chunk(self, q: torch.Tensor, cache: torch.Tensor, chunk: ChunkInfo) -> torch.Tensor:
        """One multi-token chunk's outputs [Q, H, v], decompressed."""
        k_pos = torch.arange(chunk.slots.shape[0], device=q.device)
        mask = causal_mask(chunk.q_pos, k_pos, None)
        return self.attend_decompressed(q, self.read(cache, chunk.slots, q.dtype), mask)


class TorchMLABackend(AttentionBackend):
    """The reference MLA backend: runs on any device torch runs on."""

    supported_kv_cache_dtypes = tuple(KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return "torch_mla"

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """One latent row per token: ``[num_blocks, block_size, kv_lora_rank + rope_dim]``."""
        return (num_blocks, block_size, head_size)

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchMLAImpl

    @staticmethod
    def get_metadata_builder_cls() -> type[AttentionMetadataBuilder]:
        return TorchRefMetadataBuilder

    @classmethod
    def is_mla(cls) -> bool:
        return True
