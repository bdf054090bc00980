"""Engine configuration: the user's arguments, checked, then resolved against the model and
the platform."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, get_args

import torch

from tokenmill.core.kv_cache_utils import check_hash_algo
from tokenmill.engine_args import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    MAX_DEFAULT_MODEL_LEN,
    DistributedExecutorBackend,
    EngineArgs,
)
from tokenmill.interfaces.platform import Platform
from tokenmill.interfaces.quantization import QuantizationMethod
from tokenmill.logprobs import LOGPROBS_MODES
from tokenmill.kv_cache_dtype import KV_CACHE_DTYPES, kv_cache_torch_dtype
from tokenmill.speculative_config import SpeculativeConfig

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass
class EngineConfig(EngineArgs):
    """Everything ``LLM(...)`` accepts (the fields of ``EngineArgs``, each documented there).
    ``finalize()`` fills the derived fields (model path, HF config, platform, torch dtype,
    lengths).

    Settings whose feature has not landed (quantization without a registered method, pipeline
    parallelism) raise ``ValueError`` rather than being ignored; so does
    ``gpu_memory_utilization`` (None: 0.9 on GPUs) on a CPU platform, and a tensor-parallel
    size that does not divide the model's attention heads.
    """

    model_path: str = field(init=False, default="")
    weights_path: str = field(init=False, default="")
    hf_config: Any = field(init=False, default=None)
    platform_cls: type[Platform] = field(init=False, default=Platform)
    torch_dtype: torch.dtype = field(init=False, default=torch.float32)
    kv_cache_torch_dtype: torch.dtype = field(init=False, default=torch.float32)
    speculative: SpeculativeConfig | None = field(init=False, default=None)
    draft_hf_config: Any = field(init=False, default=None)
    data_parallel_rank: int = field(init=False, default=0)
    """Which of the ``data_parallel_size`` engine cores this configuration builds."""

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
        check_hash_algo(self.prefix_caching_hash_algo)
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}"
            )
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError("calculate_kv_scales needs an FP8 KV cache (kv_cache_dtype='fp8')")
        if self.speculative_config is not None:
            self.speculative = SpeculativeConfig.from_dict(self.speculative_config)
        if self.distributed_executor_backend not in (None, *get_args(DistributedExecutorBackend)):
            raise ValueError(
                f"distributed_executor_backend must be one of "
                f"{', '.join(get_args(DistributedExecutorBackend))} or None, got "
                f"{self.distributed_executor_backend!r}"
            )
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one worker; tensor_parallel_size="
                f"{self.tensor_parallel_size} needs 'mp' or 'ray'"
            )
        if self.tensor_parallel_size > 1 and self.speculative is not None:
            raise ValueError(
                f"speculative decoding with tensor parallelism is not implemented yet "
                f"(tensor_parallel_size={self.tensor_parallel_size}); leave "
                f"speculative_config at None"
            )
        self._refuse_missing_features()

    def _refuse_missing_features(self) -> None:
        defaults = {f.name: f.default for f in fields(self)}
        for feature, name, wanted in (
            ("pipeline parallelism", "pipeline_parallel_size", self.pipeline_parallel_size > 1),
        ):
            if wanted:
                raise ValueError(
                    f"{feature} is not implemented yet ({name}={getattr(self, name)!r}); "
                    f"leave {name} at {defaults[name]!r}"
                )

    def finalize(self) -> EngineConfig:
        """Resolve the model, platform, dtype and lengths; raises on anything unusable."""
        from tokenmill.model_loader.loader import load_hf_config
        from tokenmill.selector import select_platform

        self._resolve_model()
        self.hf_config = load_hf_config(self.model_path)
        self.platform_cls = select_platform(self.platform)
        self.torch_dtype = self._resolve_dtype()
        self.kv_cache_torch_dtype = kv_cache_torch_dtype(self.kv_cache_dtype, self.torch_dtype)
        self._check_quantization()
        self._check_tensor_parallel()
        if self.speculative is not None:
            self._check_speculative(self.speculative)
        if self.gpu_memory_utilization is not None and self.platform_cls.device_type == "cpu":
            raise ValueError(
                f"gpu_memory_utilization applies to GPU platforms only; platform "
                f"{self.platform_cls.name!r} sizes the KV cache from kv_cache_memory_bytes or "
                f"num_kv_blocks"
            )

        model_max = _model_max_len(self.hf_config)
        if self.max_model_len is None:
            self.max_model_len = min(model_max, MAX_DEFAULT_MODEL_LEN)
        elif self.max_model_len > model_max:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than the model's maximum "
                f"({model_max})"
            )
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS
            if not self.enable_chunked_prefill:
                self.max_num_batched_tokens = max(self.max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS)
        elif not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})"
            )
        self.platform_cls.check_and_update_config(self)
        return self

    def _resolve_model(self) -> None:
        """Set ``model_path`` (the HF config and tokenizer) and ``weights_path``: both the model
        directory, or for a GGUF file (the default model's own with ``quantization="gguf"``) the
        file and a cached directory of its metadata; a GGUF file loads with the gguf method."""
        from tokenmill.default_model import cache_dir, default_model_path, gguf_path
        from tokenmill.model_loader.gguf_file import is_gguf_file, metadata_dir

        if self.model is None:
            if self.quantization != "gguf":
                self.model_path = self.weights_path = default_model_path()
                return
            path = str(gguf_path())
        else:
            path = os.path.expanduser(str(self.model))
            if os.path.isdir(path):
                if self.quantization == "gguf":
                    raise ValueError(
                        f"quantization='gguf' loads GGUF files; {path!r} is a model directory "
                        f"(pass model='file.gguf', or model=None for the default model's file)"
                    )
                self.model_path = self.weights_path = path
                return
            if not is_gguf_file(path):
                what = "is not a GGUF file" if os.path.isfile(path) else "does not exist"
                raise FileNotFoundError(f"model {path!r} {what}: pass a model directory or a GGUF file")
        if self.quantization not in (None, "gguf"):
            raise ValueError(
                f"model {path!r} is a GGUF file, which loads with quantization='gguf', "
                f"not {self.quantization!r}"
            )
        self.quantization = "gguf"
        self.weights_path = path
        self.model_path = metadata_dir(path, cache_dir())

    @property
    def executor_backend(self) -> str:
        """``distributed_executor_backend``, resolved: uni for one rank, else mp unless set."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.tensor_parallel_size == 1 else "mp"

    def _check_tensor_parallel(self) -> None:
        """Each rank must hold whole attention heads (KV heads split evenly, or replicated
        when there are fewer than ranks) and an equal slice of the MLPs."""
        tp = self.tensor_parallel_size
        if tp == 1:
            return
        hf = self.hf_config
        heads = hf.num_attention_heads
        kv_heads = getattr(hf, "num_key_value_heads", None) or heads
        kv_split = kv_heads % tp == 0 if kv_heads >= tp else tp % kv_heads == 0
        if getattr(hf, "kv_lora_rank", None) is not None:
            kv_split = True  # MLA: every rank holds the one latent all heads share
        if heads % tp or not kv_split:
            raise ValueError(
                f"tensor_parallel_size={tp} does not split the model's {heads} attention heads "
                f"and {kv_heads} KV heads evenly: it must divide the attention heads, and divide "
                f"the KV heads or be a multiple of them"
            )
        for name in ("intermediate_size", "moe_intermediate_size"):
            size = getattr(hf, name, None)
            if isinstance(size, int) and size % tp:
                raise ValueError(
                    f"tensor_parallel_size={tp} does not divide the model's {name} ({size})"
                )

    def _check_speculative(self, spec: SpeculativeConfig) -> None:
        """The method must be a registered proposer; a draft model must share the target's
        vocabulary; ``mtp`` runs the target checkpoint's own MTP layers."""
        from tokenmill import plugins
        from tokenmill.model_loader.loader import load_hf_config

        registry = plugins.get_registry("proposers")
        if spec.method not in registry:
            raise ValueError(
                f"speculative_config['method'] {spec.method!r} is not a registered proposer; "
                f"registered: {', '.join(registry.names()) or 'none'}{registry.filter_suffix()}"
            )
        if spec.method == "mtp":
            if spec.model is not None and os.path.realpath(spec.model) != os.path.realpath(self.model_path):
                raise ValueError(
                    f"speculative_config['model'] {spec.model!r}: method 'mtp' runs the MTP "
                    f"layers of the target checkpoint {self.model_path!r}; leave 'model' out"
                )
            if not getattr(self.hf_config, "num_nextn_predict_layers", 0):
                raise ValueError(
                    "speculative_config['method'] 'mtp' needs a target with MTP layers "
                    "(num_nextn_predict_layers > 0 in its config.json)"
                )
            self.draft_hf_config = self.hf_config
            return
        if spec.model is not None:
            self.draft_hf_config = load_hf_config(spec.model)
            draft_vocab = self.draft_hf_config.vocab_size
            if draft_vocab != self.hf_config.vocab_size:
                raise ValueError(
                    f"speculative_config['model'] {spec.model!r} has a vocabulary of "
                    f"{draft_vocab} tokens, the target {self.hf_config.vocab_size}: a draft "
                    f"model must share the target's tokenizer"
                )

    def _check_quantization(self) -> None:
        """Take the checkpoint's ``quant_method`` when ``quantization`` is None, then refuse a
        method that is not registered, that the platform does not run (its
        ``supported_quantization``, when not empty), that does not compute in the dtype, that
        refuses the checkpoint, or that does not load with tensor parallelism when asked to."""
        from tokenmill import plugins

        checkpoint = getattr(self.hf_config, "quantization_config", None) or {}
        stored = checkpoint.get("quant_method")
        if self.quantization is not None and stored is not None and self.quantization != stored:
            raise ValueError(
                f"the checkpoint is quantized with {stored!r}; quantization={self.quantization!r} "
                f"cannot load it (leave quantization unset or pass {stored!r})"
            )
        self.quantization = self.quantization or stored
        if self.quantization is None:
            return
        registry = plugins.get_registry("quantization_methods")
        if not registry.names():
            raise ValueError(
                f"quantization={self.quantization!r}: no quantization method is registered"
                f"{registry.filter_suffix()}"
            )
        if self.quantization not in registry:
            what = (
                f"the checkpoint's quantization_config names quantization method "
                f"{self.quantization!r}, which is not registered"
                if stored
                else f"quantization method {self.quantization!r} is not registered"
            )
            raise ValueError(f"{what}; registered: {', '.join(registry.names())}{registry.filter_suffix()}")
        supported = self.platform_cls.supported_quantization
        if supported and self.quantization not in supported:
            raise ValueError(
                f"platform {self.platform_cls.name!r} does not run quantization "
                f"{self.quantization!r}; it runs: {', '.join(supported)}"
            )
        act_dtypes = registry.load(self.quantization).supported_act_dtypes()
        if self.torch_dtype not in act_dtypes:
            raise ValueError(
                f"quantization {self.quantization!r} computes in "
                f"{', '.join(map(str, act_dtypes))}, not {self.torch_dtype}"
            )
        method = self.quantization_method()
        if self.tensor_parallel_size > 1 and not method.tensor_parallel:
            what = "the checkpoint's quantization" if stored else "quantization"
            raise ValueError(
                f"{what} {self.quantization!r} does not load sharded over tensor-parallel ranks: "
                f"tensor_parallel_size={self.tensor_parallel_size} is not supported with it "
                f"(use tensor_parallel_size=1)"
            )

    def quantization_method(self) -> QuantizationMethod | None:
        """The registered ``quantization`` method built from the checkpoint's
        ``quantization_config`` (None without quantization); raises ``ValueError`` for a
        checkpoint variant the method refuses."""
        if self.quantization is None:
            return None
        from tokenmill import plugins

        method_cls = plugins.get_registry("quantization_methods").load(self.quantization)
        return method_cls.from_config(getattr(self.hf_config, "quantization_config", None) or {})

    def _resolve_dtype(self) -> torch.dtype:
        stored = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
        if isinstance(stored, str):
            stored = DTYPES.get(stored, torch.float32)
        if not isinstance(stored, torch.dtype):
            stored = torch.float32
        if self.dtype == "auto":
            return self.platform_cls.default_dtype(stored)
        dtype = DTYPES[self.dtype]
        if dtype not in self.platform_cls.supported_dtypes:
            raise ValueError(f"dtype {self.dtype} is not supported on platform {self.platform_cls.name!r}")
        return dtype


def _model_max_len(hf_config: Any) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
