"""The model interface."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class CausalLM(Protocol):
    """What a registered model class provides. Built as ``Cls(config, prefix="")`` where
    ``config`` is the checkpoint's transformers ``PretrainedConfig``; attention layers hold
    their KV caches and read the step's metadata from the forward context, never from
    arguments."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any: ...
