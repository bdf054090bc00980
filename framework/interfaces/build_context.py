"""What a model is built with (:class:`BuildContext`): the value the model loader sets around a
model's construction (``tokenmill.layers.build_context``) and hands to a proposer's
``load_model``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tokenmill.interfaces.attention import AttentionBackend
from tokenmill.interfaces.quantization import QuantizationMethod


class BackendChooser(Protocol):
    """Chooses each attention layer's backend (the engine's ``AttentionSelector``)."""

    def __call__(
        self, layer_name: str, head_size: int, *, use_mla: bool = False, sliding_window: int | None = None
    ) -> type[AttentionBackend]: ...


@dataclass(frozen=True)
class BuildContext:
    """What layers need to know while a model is being constructed: the attention backend (or
    the selector that chooses one per layer), the dtype, the quantization method and the
    platform's op table. Handed to a proposer's ``load_model`` to build its own model alike."""

    attn_backend: type[AttentionBackend] | BackendChooser
    """One backend for every attention layer (hand-built models, tests), or the engine's
    selector, which chooses each layer's (see :meth:`attention_backend`)."""
    dtype: torch.dtype = torch.float32
    quant_method: QuantizationMethod | None = None
    ops: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    """The platform's op table (``Platform.get_ops()``): op name -> replacement forward."""
    calculate_kv_scales: bool = False
    """Attention layers set their FP8 KV-cache scales from their first step's keys and values."""
    enable_expert_parallel: bool = False
    """MoE layers shard their experts over the tensor-parallel ranks instead of slicing them."""

    def attention_backend(
        self,
        layer_name: str,
        head_size: int,
        *,
        use_mla: bool = False,
        sliding_window: int | None = None,
    ) -> type[AttentionBackend]:
        """The backend of attention layer ``layer_name``, which needs these: the one backend,
        or the selector's choice for them."""
        if isinstance(self.attn_backend, type):
            return self.attn_backend
        return self.attn_backend(
            layer_name, head_size, use_mla=use_mla, sliding_window=sliding_window
        )
