"""The quantization-method interface: how a linear layer creates, loads and applies weights,
and how a fused-MoE layer computes its experts."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

import torch
from torch import nn


class LinearMethod(ABC):
    """Creates a linear layer's parameters and computes ``x @ W.T (+ b)`` with them."""

    @abstractmethod
    def create_weights(
        self, layer: nn.Module, input_size: int, output_partition_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        """Register parameters on ``layer``. ``output_partition_sizes`` lists the (fused)
        output shards this rank holds; each parameter gets a ``weight_loader`` attribute when it
        needs a special one."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ...

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 (optional)
        """Repack weights once all are loaded (transpose, quantize, ...)."""

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The float weight ``[out, in]`` that ``apply`` multiplies by, after loading: the
        conformance kit checks ``apply`` against ``x @ dequantize(layer).T``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement dequantize")


class FusedMoEMethod(Protocol):
    """How a fused-MoE layer (``tokenmill.layers.fused_moe.FusedMoE``, stacked float weights
    ``w13_weight`` [E, 2I, H] and ``w2_weight`` [E, H, I] as loaded) computes its routed experts:
    ``UnquantizedFusedMoEMethod``, a platform's replacement, or a quantization method's."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack or quantize the layer's experts once the checkpoint is in."""

    def apply(
        self, layer: nn.Module, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts' weighted sum for each token of ``hidden_states`` [T, H]."""


class QuantizationMethod(ABC):
    """A registered quantization scheme, built from a checkpoint's ``quantization_config`` or
    the ``quantization=`` argument; registered under its name."""

    tensor_parallel: bool = True
    """Whether its layers load sharded over tensor-parallel ranks. The engine refuses
    ``tensor_parallel_size > 1``, when it resolves its configuration, for a method that does
    not (the instance ``from_config`` builds, so a method may decide per checkpoint)."""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationMethod:
        return cls()

    @classmethod
    def supported_act_dtypes(cls) -> list[torch.dtype]:
        """Activation dtypes it computes in; the engine refuses any other ``dtype``."""
        return [torch.float32, torch.float16, torch.bfloat16]

    @abstractmethod
    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        """The method for the linear layer at ``prefix``; None leaves it unquantized."""

    def get_lm_head_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        """The method for the LM head (a ``ParallelLMHead``), whose float ``weight`` the
        method's weights then replace; a tied head is then not tied, so the checkpoint must
        hold ``lm_head``'s tensors. None (the default) leaves the head unquantized."""
        return None

    def get_moe_method(self, layer: nn.Module, prefix: str) -> FusedMoEMethod | None:
        """The method for the fused-MoE layer at ``prefix``; None (the default): the method
        does not quantize experts, and the engine refuses the model."""
        return None
