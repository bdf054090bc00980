"""The CPU platform: float32 by default, KV cache in host memory, the C kernels of
``tokenmill.ops.cpu`` as its op table."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from tokenmill import envs
from tokenmill.interfaces.attention import AttentionConfig
from tokenmill.interfaces.platform import Platform
from tokenmill.ops import cpu as cpu_ops
from tokenmill.platforms.cpu_memory import move_to_huge_pages
from tokenmill.platforms.cpu_threads import AdaptiveThreads

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.layers.activation import SiluAndMul
    from tokenmill.layers.layernorm import ResidualSum, RMSNorm
    from tokenmill.layers.lora import LoRAApply
    from tokenmill.layers.rotary_embedding import RotaryEmbedding
    from tokenmill.layers.vocab_embedding import VocabParallelEmbedding
    from tokenmill.interfaces.decode_graph import DecodeGraphRunner


def _cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16 present, and ``TOKENMILL_CPU_ISA`` not restricted to avx2."""
    if envs.TOKENMILL_CPU_ISA.strip().lower() == "avx2":
        return False
    return not cpu_ops.cpu_flags().isdisjoint({"avx512_bf16", "amx_bf16"})


def rms_norm(
    layer: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm by the C kernels; the fused form needs ``x`` and ``residual`` contiguous and of
    one shape."""
    if cpu_ops.supports(x, residual, layer.weight):
        if residual is None:
            return cpu_ops.rms_norm(x, layer.weight, layer.variance_epsilon)
        if x.is_contiguous() and residual.is_contiguous() and x.shape == residual.shape:
            return cpu_ops.fused_add_rms_norm(x, residual, layer.weight, layer.variance_epsilon)
    return layer.forward_native(x, residual)


def residual_sum(
    layer: ResidualSum, x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor
) -> None:
    if (
        cpu_ops.supports(x, residual, out)
        and x.is_contiguous()
        and (residual is None or (residual.is_contiguous() and residual.shape == x.shape))
        and out.dim() == 2
        and out.shape == x.shape
    ):
        cpu_ops.residual_sum(out, x, residual)
    else:
        layer.forward_native(x, residual, out)


def silu_and_mul(layer: SiluAndMul, x: torch.Tensor) -> torch.Tensor:
    if cpu_ops.supports(x):
        return cpu_ops.silu_and_mul(x)
    return layer.forward_native(x)


def rotary_embedding(
    layer: RotaryEmbedding, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE in place on flat 2-D ``query`` and ``key``."""
    if query.dim() == 2 and cpu_ops.supports(query, key, layer.cos_sin_cache):
        cpu_ops.rotary_embedding(
            positions,
            query,
            key,
            layer.cos_sin_cache,
            layer.head_size,
            layer.rotary_dim,
            layer.is_neox_style,
        )
        return query, key
    return layer.forward_native(positions, query, key)


def embedding(layer: VocabParallelEmbedding, input_ids: torch.Tensor) -> torch.Tensor:
    """The C row gather for an unsharded float32 table and flat ids (the input processor has
    checked every id against the vocabulary)."""
    if layer.tp_size == 1 and input_ids.dim() == 1 and layer.weight.is_contiguous() and cpu_ops.supports(layer.weight):
        return cpu_ops.embedding(input_ids, layer.weight)
    return layer.forward_native(input_ids)


def lora_apply(layer: LoRAApply, x: torch.Tensor, out: torch.Tensor) -> None:
    """Batched LoRA by the C kernel (each token's slot, its adapter's rank only) for float32
    2-D ``x`` and ``out``."""
    slots = layer.mapping.token_slots
    if slots is None:
        return
    if x.dim() == 2 and out.dim() == 2 and cpu_ops.supports(x, out, layer.lora_a, layer.lora_b):
        cpu_ops.lora_apply(
            out, x, layer.lora_a, layer.lora_b, slots, layer.slice_ranks, layer.slice_offsets, layer.max_rank
        )
    else:
        layer.forward_native(x, out)


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    detection_priority = 0
    adaptive_threads: ClassVar[AdaptiveThreads | None] = None
    """This process's thread count chooser, made by :meth:`set_num_threads`."""
    custom_ops = {
        "rms_norm": rms_norm,
        "residual_sum": residual_sum,
        "silu_and_mul": silu_and_mul,
        "rotary_embedding": rotary_embedding,
        "embedding": embedding,
        "lora_apply": lora_apply,
        "unquantized_linear": "tokenmill.platforms.cpu_linear:OneDNNLinearMethod",
        "unquantized_fused_moe": "tokenmill.platforms.cpu_fused_moe:OneDNNFusedMoEMethod",
    }

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def get_attn_backend_candidates(cls, config: AttentionConfig) -> list[str]:
        """MLA layers add the MLA backends; the selector reports why the others cannot serve."""
        candidates = ["cpu_sdpa", "torch"]
        return candidates + ["cpu_mla", "torch_mla"] if config.use_mla else candidates

    @classmethod
    def default_dtype(cls, model_dtype: torch.dtype) -> torch.dtype:
        """float32 unless the CPU computes bf16 natively (AVX512-BF16 / AMX)."""
        if model_dtype == torch.bfloat16 and _cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32

    @classmethod
    def get_ops(cls) -> dict[str, Callable[..., Any]]:
        """The C kernels' ops, each falling back to ``forward_native`` for tensors the kernels
        don't take (not float32, features strided); none where the kernels cannot be built or
        ``TOKENMILL_DISABLE_CPU_KERNELS`` is set."""
        return super().get_ops() if cpu_ops.load() is not None else {}

    @classmethod
    def decode_graph_runner(cls, config: EngineConfig) -> type[DecodeGraphRunner] | None:
        """Recorded C kernel calls (``tokenmill.platforms.cpu_graph``) where the kernels load and
        one process runs the whole model (collectives are not kernel calls)."""
        if cpu_ops.load() is None or config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            return None
        from tokenmill.platforms.cpu_graph import CpuGraphRunner

        return CpuGraphRunner

    @classmethod
    def place_weights(cls, model: nn.Module) -> None:
        """The parameters in one mapping on transparent huge pages (``platforms/cpu_memory.py``)."""
        move_to_huge_pages(model)

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
        """``TOKENMILL_CPU_THREADS``; unset, torch's default, shared out between the ranks
        when several engine processes (tensor or data parallel) run on this machine. That count
        is the most :meth:`before_step` uses: unless ``TOKENMILL_CPU_ADAPTIVE_THREADS=0``, it
        steps with fewer while other processes keep this process's cores busy
        (``platforms/cpu_threads.py``)."""
        if threads := envs.TOKENMILL_CPU_THREADS:
            torch.set_num_threads(threads)
        else:
            num_ranks = config.tensor_parallel_size * config.data_parallel_size
            if num_ranks > 1:
                torch.set_num_threads(max(1, torch.get_num_threads() // num_ranks))
        threads = torch.get_num_threads()
        cls.adaptive_threads = None
        if envs.TOKENMILL_CPU_ADAPTIVE_THREADS and threads > 1:
            cls.adaptive_threads = AdaptiveThreads(threads, frozenset(os.sched_getaffinity(0)))

    @classmethod
    def before_step(cls) -> None:
        if cls.adaptive_threads is not None:
            cls.adaptive_threads.before_step()
