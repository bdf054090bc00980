"""Checks shared by backends built on an NVIDIA-only attention library (flash-attn, FlashInfer)."""

from __future__ import annotations

import importlib
import importlib.util

import torch

from tokenmill.interfaces.attention import AttentionConfig

HALF_DTYPES = (torch.float16, torch.bfloat16)


def library_reasons(config: AttentionConfig, module: str, pip_name: str) -> list[str]:
    """Why a backend on ``module`` can't serve ``config``, without touching the GPU: the library
    and triton (its KV-cache write kernel) installed, an NVIDIA device, a half dtype."""
    reasons = []
    if importlib.util.find_spec(module) is None:
        reasons.append(f"{module} is not installed (pip install {pip_name})")
    if importlib.util.find_spec("triton") is None:
        reasons.append("triton is not installed (the KV-cache write kernel needs it)")
    if config.device_type != "cuda" or torch.version.hip is not None:
        reasons.append("needs an NVIDIA CUDA device")
    if config.dtype not in HALF_DTYPES:
        reasons.append(f"computes in float16 or bfloat16 only, not {config.dtype}")
    return reasons


def device_reasons(module: str, min_capability: tuple[int, int]) -> list[str]:
    """The checks that need the GPU and the library: compute capability, then a real import
    (a wheel built for another torch or CUDA fails only here)."""
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < min_capability:
        need = ".".join(map(str, min_capability))
        return [f"needs compute capability {need} or newer (this GPU is {major}.{minor})"]
    try:
        importlib.import_module(module)
    except Exception as e:
        return [f"{module} fails to import: {e}"]
    return []
