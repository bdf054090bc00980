"""What the weight-quantized linear methods share: the dispatch between the CPU kernels and
torch's dequantize-then-matmul, and online quantization of a float checkpoint after loading."""

from __future__ import annotations

from abc import abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.interfaces.quantization import LinearMethod
from tokenmill.layers.linear import UnquantizedLinearMethod
from tokenmill.ops import cpu as cpu_ops


def replace_parameters(layer: nn.Module, old: list[str], new: dict[str, torch.Tensor]) -> None:
    """Drop ``layer``'s parameters ``old`` and register ``new`` (frozen) in their place."""
    for name in old:
        delattr(layer, name)
    for name, tensor in new.items():
        layer.register_parameter(name, nn.Parameter(tensor.contiguous(), requires_grad=False))


_workspace = torch.empty(0)


def workspace(n: int, k: int) -> torch.Tensor:
    """A float32 [n, k] scratch tensor shared by all layers of the process (each dequantized
    weight lives only until its GEMM returns), so large batches do not fault in fresh pages
    every call. Model forwards in one process run one at a time, as the engine core runs them."""
    global _workspace
    if _workspace.numel() < n * k:
        _workspace = torch.empty(n * k)
    return _workspace[: n * k].view(n, k)


class QuantizedLinearMethod(LinearMethod):
    """``apply``: float32 CPU inputs go to the method's C kernel (``cpu_apply``); from
    ``gemm_rows`` input rows on (prefill, large batches) the kernel instead dequantizes the
    weight once for a float GEMM (``cpu_dequantize``), which beats re-reading the packed weight
    per row block there; any other input (another device or dtype, no kernels) computes
    ``x @ dequantize(layer).T`` in torch."""

    gemm_rows: int | None = 16
    """Input rows from which the CPU path dequantizes and calls ``F.linear``; None: never."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.device.type == "cpu" and cpu_ops.supports(x, bias):
            rows = x.reshape(-1, x.shape[-1])
            if self.gemm_rows is not None and rows.shape[0] >= self.gemm_rows:
                out = F.linear(rows, self.cpu_dequantize(layer), bias)
            else:
                out = self.cpu_apply(layer, rows, bias)
            return out.view(*x.shape[:-1], out.shape[-1])
        return self.torch_apply(layer, x, bias)

    def torch_apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.dequantize(layer).to(x.dtype), bias)

    @abstractmethod
    def cpu_apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x`` [M, K] float32 times the weight by the C kernel."""

    def cpu_dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The float32 weight by the C dequantizer, in the shared :func:`workspace`
        (``dequantize`` by default)."""
        return self.dequantize(layer).float()


class OnlineQuantizedLinearMethod(QuantizedLinearMethod):
    """Loads a float checkpoint like an unquantized layer, then quantizes it in place."""

    create_weights = UnquantizedLinearMethod.create_weights

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.detach().float()
        replace_parameters(layer, ["weight"], self.quantize(weight))

    @abstractmethod
    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The layer's quantized parameters (name -> tensor) for a float32 weight [N, K]."""
