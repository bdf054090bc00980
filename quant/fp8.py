"""FP8 (e4m3fn) weights with one float scale per output channel.

``quantization="fp8"`` on a float checkpoint quantizes each output channel online
(``max|row| / 448``). A checkpoint whose ``quantization_config`` says ``quant_method: fp8``
(or ``compressed-tensors`` with FP8 weights, see ``compressed_tensors``) is loaded as stored:
FP8 ``weight`` and its ``weight_scale``, per tensor (a scalar, kept per shard of a fused layer)
or per channel. CUDA GPUs with FP8 tensor cores (compute capability 8.9 and up) multiply with
``torch._scaled_mm`` on dynamically quantized FP8 activations; the CPU widens the weights in
its C kernel; anything else dequantizes and multiplies in torch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.interfaces.quantization import LinearMethod, QuantizationMethod
from tokenmill.layers.linear import set_weight_attrs
from tokenmill.ops import cpu_quant
from tokenmill.quant.base import OnlineQuantizedLinearMethod, QuantizedLinearMethod, workspace

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 codes of ``weight`` [N, K] and their scales [N] (``max|row| / 448``)."""
    amax = weight.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).float()
    return (weight / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def has_fp8_tensor_cores(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ (weight * scale).T + bias`` on FP8 tensor cores: ``x`` quantized to FP8 with one
    dynamic scale, the per-channel weight scales applied to the float32 product."""
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    x_scale = (rows.abs().amax().float() / FP8_MAX).clamp(min=1e-12)
    xq = (rows / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    if m % 16:  # _scaled_mm takes row counts that are multiples of 16
        xq = torch.cat([xq, xq.new_zeros(16 - m % 16, xq.shape[1])])
    one = torch.ones((), device=x.device)
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=one, out_dtype=torch.float32)
    out = (out[:m] * scale).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], -1)


class Fp8LinearMethod(QuantizedLinearMethod):
    """The compute of an FP8 ``weight`` [N, K] with ``weight_scale`` [N]."""

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.float() * layer.weight_scale[:, None]

    def cpu_apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_quant.fp8_linear(x, layer.weight, layer.weight_scale, bias)

    def cpu_dequantize(self, layer: nn.Module) -> torch.Tensor:
        return cpu_quant.fp8_dequantize(layer.weight, layer.weight_scale, workspace(*layer.weight.shape))

    def torch_apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        n, k = layer.weight.shape
        if has_fp8_tensor_cores(x.device) and n % 16 == 0 and k % 16 == 0:
            return scaled_mm(x, layer.weight, layer.weight_scale, bias)
        return F.linear(x, self.dequantize(layer).to(x.dtype), bias)


class OnlineFp8LinearMethod(Fp8LinearMethod, OnlineQuantizedLinearMethod):
    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale = quantize_fp8(weight)
        return {"weight": q, "weight_scale": scale}


def _shard_rows(layer: nn.Module, shard_id: int | str | None) -> int:
    """Output rows of shard ``shard_id`` of a fused layer (all rows for an unfused one)."""
    if shard_id is None:
        return layer.weight.shape[0]
    index = "qkv".index(shard_id) if isinstance(shard_id, str) else shard_id
    return layer.output_sizes[index]


class SerializedFp8LinearMethod(Fp8LinearMethod):
    """Loads an FP8 checkpoint's ``weight`` and ``weight_scale`` as stored. A per-tensor scale
    is spread over its tensor's rows, so the shards of a fused layer keep their own scales."""

    def create_weights(self, layer, input_size, output_partition_sizes, params_dtype) -> None:
        n = sum(output_partition_sizes)
        weight = nn.Parameter(torch.empty(n, input_size, dtype=FP8), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
        layer.register_parameter("weight", weight)
        scale = nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(scale, {"output_dim": 0, "weight_loader": self._scale_loader(layer)})
        layer.register_parameter("weight_scale", scale)

    @staticmethod
    def _scale_loader(layer: nn.Module):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
            loaded = loaded.float().reshape(-1)
            if loaded.numel() == 1:
                loaded = loaded.expand(_shard_rows(layer, shard_id))
            if shard_id is None:
                layer.weight_loader(param, loaded)
            else:
                layer.weight_loader(param, loaded, shard_id)

        return load


class Fp8Config(QuantizationMethod):
    """``quantization="fp8"``: online per-channel FP8 of a float checkpoint, or a checkpoint
    stored in FP8 (``quant_method: fp8``, dynamic activation scales, no weight blocks)."""

    def __init__(self, serialized: bool) -> None:
        self.serialized = serialized
        self.tensor_parallel = not serialized

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        if not config:
            return cls(serialized=False)
        check_fp8_checkpoint(
            "fp8",
            static_activations=config.get("activation_scheme", "dynamic") != "dynamic",
            blocks=config.get("weight_block_size"),
        )
        return cls(serialized=True)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        return SerializedFp8LinearMethod() if self.serialized else OnlineFp8LinearMethod()


def check_fp8_checkpoint(method: str, static_activations: bool, blocks: Any) -> None:
    """Refuse FP8 checkpoint variants these kernels do not compute."""
    if static_activations:
        raise ValueError(
            f"{method} checkpoints with static activation scales are not supported; "
            f"ones with dynamic activation scales (or weight-only) are"
        )
    if blocks:
        raise ValueError(
            f"{method} checkpoints with block-wise weight scales (weight_block_size={blocks}) are "
            f"not supported; per-tensor and per-channel scales are"
        )
