"""Per-step state the model runner hands to attention layers without touching model code."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ForwardContext:
    """``attn_metadata`` is the backend's metadata for this step (None in a dummy run);
    ``kv_caches`` maps each attention layer's name to its KV-cache tensor."""

    attn_metadata: Any
    kv_caches: dict[str, torch.Tensor] = field(default_factory=dict)


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(
    attn_metadata: Any, kv_caches: dict[str, torch.Tensor]
) -> Iterator[ForwardContext]:
    global _current
    previous = _current
    _current = ForwardContext(attn_metadata, kv_caches)
    try:
        yield _current
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention layer called outside set_forward_context()")
    return _current
