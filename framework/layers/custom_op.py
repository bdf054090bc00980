"""Layers whose computation a platform may replace (a small version of vLLM's ``CustomOp``).

Each such layer names its op (``op_name``) and keeps a plain-torch ``forward_native``. When the
layer is built, the build context's op table (the platform's ``Platform.get_ops()``) decides its
forward once: the op registered under ``op_name`` if there is one, else ``forward_native``. An op
is called as ``op(layer, *args)`` with ``forward_native``'s contract, and may itself call
``layer.forward_native`` for inputs it does not take.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from torch import nn

from tokenmill.interfaces.platform import OP_NAMES
from tokenmill.layers.build_context import current_ops


class CustomOp(nn.Module):
    """Base of the layers a platform's op table can replace."""

    op_name: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.op_name not in OP_NAMES:
            raise TypeError(f"{cls.__name__}.op_name {cls.op_name!r} is not one of {OP_NAMES}")

    def __init__(self) -> None:
        super().__init__()
        self._forward_method: Callable[..., Any] = current_ops().get(
            self.op_name, type(self).forward_native
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_method(self, *args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        """The computation in plain torch, on any device and dtype."""
        raise NotImplementedError
