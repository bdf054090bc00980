"""The attention layer models use; paging is the backend's business."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.forward_context import get_forward_context
from tokenmill.interfaces.kv_cache_spec import FullAttentionSpec, KVCacheSpec
from tokenmill.layers.build_context import current_build_context
from tokenmill.layers import kv_cache_quant as kv_quant


class Attention(nn.Module):
    """Multi-head / grouped-query attention over the paged KV cache.

    ``forward`` takes flat projections ``q`` [T, num_heads*head_size] and ``k``/``v``
    [T, num_kv_heads*head_size] for all scheduled tokens of all requests, writes K/V into this
    layer's cache and returns [T, num_heads*head_size]. ``prefix`` must be the layer's unique
    module path: it names the layer's KV cache and its backend's choice. ``kv_cache`` is that
    cache, bound by the model runner once when it allocates the caches (None before); the step's
    metadata comes from the forward context. With ``sliding_window``, each query attends only to
    the last ``sliding_window`` positions up to itself; a backend that cannot do that is an error
    here, never full attention in its place.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        prefix: str = "",
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        ctx = current_build_context()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        self.layer_name = prefix
        self.backend = ctx.attention_backend(prefix, head_size, sliding_window=sliding_window)
        self.sliding_window = sliding_window
        if sliding_window is not None and not self.backend.supports_sliding_window:
            raise ValueError(
                f"{prefix}: attention backend {self.backend.get_name()!r} does not support "
                f"sliding-window attention (window {sliding_window})"
            )
        self.impl = self.backend.get_impl_cls()(
            num_heads, head_size, scale, self.num_kv_heads, sliding_window=sliding_window
        )
        self.kv_cache: torch.Tensor | None = None
        self.calculate_kv_scales = ctx.calculate_kv_scales
        """Set the FP8 KV-cache scales from the first step's keys and values (then cleared)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        metadata = get_forward_context().layer_metadata(self.layer_name)
        if self.calculate_kv_scales and metadata is not None:
            self.impl.k_scale = kv_quant.calculate_scale(k, kv_quant.K_SCALE_RANGE)
            self.impl.v_scale = kv_quant.calculate_scale(v, kv_quant.V_SCALE_RANGE)
            self.calculate_kv_scales = False
        out = self.impl.forward(
            q.view(-1, self.num_heads, self.head_size),
            k.view(-1, self.num_kv_heads, self.head_size),
            v.view(-1, self.num_kv_heads, self.head_size),
            self.kv_cache,
            metadata,
        )
        return out.reshape(-1, self.num_heads * self.head_size)

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return FullAttentionSpec(block_size, dtype, self.num_kv_heads, self.head_size)
