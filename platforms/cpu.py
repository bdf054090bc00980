"""The CPU platform: float32 by default, KV cache in host memory."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from tokenmill import envs
from tokenmill.interfaces.attention import AttentionConfig
from tokenmill.interfaces.platform import Platform
from tokenmill.ops import cpu as cpu_ops

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig


def _cpu_has_fast_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    detection_priority = 0

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def get_attn_backend_candidates(cls, config: AttentionConfig) -> list[str]:
        return ["cpu_sdpa", "torch"]

    @classmethod
    def default_dtype(cls, model_dtype: torch.dtype) -> torch.dtype:
        """float32 unless the CPU computes bf16 natively (AVX512-BF16 / AMX)."""
        if model_dtype == torch.bfloat16 and _cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32

    @classmethod
    def import_kernels(cls) -> None:
        """Build (the first time on a machine) and load the C kernels before the first step."""
        cpu_ops.load()

    @classmethod
    def get_device_total_memory(cls) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    @classmethod
    def get_available_memory(cls) -> int:
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return cls.get_device_total_memory() // 2

    @classmethod
    def get_kv_cache_budget(cls, config: EngineConfig) -> int:
        """``TOKENMILL_CPU_KVCACHE_SPACE`` GiB, never more than a quarter of the memory
        available now."""
        budget = int(envs.TOKENMILL_CPU_KVCACHE_SPACE * (1 << 30))
        return min(budget, cls.get_available_memory() // 4)

    @classmethod
    def set_num_threads(cls, config: EngineConfig) -> None:
        if threads := envs.TOKENMILL_CPU_THREADS:
            torch.set_num_threads(threads)
