"""The attention-backend interface: KV layout, metadata builder and kernel implementation."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tokenmill.interfaces.kv_cache_spec import KVCacheSpec


@dataclass(frozen=True)
class AttentionConfig:
    """What a backend must serve; handed to ``validate_configuration``."""

    head_size: int
    dtype: torch.dtype
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    use_mla: bool = False
    device_type: str = "cpu"
    sliding_window: int | None = None
    """Set when some layer attends only to the last ``sliding_window`` positions (itself
    included), as HF's Mistral and Qwen2 do."""


@dataclass
class CommonAttentionMetadata:
    """Backend-neutral description of one flattened batch, built by the model runner.

    Requests are laid out one after another: request ``i`` owns query tokens
    ``query_start_loc[i]:query_start_loc[i+1]``, which sit at positions
    ``num_computed_tokens[i] .. seq_lens[i]-1`` of its sequence.
    """

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on device
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor  # [num_reqs] int32: context length including this step's tokens
    seq_lens_cpu: torch.Tensor
    num_computed_tokens_cpu: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot of each new token
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int


class AttentionImpl(ABC):
    """One attention layer's kernel: writes new K/V into the paged cache and attends.

    With a ``sliding_window``, the query at position ``i`` attends to the keys at positions
    ``j`` with ``i - sliding_window < j <= i``; without one, to all ``j <= i``. Only backends
    whose ``supports_sliding_window`` is set are given one.

    ``k_scale`` and ``v_scale`` are the layer's FP8 KV-cache scales (``tokenmill.layers.kv_cache_quant``):
    a float8 cache stores ``key / k_scale`` and ``value / v_scale``. They are 1.0 unless the
    checkpoint sets them; only backends that list the float8 dtypes in
    ``supported_kv_cache_dtypes`` are given a float8 cache.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        **extra: Any,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.k_scale = 1.0
        self.v_scale = 1.0

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> torch.Tensor:
        """``query`` [T, num_heads, head_size], ``key``/``value`` [T, num_kv_heads, head_size];
        returns [T, num_heads, head_size]. ``attn_metadata`` is None during a dummy run."""


class AttentionMetadataBuilder(ABC):
    """Turns the runner's common metadata into the backend's own, once per step."""

    def __init__(self, kv_cache_spec: KVCacheSpec, device: torch.device) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.device = device

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> Any:
        """Return the metadata object every layer's ``AttentionImpl.forward`` receives."""


class AttentionBackend(ABC):
    """A registered attention backend. All methods are static/class methods.
    ``supported_kv_cache_dtypes`` lists the ``kv_cache_dtype`` values it serves."""

    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    supports_sliding_window: ClassVar[bool] = False

    @staticmethod
    @abstractmethod
    def get_name() -> str: ...

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's KV-cache tensor. Default: keys then values, each
        ``[num_blocks, block_size, num_kv_heads, head_size]``."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]: ...

    @staticmethod
    @abstractmethod
    def get_metadata_builder_cls() -> type[AttentionMetadataBuilder]: ...

    @classmethod
    def is_mla(cls) -> bool:
        return False

    @classmethod
    def validate_configuration(cls, config: AttentionConfig) -> list[str]:
        """Reasons this backend cannot serve ``config`` (empty: it can). The base checks MLA,
        the KV-cache dtype and sliding windows; subclasses extend the list."""
        reasons = []
        if config.use_mla and not cls.is_mla():
            reasons.append("MLA models need an MLA backend")
        if cls.is_mla() and not config.use_mla:
            reasons.append("serves MLA models only")
        if config.kv_cache_dtype not in cls.supported_kv_cache_dtypes:
            reasons.append(f"KV-cache dtype {config.kv_cache_dtype!r} is not supported")
        if config.sliding_window is not None and not cls.supports_sliding_window:
            reasons.append(
                f"sliding-window attention (window {config.sliding_window}) is not supported"
            )
        return reasons
