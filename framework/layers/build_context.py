"""What layers need to know while a model is being constructed: the attention backend (or the
selector that chooses one per layer), the quantization method, the platform's op table and the
tensor-parallel group. The model loader sets it; model code stays free of engine
configuration."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.interfaces.attention import AttentionBackend
from tokenmill.interfaces.quantization import QuantizationMethod

if TYPE_CHECKING:
    from tokenmill.selector import AttentionSelector


@dataclass(frozen=True)
class BuildContext:
    attn_backend: type[AttentionBackend] | AttentionSelector
    """One backend for every attention layer (hand-built models, tests), or the engine's
    selector, which chooses each layer's (see :meth:`attention_backend`)."""
    dtype: torch.dtype = torch.float32
    quant_method: QuantizationMethod | None = None
    ops: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    """The platform's op table (``Platform.get_ops()``): op name -> replacement forward."""
    calculate_kv_scales: bool = False
    """Attention layers set their FP8 KV-cache scales from their first step's keys and values."""

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


_current: BuildContext | None = None


@contextmanager
def model_build_context(ctx: BuildContext) -> Iterator[BuildContext]:
    global _current
    previous = _current
    _current = ctx
    try:
        yield ctx
    finally:
        _current = previous


def current_build_context() -> BuildContext:
    if _current is None:
        raise RuntimeError(
            "tokenmill layers must be built inside model_build_context() "
            "(the model loader sets it up)"
        )
    return _current


def current_ops() -> Mapping[str, Callable[..., Any]]:
    """The op table of the model being built; empty outside :func:`model_build_context`, so a
    layer built by hand computes with its ``forward_native``."""
    return _current.ops if _current is not None else {}
