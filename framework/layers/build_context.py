"""What layers need to know while a model is being constructed: the chosen attention backend,
the quantization method, the platform's op table and the tensor-parallel group. The model loader
sets it; model code stays free of engine configuration."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.interfaces.attention import AttentionBackend
from tokenmill.interfaces.quantization import QuantizationMethod


@dataclass(frozen=True)
class BuildContext:
    attn_backend: type[AttentionBackend]
    dtype: torch.dtype = torch.float32
    quant_method: QuantizationMethod | None = None
    kv_cache_dtype: str = "auto"
    ops: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    """The platform's op table (``Platform.get_ops()``): op name -> replacement forward."""


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
