"""Per-layer KV-cache specs: how many bytes one block of one layer takes."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """What one layer's KV cache holds per block; a metadata builder is built with its
    layers' spec."""

    block_size: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Keys and values for every KV head: ``2 × heads × head_size`` per token."""

    num_kv_heads: int
    head_size: int

    @property
    def page_size_bytes(self) -> int:
        item: int = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * item


@dataclass(frozen=True)
class MLAAttentionSpec(KVCacheSpec):
    """One compressed latent per token (``kv_lora_rank + rope_dim``), shared by all heads."""

    head_size: int

    @property
    def page_size_bytes(self) -> int:
        item: int = torch.empty((), dtype=self.dtype).element_size()
        return self.block_size * self.head_size * item
