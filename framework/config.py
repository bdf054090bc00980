"""Engine configuration: the user's arguments, checked (a value object). Resolving them
against the model and the platform (the HF config, the platform class, the registries) is
``tokenmill.config_resolver.resolve_config``'s job."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, get_args

import torch

from tokenmill.engine_args import (
    ALL2ALL_BACKEND_NAMES,
    DATA_PARALLEL_BACKENDS,
    HASH_ALGOS,
    LOGPROBS_MODES,
    DistributedExecutorBackend,
    EngineArgs,
)
from tokenmill.kv_cache_dtype import KV_CACHE_DTYPES
from tokenmill.kv_transfer_config import KVTransferConfig
from tokenmill.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    from tokenmill.interfaces.platform import Platform

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass
class EngineConfig(EngineArgs):
    """Everything ``LLM(...)`` accepts (the fields of ``EngineArgs``, each documented there),
    checked as values. ``tokenmill.config_resolver.resolve_config`` fills the derived fields
    (model path, HF config, platform, torch dtype, lengths).

    Settings whose feature has not landed (quantization without a registered method, pipeline
    parallelism with LoRA) raise ``ValueError`` rather than
    being ignored; so does
    ``gpu_memory_utilization`` (None: 0.9 on GPUs) on a CPU platform, and a tensor-parallel
    size that does not divide the model's attention heads.
    """

    model_path: str = field(init=False, default="")
    weights_path: str = field(init=False, default="")
    hf_config: Any = field(init=False, default=None)
    platform_cls: type[Platform] = field(init=False, repr=False)
    """Set by ``resolve_config``."""
    torch_dtype: torch.dtype = field(init=False, default=torch.float32)
    kv_cache_torch_dtype: torch.dtype = field(init=False, default=torch.float32)
    speculative: SpeculativeConfig | None = field(init=False, default=None)
    draft_hf_config: Any = field(init=False, default=None)
    kv_transfer: KVTransferConfig | None = field(init=False, default=None)
    """``kv_transfer_config``, checked."""
    data_parallel_rank: int = field(init=False, default=0)
    """Which of the ``data_parallel_size`` engine cores this configuration builds."""
    data_parallel_rank_local: int = field(init=False, default=0)
    """Which engine core this is among those sharing its node's devices: its workers take the
    devices after those of the cores before it (0 under Ray, which shows each core only its
    own devices)."""
    expert_parallel_init_method: str | None = field(init=False, default=None)
    """Where the workers of every data-parallel engine core meet (``tcp://host:port``) to
    form one expert-parallel group (``expert_parallel_across_data_parallel``); set by the
    front end."""
    data_parallel_sync_init_method: str | None = field(init=False, default=None)
    """Where the data-parallel engine cores meet to agree on each step (the same case)."""

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        names = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(unknown)}")
        return cls(**kwargs)

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "block_size",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "data_parallel_size",
        ):
            _positive_int(name, getattr(self, name))
        for name in ("max_model_len", "max_num_batched_tokens", "num_kv_blocks", "kv_cache_memory_bytes"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(
                f"prefix_caching_hash_algo must be one of {', '.join(HASH_ALGOS)}, "
                f"got {self.prefix_caching_hash_algo!r}"
            )
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}"
            )
        if self.all2all_backend not in ALL2ALL_BACKEND_NAMES:
            raise ValueError(
                f"all2all_backend must be one of {', '.join(ALL2ALL_BACKEND_NAMES)}, "
                f"got {self.all2all_backend!r}"
            )
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError("calculate_kv_scales needs an FP8 KV cache (kv_cache_dtype='fp8')")
        if self.speculative_config is not None:
            self.speculative = SpeculativeConfig.from_dict(self.speculative_config)
        if isinstance(self.kv_transfer_config, KVTransferConfig):
            self.kv_transfer = self.kv_transfer_config
        elif self.kv_transfer_config is not None:
            self.kv_transfer = KVTransferConfig.from_dict(self.kv_transfer_config)
        if self.distributed_executor_backend not in (None, *get_args(DistributedExecutorBackend)):
            raise ValueError(
                f"distributed_executor_backend must be one of "
                f"{', '.join(get_args(DistributedExecutorBackend))} or None, got "
                f"{self.distributed_executor_backend!r}"
            )
        if self.data_parallel_backend not in DATA_PARALLEL_BACKENDS:
            raise ValueError(
                f"data_parallel_backend must be one of {', '.join(DATA_PARALLEL_BACKENDS)}, "
                f"got {self.data_parallel_backend!r}"
            )
        if self.data_parallel_backend == "ray" and self.distributed_executor_backend == "ray":
            raise ValueError(
                "data_parallel_backend='ray' with distributed_executor_backend='ray' is not "
                "implemented: each engine core's Ray actor runs its workers as processes on its "
                "node (distributed_executor_backend='mp')"
            )
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one worker; tensor_parallel_size="
                f"{self.tensor_parallel_size} x pipeline_parallel_size="
                f"{self.pipeline_parallel_size} needs 'mp'"
                + " or 'ray'"
            )
        if self.tensor_parallel_size > 1 and self.speculative is not None:
            raise ValueError(
                f"speculative decoding with tensor parallelism is not implemented yet "
                f"(tensor_parallel_size={self.tensor_parallel_size}); leave "
                f"speculative_config at None"
            )
        self._check_lora()
        self._check_kv_transfer()
        self._check_expert_parallel_across_data_parallel()
        self._refuse_missing_features()

    def _check_lora(self) -> None:
        """LoRA settings need ``enable_lora``; LoRA refuses what it does not combine with."""
        defaults = {f.name: f.default for f in fields(self)}
        if not self.enable_lora:
            for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
                if getattr(self, name) != defaults[name]:
                    raise ValueError(f"{name}={getattr(self, name)!r} needs enable_lora=True")
            return
        for name in ("max_loras", "max_lora_rank"):
            _positive_int(name, getattr(self, name))
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        _positive_int("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras={self.max_cpu_loras} must be at least max_loras={self.max_loras}"
            )
        if self.tensor_parallel_size > 1:
            raise ValueError(
                f"enable_lora with tensor parallelism is not implemented yet "
                f"(tensor_parallel_size={self.tensor_parallel_size})"
            )
        if self.speculative is not None and self.speculative.method != "ngram":
            raise ValueError(
                f"enable_lora with speculative decoding by {self.speculative.method!r} is not "
                f"implemented (its draft model would run without the adapters); use the ngram "
                f"method or leave speculative_config at None"
            )

    def _check_kv_transfer(self) -> None:
        """A KV connector moves whole blocks of one rank's cache, found by their prefix hashes."""
        if self.kv_transfer is None:
            return
        for name, wanted in (
            ("tensor_parallel_size", self.tensor_parallel_size > 1),
            ("speculative_config", self.speculative is not None),
        ):
            if wanted:
                raise ValueError(
                    f"kv_transfer_config with {name}={getattr(self, name)!r} is not implemented "
                    f"yet; leave one of them at its default"
                )
        if not self.enable_prefix_caching:
            raise ValueError(
                "kv_transfer_config needs enable_prefix_caching=True: connectors find and "
                "place blocks by their prefix-cache hashes"
            )

    def _check_expert_parallel_across_data_parallel(self) -> None:
        """Expert parallelism over data-parallel engine cores: the cores' workers are local
        processes (``mp``) that run every step together, so what adds steps of its own or
        places cores elsewhere is refused."""
        if not self.expert_parallel_across_data_parallel:
            return
        refused = {
            "data_parallel_backend": self.data_parallel_backend == "ray",
            "distributed_executor_backend": self.distributed_executor_backend not in (None, "mp"),
            "pipeline_parallel_size": self.pipeline_parallel_size > 1,
            "speculative_config": self.speculative is not None,
            "kv_transfer_config": self.kv_transfer is not None,
        }
        for name, wanted in refused.items():
            if wanted:
                raise ValueError(
                    f"enable_expert_parallel with data_parallel_size={self.data_parallel_size} "
                    f"and {name}={getattr(self, name)!r} is not implemented: the engine cores' "
                    f"workers meet in one expert-parallel group of local processes "
                    f"(data_parallel_backend='mp', distributed_executor_backend='mp') and step "
                    f"together; leave {name} at its default"
                )

    def _refuse_missing_features(self) -> None:
        pp = self.pipeline_parallel_size
        if pp > 1 and self.enable_lora:
            raise ValueError(
                f"pipeline parallelism with enable_lora is not implemented yet "
                f"(pipeline_parallel_size={pp}); leave pipeline_parallel_size at 1"
            )

    @property
    def world_size(self) -> int:
        """Worker ranks of one engine core: ``tensor_parallel_size * pipeline_parallel_size``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def expert_parallel_across_data_parallel(self) -> bool:
        """Whether the expert-parallel group spans the tensor-parallel ranks of every
        data-parallel engine core (DP attention + EP MoE)."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    @property
    def executor_backend(self) -> str:
        """``distributed_executor_backend``, resolved: uni for one rank, else mp unless set
        (mp also for one rank whose experts span the data-parallel cores: its worker joins
        the other cores' workers in a process group of its own)."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        if self.world_size == 1 and not self.expert_parallel_across_data_parallel:
            return "uni"
        return "mp"


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
