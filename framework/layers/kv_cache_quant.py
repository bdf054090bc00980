"""The FP8 KV cache (``kv_cache_dtype`` ``"fp8"`` or ``"fp8_e4m3"``: float8 e4m3; ``"fp8_e5m2"``;
vLLM's names).

A layer's cache holds ``key / k_scale`` and ``value / v_scale`` in float8, clamped to the
format's finite range (quantize on write); readers convert back and multiply by the scale
(dequantize on read). The scales are per layer (vLLM's ``k_scale`` and ``v_scale``): 1.0
unless the checkpoint carries them. One byte per value halves a bfloat16 cache and quarters a
float32 one, so the same memory holds two or four times the blocks. An MLA layer's latent cache
uses ``k_scale`` for the whole latent, as vLLM's. Models load checkpoint scales with
:func:`load_kv_scale`.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from tokenmill.kv_cache_dtype import is_fp8

K_SCALE_RANGE, V_SCALE_RANGE = 200.0, 100.0
"""``calculate_kv_scales``: a layer's first keys and values map their largest magnitude to these
(vLLM's ``K_SCALE_CONSTANT`` and ``V_SCALE_CONSTANT``), well inside float8's range."""


def quantize(values: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``values / scale`` in float8 ``dtype``, clamped to its finite range."""
    limit = torch.finfo(dtype).max
    return (values.float() / scale).clamp_(-limit, limit).to(dtype)


def write(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, scale: float) -> None:
    """``cache[slots] = values`` (rows of a flat cache view), quantized when the cache is
    float8."""
    if is_fp8(cache.dtype):
        quantized = quantize(values, scale, cache.dtype)
        cache.view(torch.uint8).index_copy_(0, slots, quantized.view(torch.uint8))
    else:
        cache.index_copy_(0, slots, values.to(cache.dtype))


def read(cached: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Values read from a cache as ``dtype``: a float8 cache's times ``scale``."""
    if not is_fp8(cached.dtype):
        return cached.to(dtype)
    values = cached.to(dtype)
    return values.mul_(scale) if scale != 1.0 else values


def round_trip(values: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """``values`` as a cache of ``cache_dtype`` would give them back: attention over new keys
    and values that does not read them from the cache sees what later reads will."""
    if not is_fp8(cache_dtype):
        return values
    return read(quantize(values, scale, cache_dtype), scale, values.dtype)


_SCALE_NAME = re.compile(r"^(.+\.self_attn)\.(?:([kv])_scale|([kv])_proj\.output_scale)$")


def calculate_scale(values: torch.Tensor, value_range: float) -> float:
    """The scale mapping the largest magnitude of ``values`` to ``value_range`` (1.0 for all
    zeros)."""
    amax = float(values.abs().max()) if values.numel() else 0.0
    return amax / value_range if amax > 0 else 1.0


def load_kv_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """If checkpoint tensor ``name`` is a KV-cache scale (``….self_attn.k_scale`` as
    compressed-tensors writes it, ``….self_attn.k_proj.output_scale`` as ModelOpt does; ``v``
    likewise), set it on that layer's attention (``….self_attn.attn``) and return True; a scale
    with several entries (per head) counts as its largest, which keeps every head in range.
    False for any other name."""
    match = _SCALE_NAME.match(name)
    if match is None:
        return False
    layer_name = f"{match.group(1)}.attn"
    kind = match.group(2) or match.group(3)
    for module in model.modules():
        if getattr(module, "layer_name", None) == layer_name:
            setattr(module.impl, f"{kind}_scale", float(tensor.float().max()))
            return True
    raise ValueError(f"checkpoint weight {name!r} is a KV-cache scale of no attention layer ({layer_name!r})")
