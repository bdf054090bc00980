"""INT8 weights, quantized online from a float checkpoint: symmetric, one scale per output
channel (round to nearest). ``int8`` computes with float activations (weight-only);
``w8a8`` also quantizes each activation row to int8 (dynamic, symmetric) and sums the
products in int32, as vLLM's W8A8 int8 schemes do."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.interfaces.quantization import FusedMoEMethod, LinearMethod, QuantizationMethod
from tokenmill.ops import cpu_quant
from tokenmill.quant.base import OnlineQuantizedFusedMoEMethod, OnlineQuantizedLinearMethod, workspace


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 codes in [-127, 127] of ``weight`` [N, K] and their scales [N]
    (``max|row| / 127``; 1 for a zero row)."""
    amax = weight.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.float()


PANEL = 16
"""Weight rows per panel of :func:`pack_panels`."""


def pack_panels(q: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] in W8A8's panels [ceil(N/16), ceil(K/4), 16, 4]: four columns of sixteen
    rows per 64 bytes (zero-padded past N and K), the operand layout of integer dot-product
    instructions (x86 VNNI's vpdpbusd), so the kernel multiplies them with no horizontal sums."""
    n, k = q.shape
    n16, k4 = -(-n // PANEL), -(-k // 4)
    padded = F.pad(q, (0, 4 * k4 - k, 0, PANEL * n16 - n))
    return padded.view(n16, PANEL, k4, 4).permute(0, 2, 1, 3).contiguous()


def unpack_panels(panels: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The codes [n, k] of :func:`pack_panels`' output."""
    n16, k4 = panels.shape[:2]
    return panels.permute(0, 2, 1, 3).reshape(n16 * PANEL, k4 * 4)[:n, :k]


class Int8LinearMethod(OnlineQuantizedLinearMethod):
    """``x @ (q * scale).T``: float activations times int8 weights."""

    gemm_rows = 128
    """The C kernel (codes converted in registers) beats dequantize + ``F.linear`` on batches:
    the default model's layers alone, 2 threads, 64 rows 118 vs 139 ms, 128 rows 251 vs 300 ms;
    but a 256-row prefill in the engine took 0.44–0.51 s dequantizing vs 0.48–0.57 s in the
    kernel, so prefill chunks dequantize."""

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale = quantize_int8(weight)
        return {"weight": q, "weight_scale": scale}

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.float() * layer.weight_scale[:, None]

    def cpu_apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_quant.int8_linear(x, layer.weight, layer.weight_scale, bias)

    def cpu_dequantize(self, layer: nn.Module) -> torch.Tensor:
        return cpu_quant.int8_dequantize(layer.weight, layer.weight_scale, workspace(*layer.weight.shape))


class W8A8LinearMethod(OnlineQuantizedLinearMethod):
    """``int8``'s codes and scales, activations quantized per row to int8 as well; int32 sums on
    every path. The codes are stored in :func:`pack_panels`' layout, which the CPU kernel
    multiplies in place, at every row count: on the default model's shapes 1.5-2.7x float32
    oneDNN's rate with AVX-512 VNNI, 1.0-1.4x with AVX2 (``benchmarks/gemm.py``)."""

    gemm_rows = None

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale = quantize_int8(weight)
        self.in_features = weight.shape[1]
        return {"weight": pack_panels(q), "weight_scale": scale}

    def codes(self, layer: nn.Module) -> torch.Tensor:
        """The int8 codes [N, K] of the packed weight."""
        return unpack_panels(layer.weight, layer.weight_scale.shape[0], self.in_features)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return self.codes(layer).float() * layer.weight_scale[:, None]

    def cpu_apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_quant.w8a8_linear(x, layer.weight, layer.weight_scale, bias)

    def torch_apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        xq, xscale = quantize_int8(rows)
        out = (xq.float() @ self.codes(layer).float().T) * (xscale[:, None] * layer.weight_scale)
        out = out.to(x.dtype).view(*x.shape[:-1], -1)
        return out if bias is None else out + bias


class Int8Config(QuantizationMethod):
    """``quantization="int8"``: every linear layer of the model, the LM head (a tied head
    quantizes its own copy of the embedding, as llama.cpp's Q8_0 files do; the embedding's rows
    stay float) and the MoE experts. At one token per step the float32 head alone is as many
    bytes as all the int8 layers."""

    linear_method_cls: type[OnlineQuantizedLinearMethod] = Int8LinearMethod

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        return self.linear_method_cls()

    def get_lm_head_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        return self.linear_method_cls()

    def get_moe_method(self, layer: nn.Module, prefix: str) -> FusedMoEMethod:
        return OnlineQuantizedFusedMoEMethod(self.linear_method_cls)


class W8A8Int8Config(Int8Config):
    """``quantization="w8a8"``: int8 weights and dynamically quantized int8 activations."""

    linear_method_cls = W8A8LinearMethod

