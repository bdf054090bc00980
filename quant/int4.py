"""Group-wise INT4 weights: each output row's columns in groups of ``group_size``, every group
a float scale and minimum, ``w = q * scale + minimum`` for 4-bit codes ``q`` (two per byte).

``int4`` quantizes a float checkpoint online (round to nearest, asymmetric: the group's minimum
and ``(max - min) / 15``). ``gptq`` and ``awq`` load those formats' int32-packed
``qweight`` / ``qzeros`` / ``scales`` and repack them into this layout without re-quantizing
(``w = (q - z) * s`` is ``q * s + (-z * s)``); GPTQ's act-order (a ``g_idx`` other than
``k // group_size``) is not supported.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
from torch import nn

from tokenmill.interfaces.quantization import LinearMethod, QuantizationMethod
from tokenmill.ops import cpu_quant
from tokenmill.quant.base import OnlineQuantizedLinearMethod, QuantizedLinearMethod, replace_parameters, workspace

CHUNK = 32
"""Columns per packing chunk: byte ``j`` of a chunk holds column ``j`` (low nibble) and
column ``j + 16`` (high nibble)."""

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""The column (of eight) that AWQ stores in nibble ``i`` of an int32."""


def pack(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (0..15, K a multiple of 32) -> bytes [N, K/2] in this layout."""
    n, k = q.shape
    chunks = q.to(torch.uint8).view(n, k // CHUNK, 2, CHUNK // 2)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(n, k // 2)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack`."""
    n, half = packed.shape
    chunks = packed.view(n, half // (CHUNK // 2), 1, CHUNK // 2)
    return torch.cat([chunks & 15, chunks >> 4], dim=2).reshape(n, half * 2)


def quantize_int4(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """Round-to-nearest asymmetric int4 of ``weight`` [N, K] in groups of ``group_size``."""
    n, k = weight.shape
    groups = weight.view(n, k // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = (high - low) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
    return {"weight_packed": pack(q.view(n, k)), "weight_scale": scale, "weight_min": low}


def unpack_int32(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit values per int32 (nibble ``i`` at bits ``4i``) spread along ``dim``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    values = (packed.unsqueeze(-1) >> shifts) & 15
    values = values.movedim(-1, dim + 1)
    shape = list(packed.shape)
    shape[dim] *= 8
    return values.reshape(shape)


def check_shape(input_size: int, group_size: int, prefix: str) -> None:
    if input_size % CHUNK or group_size % 8 or input_size % group_size:
        raise ValueError(
            f"{prefix}: int4 needs an input size that is a multiple of {CHUNK} and a group size "
            f"that is a multiple of 8 dividing it; got input {input_size}, group {group_size}"
        )


class Int4LinearMethod(QuantizedLinearMethod):
    """The int4 layout's compute: ``weight_packed``, ``weight_scale``, ``weight_min``."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        q = unpack(layer.weight_packed).float()
        n, k = q.shape
        groups = q.view(n, k // self.group_size, self.group_size)
        return (groups * layer.weight_scale[..., None] + layer.weight_min[..., None]).view(n, k)

    def cpu_apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_quant.int4_linear(x, layer.weight_packed, layer.weight_scale, layer.weight_min, bias)

    def cpu_dequantize(self, layer: nn.Module) -> torch.Tensor:
        n, half = layer.weight_packed.shape
        return cpu_quant.int4_dequantize(layer.weight_packed, layer.weight_scale, layer.weight_min, workspace(n, 2 * half))


class OnlineInt4LinearMethod(Int4LinearMethod, OnlineQuantizedLinearMethod):
    def create_weights(self, layer, input_size, output_partition_sizes, params_dtype) -> None:
        check_shape(input_size, self.group_size, layer.prefix)
        OnlineQuantizedLinearMethod.create_weights(self, layer, input_size, output_partition_sizes, params_dtype)

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return quantize_int4(weight, self.group_size)


def _shard_offset(layer: nn.Module, shard_id: int | str | None) -> int:
    """Where output shard ``shard_id`` of a fused layer starts (0 for an unfused one)."""
    if shard_id is None:
        return 0
    index = "qkv".index(shard_id) if isinstance(shard_id, str) else shard_id
    return sum(layer.output_partition_sizes[:index])


class PackedCheckpointLinearMethod(Int4LinearMethod):
    """Loads a GPTQ/AWQ checkpoint's tensors as stored, then repacks them into the int4
    layout. Subclasses give the checkpoint shapes and the unpacking."""

    def create_weights(self, layer, input_size, output_partition_sizes, params_dtype) -> None:
        self.group_size = input_size if self.group_size == -1 else self.group_size
        check_shape(input_size, self.group_size, layer.prefix)
        n = sum(output_partition_sizes)
        for name, (shape, dtype, pack) in self.checkpoint_tensors(input_size, n).items():
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            param.weight_loader = self._loader(layer, name, pack)
            layer.register_parameter(name, param)

    def _loader(self, layer: nn.Module, name: str, pack: int | None):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
            if pack is None:  # not split by output (g_idx)
                self.check_unsplit(layer, name, loaded)
                target = param.data
            else:
                start, rest = divmod(_shard_offset(layer, shard_id), pack)
                if rest or loaded.dim() != 2 or start + loaded.shape[1] > param.shape[1]:
                    raise ValueError(
                        f"{layer.prefix}.{name}: checkpoint tensor of shape {tuple(loaded.shape)} "
                        f"does not fit output shard {shard_id!r} of {tuple(param.shape)}"
                    )
                target = param.data.narrow(1, start, loaded.shape[1])
            if target.shape != loaded.shape:
                raise ValueError(
                    f"{layer.prefix}.{name}: checkpoint tensor has shape {tuple(loaded.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            target.copy_(loaded)

        return load

    def check_unsplit(self, layer: nn.Module, name: str, loaded: torch.Tensor) -> None:
        """Check a tensor that is not split by output channel."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, zeros, scales = self.codes(layer)  # [K, N], [K/g, N], [K/g, N]
        scales = scales.float()
        replace_parameters(
            layer,
            [name for name, _ in layer.named_parameters(recurse=False) if name != "bias"],
            {
                "weight_packed": pack(q.T.contiguous()),
                "weight_scale": scales.T.contiguous(),
                "weight_min": (-zeros.float() * scales).T.contiguous(),
            },
        )

    @abstractmethod
    def checkpoint_tensors(self, k: int, n: int) -> dict[str, tuple[tuple[int, ...], torch.dtype, int | None]]:
        """name -> (shape, dtype, values packed per int32 along the output dim, or None when the
        tensor is not split by output) of the checkpoint's tensors for a [n, k] weight."""

    @abstractmethod
    def codes(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The loaded codes [K, N], effective zero points and scales [K/group, N]."""


class GPTQLinearMethod(PackedCheckpointLinearMethod):
    """GPTQ: ``qweight`` [K/8, N] packed along K, ``qzeros`` [K/g, N/8] packed along N,
    ``scales`` [K/g, N] fp16, ``g_idx`` [K]. Version-1 checkpoints store ``zero - 1``."""

    def __init__(self, group_size: int, zero_offset: int) -> None:
        super().__init__(group_size)
        self.zero_offset = zero_offset

    def checkpoint_tensors(self, k, n):
        g = max(k // self.group_size, 1)
        return {
            "qweight": ((k // 8, n), torch.int32, 1),
            "qzeros": ((g, n // 8), torch.int32, 8),
            "scales": ((g, n), torch.float16, 1),
            "g_idx": ((k,), torch.int32, None),
        }

    def check_unsplit(self, layer, name, loaded) -> None:
        trivial = torch.arange(loaded.shape[0], dtype=loaded.dtype) // self.group_size
        if not torch.equal(loaded, trivial):
            raise ValueError(
                f"{layer.prefix}: GPTQ act-order (desc_act, a g_idx other than k // group_size) "
                f"is not supported"
            )

    def codes(self, layer):
        q = unpack_int32(layer.qweight.data, dim=0)
        zeros = unpack_int32(layer.qzeros.data, dim=1) + self.zero_offset
        return q, zeros, layer.scales.data


class AWQLinearMethod(PackedCheckpointLinearMethod):
    """AWQ (GEMM layout): ``qweight`` [K, N/8] and ``qzeros`` [K/g, N/8] packed along N in the
    order ``AWQ_ORDER``, ``scales`` [K/g, N] fp16."""

    def checkpoint_tensors(self, k, n):
        g = max(k // self.group_size, 1)
        return {
            "qweight": ((k, n // 8), torch.int32, 8),
            "qzeros": ((g, n // 8), torch.int32, 8),
            "scales": ((g, n), torch.float16, 1),
        }

    @staticmethod
    def _unpack(packed: torch.Tensor) -> torch.Tensor:
        values = unpack_int32(packed, dim=1).view(packed.shape[0], -1, 8)
        inverse = [AWQ_ORDER.index(c) for c in range(8)]
        return values[..., inverse].reshape(packed.shape[0], -1)

    def codes(self, layer):
        return self._unpack(layer.qweight.data), self._unpack(layer.qzeros.data), layer.scales.data


def _excluded(prefix: str, modules: list[str]) -> bool:
    return any(name in prefix for name in modules)


class Int4Config(QuantizationMethod):
    """``quantization="int4"``: online RTN of every linear layer; ``group_size`` (32 by
    default; 128 also common) from the checkpoint's ``quantization_config``."""

    def __init__(self, group_size: int = 32) -> None:
        self.group_size = group_size

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Int4Config:
        return cls(int(config.get("group_size", 32)))

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        return OnlineInt4LinearMethod(self.group_size)


def _require_4bit(method: str, bits: int) -> None:
    if bits != 4:
        raise ValueError(f"{method} checkpoints with {bits}-bit weights are not supported; 4-bit ones are")


class GPTQConfig(QuantizationMethod):
    """A GPTQ checkpoint (``quant_method: gptq``): 4 bits, ``desc_act`` off."""

    tensor_parallel = False

    def __init__(self, group_size: int, zero_offset: int, skip: list[str]) -> None:
        self.group_size, self.zero_offset, self.skip = group_size, zero_offset, skip

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        if not config:
            raise ValueError("gptq loads GPTQ checkpoints; for online int4 quantization use quantization='int4'")
        _require_4bit("gptq", int(config.get("bits", 4)))
        if config.get("desc_act"):
            raise ValueError("GPTQ checkpoints with desc_act (act-order) are not supported")
        v2 = config.get("checkpoint_format", "gptq") == "gptq_v2"
        return cls(int(config.get("group_size", 128)), 0 if v2 else 1, config.get("modules_to_not_convert") or [])

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        return None if _excluded(prefix, self.skip) else GPTQLinearMethod(self.group_size, self.zero_offset)


class AWQConfig(QuantizationMethod):
    """An AWQ checkpoint (``quant_method: awq``, GEMM layout, with zero points)."""

    tensor_parallel = False

    def __init__(self, group_size: int, skip: list[str]) -> None:
        self.group_size, self.skip = group_size, skip

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        if not config:
            raise ValueError("awq loads AWQ checkpoints; for online int4 quantization use quantization='int4'")
        _require_4bit("awq", int(config.get("bits", config.get("w_bit", 4))))
        if not config.get("zero_point", True):
            raise ValueError("AWQ checkpoints without zero points are not supported")
        group = int(config.get("group_size", config.get("q_group_size", 128)))
        return cls(group, config.get("modules_to_not_convert") or [])

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        return None if _excluded(prefix, self.skip) else AWQLinearMethod(self.group_size)
