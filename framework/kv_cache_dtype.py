"""KV-cache storage dtypes (``kv_cache_dtype``, vLLM's names): values only.

``"auto"`` stores the cache in the model's dtype; ``"fp8"`` / ``"fp8_e4m3"`` in float8 e4m3 and
``"fp8_e5m2"`` in float8 e5m2 (the FP8 KV cache: ``tokenmill.layers.kv_cache_quant``).
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
"""``kv_cache_dtype`` values and the storage dtype each means (None: the model's dtype)."""

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV cache is stored in."""
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES
