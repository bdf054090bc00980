"""What layers need to know while a model is being constructed: the attention backend (or the
selector that chooses one per layer), the quantization method, the platform's op table and the
tensor-parallel group. The model loader sets it; model code stays free of engine
configuration."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
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


_current: ContextVar[BuildContext | None] = ContextVar("tokenmill_build_context", default=None)
"""The context of the model being built, per thread (and asyncio task), like the forward
context: engines building models in other threads never see it."""


@contextmanager
def model_build_context(ctx: BuildContext) -> Iterator[BuildContext]:
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def current_build_context() -> BuildContext:
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError(
            "tokenmill layers must be built inside model_build_context() "
            "(the model loader sets it up)"
        )
    return ctx


def current_ops() -> Mapping[str, Callable[..., Any]]:
    """The op table of the model being built; empty outside :func:`model_build_context`, so a
    layer built by hand computes with its ``forward_native``."""
    ctx = _current.get()
    return ctx.ops if ctx is not None else {}
