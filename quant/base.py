"""What the weight-quantized linear methods share: the dispatch between the CPU kernels and
torch's dequantize-then-matmul, online quantization of a float checkpoint after loading, and
MoE experts quantized by a linear method."""

from __future__ import annotations

import threading
from abc import abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.interfaces.quantization import LinearMethod
from tokenmill.layers.fused_moe import ExpertMLP, FusedMoE, UnquantizedFusedMoEMethod
from tokenmill.layers.linear import UnquantizedLinearMethod
from tokenmill.ops import cpu as cpu_ops


def replace_parameters(layer: nn.Module, old: list[str], new: dict[str, torch.Tensor]) -> None:
    """Drop ``layer``'s parameters ``old`` and register ``new`` (frozen) in their place."""
    for name in old:
        delattr(layer, name)
    for name, tensor in new.items():
        layer.register_parameter(name, nn.Parameter(tensor.contiguous(), requires_grad=False))


_local = threading.local()


def workspace(n: int, k: int) -> torch.Tensor:
    """A float32 [n, k] scratch tensor shared by the layers that one thread runs (each
    dequantized weight lives only until its GEMM returns), so large batches do not fault in
    fresh pages every call. Each thread has its own: engines stepping in other threads (an
    ``LLM`` beside an in-process ``AsyncLLM``) never write into it."""
    buffer = getattr(_local, "workspace", None)
    if buffer is None or buffer.numel() < n * k:
        buffer = _local.workspace = torch.empty(n * k)
    return buffer[: n * k].view(n, k)


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


class ExpertProjection(nn.Module):
    """One expert's gate-up or down projection as a layer of its own (``weight`` [N, K]), which
    an :class:`OnlineQuantizedLinearMethod` quantizes and applies like any linear layer."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)


class OnlineQuantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    """MoE experts quantized after loading by ``linear_method_cls``: each expert's ``w13`` and
    ``w2`` become two :class:`ExpertProjection` layers (``layer.quantized_experts``), the float
    stacks are dropped, and each expert's MLP is the method's two products around SiLU-and-mul.
    Tensor-parallel ranks quantize their own slices."""

    def __init__(self, linear_method_cls: type[OnlineQuantizedLinearMethod]) -> None:
        self.gate_up_method = linear_method_cls()
        self.down_method = linear_method_cls()

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        experts = nn.ModuleList()
        for w13, w2 in zip(layer.w13_weight.detach(), layer.w2_weight.detach()):
            gate_up, down = ExpertProjection(w13.float()), ExpertProjection(w2.float())
            self.gate_up_method.process_weights_after_loading(gate_up)
            self.down_method.process_weights_after_loading(down)
            experts.append(nn.ModuleList([gate_up, down]))
        replace_parameters(layer, ["w13_weight", "w2_weight"], {})
        layer.quantized_experts = experts

    def expert_mlp(self, layer: FusedMoE, hidden_states: torch.Tensor) -> ExpertMLP:
        inter = layer.intermediate_size_per_partition

        def expert_mlp(expert: int, x: torch.Tensor) -> torch.Tensor:
            gate_up, down = layer.quantized_experts[expert]
            h = self.gate_up_method.apply(gate_up, x, None)
            return self.down_method.apply(down, F.silu(h[:, :inter]) * h[:, inter:], None)

        return expert_mlp
