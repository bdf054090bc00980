"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of compressed latents."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.forward_context import get_forward_context
from tokenmill.interfaces.kv_cache_spec import KVCacheSpec, MLAAttentionSpec
from tokenmill.layers.build_context import current_build_context
from tokenmill.layers import kv_cache_quant as kv_quant
from tokenmill.layers.linear import LinearBase


class MLAAttention(nn.Module):
    """MLA: the cache holds one latent per token, ``kv_c`` (``kv_lora_rank`` values after
    ``kv_a_layernorm``) then the rotated ``k_pe`` (``qk_rope_head_dim``), shared by all heads.

    ``forward(q, kv_c_normed, k_pe)`` takes the flat query [T, heads*(nope+rope)] with RoPE
    already applied to its rope part, the normalised latent [T, kv_lora_rank] and the rotated
    shared key [T, rope]; it returns [T, heads*v_head_dim] (before ``o_proj``). The backend
    (an MLA backend: ``is_mla()``) decompresses keys and values through ``kv_b_proj``
    (rows: per head, ``qk_nope_head_dim`` key rows then ``v_head_dim`` value rows) for prefill
    chunks and folds it into the query and output for decode. ``head_size`` and
    ``num_kv_heads`` describe the cache (one latent "head"), as the model runner allocates it.
    """

    def __init__(
        self,
        num_heads: int,
        scale: float,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_lora_rank: int,
        kv_b_proj: LinearBase,
        prefix: str = "",
    ) -> None:
        super().__init__()
        ctx = current_build_context()
        self.backend = ctx.attention_backend(
            prefix, kv_lora_rank + qk_rope_head_dim, use_mla=True
        )
        if not self.backend.is_mla():
            raise ValueError(
                f"{prefix}: attention backend {self.backend.get_name()!r} is not an MLA backend"
            )
        self.layer_name = prefix
        self.num_heads = num_heads
        self.num_kv_heads = 1
        self.head_size = kv_lora_rank + qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.sliding_window = None
        self.impl = self.backend.get_impl_cls()(
            num_heads,
            self.head_size,
            scale,
            1,
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
            kv_b_proj=kv_b_proj,
        )
        self.kv_cache: torch.Tensor | None = None
        self.calculate_kv_scales = ctx.calculate_kv_scales
        """Set the FP8 latent scale from the first step's latents (then cleared)."""

    def forward(
        self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor
    ) -> torch.Tensor:
        metadata = get_forward_context().layer_metadata(self.layer_name)
        k_pe = k_pe.reshape(kv_c_normed.shape[0], -1)
        if self.calculate_kv_scales and metadata is not None:
            latents = torch.cat((kv_c_normed, k_pe), dim=-1)
            self.impl.k_scale = kv_quant.calculate_scale(latents, kv_quant.K_SCALE_RANGE)
            self.calculate_kv_scales = False
        out = self.impl.forward(
            q.view(-1, self.num_heads, self.qk_head_dim),
            kv_c_normed,
            k_pe,
            self.kv_cache,
            metadata,
        )
        return out.reshape(-1, self.num_heads * self.v_head_dim)

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return MLAAttentionSpec(block_size, dtype, self.head_size)

