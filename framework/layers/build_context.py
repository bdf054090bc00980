"""The :class:`~tokenmill.interfaces.build_context.BuildContext` of the model being built: the
model loader sets it around construction; layers read it. Model code stays free of engine
configuration."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from tokenmill.interfaces.build_context import BuildContext


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
