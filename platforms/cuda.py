"""The CUDA platform: NVIDIA GPUs through torch's CUDA build.

Nothing here touches the GPU at import time; every query is a class method called once a
platform is being chosen or used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenmill.engine_args import DEFAULT_GPU_MEMORY_UTILIZATION
from tokenmill.interfaces.attention import AttentionConfig
from tokenmill.interfaces.platform import Platform

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.interfaces.decode_graph import DecodeGraphRunner

BF16_MIN_CAPABILITY = (8, 0)


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    supported_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    """bfloat16 needs compute capability 8.0 (Ampere); ``check_and_update_config`` enforces it."""
    detection_priority = 10
    custom_ops = {
        "unquantized_fused_moe": "tokenmill.platforms.cuda_fused_moe:TritonFusedMoEMethod",
        "lora_apply": "tokenmill.platforms.cuda_lora:lora_apply",
    }
    attn_backend_priority: tuple[str, ...] = ("flash_attn", "flashinfer", "triton", "torch")
    mla_backend_priority: tuple[str, ...] = ("triton_mla", "torch_mla")

    @classmethod
    def is_available(cls) -> bool:
        return torch.version.hip is None and torch.cuda.is_available()

    @classmethod
    def get_device_capability(cls) -> tuple[int, int] | None:
        if not cls.is_available():
            return None
        return torch.cuda.get_device_capability(torch.cuda.current_device())

    @classmethod
    def supports_bf16(cls) -> bool:
        capability = cls.get_device_capability()
        return capability is not None and capability >= BF16_MIN_CAPABILITY

    @classmethod
    def get_attn_backend_candidates(cls, config: AttentionConfig) -> list[str]:
        """The selector takes the first whose ``validate_configuration`` has no reasons, so a
        backend that is not installed or cannot serve this head size / dtype / block size is
        skipped in favour of the next."""
        if config.use_mla:
            return list(cls.mla_backend_priority + cls.attn_backend_priority)
        return list(cls.attn_backend_priority)

    @classmethod
    def default_dtype(cls, model_dtype: torch.dtype) -> torch.dtype:
        """The checkpoint's half type where the GPU has it (bfloat16 falls back to float16 before
        Ampere); float32 checkpoints also run in half precision, as in vLLM."""
        half = torch.bfloat16 if cls.supports_bf16() else torch.float16
        if model_dtype == torch.float16:
            return torch.float16
        return half

    @classmethod
    def check_and_update_config(cls, config: EngineConfig) -> None:
        if config.torch_dtype == torch.bfloat16 and not cls.supports_bf16():
            major, minor = cls.get_device_capability() or (0, 0)
            raise ValueError(
                f"bfloat16 needs a GPU of compute capability 8.0 or newer; this one is "
                f"{major}.{minor}: use dtype='float16'"
            )

    @classmethod
    def decode_graph_runner(cls, config: EngineConfig) -> type[DecodeGraphRunner] | None:
        """CUDA graphs (``tokenmill.platforms.cuda_graph``), for single-GPU engines only:
        tensor-parallel ranks run eager (their collectives are not captured)."""
        if config.tensor_parallel_size != 1:
            return None
        from tokenmill.platforms.cuda_graph import CudaGraphRunner

        return CudaGraphRunner

    @classmethod
    def device(cls, rank: int = 0) -> torch.device:
        """The rank's GPU, made the process's current CUDA device."""
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        return device

    @classmethod
    def get_device_total_memory(cls) -> int:
        return torch.cuda.mem_get_info()[1]

    @classmethod
    def get_available_memory(cls) -> int:
        return torch.cuda.mem_get_info()[0]

    @classmethod
    def get_kv_cache_budget(cls, config: EngineConfig) -> int:
        """``total × gpu_memory_utilization`` (0.9 when None) minus everything in use now
        (called after the model is loaded, so weights, the CUDA context and other processes
        count). The remaining ``1 - gpu_memory_utilization`` is the headroom for activations,
        the sampler and CUDA graphs."""
        free, total = torch.cuda.mem_get_info()
        used = total - free
        utilization = config.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        budget = int(total * utilization) - used
        if budget <= 0:
            raise ValueError(
                f"no GPU memory left for the KV cache: {used / 2**30:.2f} GiB of "
                f"{total / 2**30:.2f} GiB are in use, more than gpu_memory_utilization="
                f"{utilization} allows; raise it, or set num_kv_blocks or "
                f"kv_cache_memory_bytes"
            )
        return budget
