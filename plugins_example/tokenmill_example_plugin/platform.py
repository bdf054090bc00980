"""A CPU platform that is used only when asked for.

Auto-detection skips it unless ``TOKENMILL_EXAMPLE_PLATFORM=1``; ``platform="example"`` or
``TOKENMILL_PLATFORM=example`` selects it explicitly. It prefers the example's head-major
attention backend, computes in float32 only and swaps in its own RMSNorm op (``ops.py``) through
its op table; the other layers keep their ``forward_native``. CUDA graphs stay off (the
``Platform`` default).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from tokenmill.interfaces import AttentionConfig, Platform

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig

ENV_VAR = "TOKENMILL_EXAMPLE_PLATFORM"
KV_CACHE_BYTES = 512 << 20


class ExamplePlatform(Platform):
    name = "example"
    device_type = "cpu"
    supported_dtypes = (torch.float32,)
    custom_ops = {"rms_norm": "tokenmill_example_plugin.ops:rms_norm"}

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def is_auto_selectable(cls) -> bool:
        return os.environ.get(ENV_VAR) == "1"

    @classmethod
    def get_attn_backend_candidates(cls, config: AttentionConfig) -> list[str]:
        return ["example-hnd", "torch"]

    @classmethod
    def get_device_total_memory(cls) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    @classmethod
    def get_available_memory(cls) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    @classmethod
    def get_kv_cache_budget(cls, config: EngineConfig) -> int:
        """512 MiB, or a quarter of the free memory when that is less."""
        return min(KV_CACHE_BYTES, cls.get_available_memory() // 4)
