"""Per-step state the model runner hands to attention layers without touching model code.

The current context is a ``ContextVar``: each thread (and each asyncio task) sees only the
context it set, so engines stepping in one process — a target and a draft model, or
``AsyncLLM``'s engine thread next to another engine — never see each other's metadata. KV
caches are not part of it: each ``Attention`` layer holds its own, bound once when the cache is
allocated.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardContext:
    """``attn_metadata`` is this step's attention metadata: one object every layer reads, or,
    from the model runner, a dict from layer name to the metadata of that layer's backend
    (layers of different backends get different objects). None in a dummy run."""

    attn_metadata: Any

    def layer_metadata(self, layer_name: str) -> Any:
        """The metadata of attention layer ``layer_name``."""
        if isinstance(self.attn_metadata, dict):
            return self.attn_metadata[layer_name]
        return self.attn_metadata


_forward_context: ContextVar[ForwardContext | None] = ContextVar(
    "tokenmill_forward_context", default=None
)


@contextmanager
def set_forward_context(attn_metadata: Any) -> Iterator[ForwardContext]:
    """Make ``attn_metadata`` the current step's for the body, in this thread or task only."""
    ctx = ForwardContext(attn_metadata)
    token = _forward_context.set(ctx)
    try:
        yield ctx
    finally:
        _forward_context.reset(token)


def get_forward_context() -> ForwardContext:
    """The context of the step running in this thread or task."""
    ctx = _forward_context.get()
    if ctx is None:
        raise RuntimeError("attention layer called outside set_forward_context()")
    return ctx
