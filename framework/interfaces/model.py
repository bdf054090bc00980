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


@runtime_checkable
class SupportsEagle3(Protocol):
    """A model an EAGLE-3 head can draft for: it returns, besides its hidden states, the
    residual streams entering the layers it is asked for."""

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        """From now on ``forward`` returns ``(hidden_states, aux)``, ``aux`` ``[T, n·hidden]``
        the residual streams entering ``layers``."""

    def get_eagle3_aux_hidden_state_layers(self) -> tuple[int, ...]:
        """The layers EAGLE-3 reads (a low, a middle and a high one)."""


@runtime_checkable
class SupportsMTP(Protocol):
    """A model whose checkpoint carries multi-token-prediction layers (DeepSeek-V3's)."""

    def mtp_config(self) -> Any:
        """The HF config of its MTP module, a registered architecture loaded from the same
        checkpoint; raises ``ValueError`` when the checkpoint has no MTP layers."""
