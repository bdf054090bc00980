"""The model interface and the registry of architectures."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch

from tokenmill import plugins


@runtime_checkable
class CausalLM(Protocol):
    """What a registered model class provides. Built as ``Cls(config, prefix="")`` where
    ``config`` is the checkpoint's transformers ``PretrainedConfig``; attention layers hold
    their KV caches and read the step's metadata from the forward context, never from
    arguments."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any: ...


class ModelRegistry:
    """Architecture name -> lazily imported model class, filled by ``register_models`` hooks."""

    @staticmethod
    def register_model(arch: str, target: str | type) -> None:
        """vLLM's spelling of ``tokenmill.plugins.register_model``."""
        plugins.register_model(arch, target)

    @staticmethod
    def supported_archs() -> list[str]:
        return plugins.get_registry("models").names()

    @staticmethod
    def resolve(architectures: list[str] | None) -> tuple[type, str]:
        """The first registered class among ``architectures`` and its name."""
        registry = plugins.get_registry("models")
        for arch in architectures or []:
            if arch in registry:
                return registry.choose(arch), arch
        raise ValueError(
            f"model architectures {architectures} are not supported; "
            f"registered: {', '.join(registry.names()) or 'none'}{registry.filter_suffix()}"
        )
