"""The ROCm platform: AMD GPUs through torch's HIP build (which keeps the ``cuda`` device type
and the ``torch.cuda`` API). Attention runs on the Triton kernels."""

from __future__ import annotations

import torch

from tokenmill.platforms.cuda import CudaPlatform


class RocmPlatform(CudaPlatform):
    name = "rocm"
    attn_backend_priority = ("triton", "torch")

    @classmethod
    def is_available(cls) -> bool:
        return torch.version.hip is not None and torch.cuda.is_available()

    @classmethod
    def supports_bf16(cls) -> bool:
        """Every GPU ROCm supports today (MI100 and newer) computes bfloat16."""
        return cls.is_available()
