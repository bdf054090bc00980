"""Resolving an :class:`~tokenmill.config.EngineConfig` against its model and platform (vLLM's
``create_engine_config``): the checkpoint's HF config, the platform class, the dtype, the
quantization method and the proposer from the registries, the lengths. ``EngineConfig`` itself
only holds and checks values."""

from __future__ import annotations

import os
from typing import Any

import torch

from tokenmill import plugins
from tokenmill.config import DTYPES, EngineConfig
from tokenmill.distributed.parallel_state import check_pp_partition
from tokenmill.default_model import cache_dir, default_model_path, gguf_path
from tokenmill.engine_args import DEFAULT_MAX_NUM_BATCHED_TOKENS, MAX_DEFAULT_MODEL_LEN
from tokenmill.interfaces.quantization import QuantizationMethod
from tokenmill.kv_cache_dtype import kv_cache_torch_dtype
from tokenmill.model_loader.gguf_file import is_gguf_file, metadata_dir
from tokenmill.model_loader.loader import load_hf_config
from tokenmill.plugins import ModelRegistry
from tokenmill.selector import select_platform
from tokenmill.speculative_config import SpeculativeConfig


def resolve_config(config: EngineConfig) -> EngineConfig:
    """Resolve ``config``'s model, platform, dtype, quantization method and lengths (in place;
    returns it); raises on anything unusable, before any worker starts."""
    _resolve_model(config)
    config.hf_config = load_hf_config(config.model_path)
    config.platform_cls = select_platform(config.platform)
    config.torch_dtype = _resolve_dtype(config)
    config.kv_cache_torch_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, config.torch_dtype)
    _check_quantization(config)
    _check_tensor_parallel(config)
    _check_pipeline_parallel(config)
    _check_expert_parallel(config)
    if config.speculative is not None:
        _check_speculative(config, config.speculative)
    if config.kv_transfer is not None:
        _check_kv_connector(config.kv_transfer.kv_connector)
        if config.pipeline_parallel_size > 1:
            raise ValueError(
                "kv_transfer_config with pipeline_parallel_size > 1: a KV connector runs with "
                "one pipeline stage only"
            )
    if config.gpu_memory_utilization is not None and config.platform_cls.device_type == "cpu":
        raise ValueError(
            f"gpu_memory_utilization applies to GPU platforms only; platform "
            f"{config.platform_cls.name!r} sizes the KV cache from kv_cache_memory_bytes or "
            f"num_kv_blocks"
        )

    model_max = _model_max_len(config.hf_config)
    if config.max_model_len is None:
        config.max_model_len = min(model_max, MAX_DEFAULT_MODEL_LEN)
    elif config.max_model_len > model_max:
        raise ValueError(
            f"max_model_len ({config.max_model_len}) is larger than the model's maximum "
            f"({model_max})"
        )
    if config.max_num_batched_tokens is None:
        config.max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS
        if not config.enable_chunked_prefill:
            config.max_num_batched_tokens = max(config.max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS)
    elif not config.enable_chunked_prefill and config.max_num_batched_tokens < config.max_model_len:
        raise ValueError(
            f"without chunked prefill max_num_batched_tokens ({config.max_num_batched_tokens}) "
            f"must be >= max_model_len ({config.max_model_len})"
        )
    config.platform_cls.check_and_update_config(config)
    return config


def _resolve_model(config: EngineConfig) -> None:
    """Set ``model_path`` (the HF config and tokenizer) and ``weights_path``: both the model
    directory, or for a GGUF file (the default model's own with ``quantization="gguf"``) the
    file and a cached directory of its metadata; a GGUF file loads with the gguf method."""
    if config.model is None:
        if config.quantization != "gguf":
            config.model_path = config.weights_path = default_model_path()
            return
        path = str(gguf_path())
    else:
        path = os.path.expanduser(str(config.model))
        if os.path.isdir(path):
            if config.quantization == "gguf":
                raise ValueError(
                    f"quantization='gguf' loads GGUF files; {path!r} is a model directory "
                    f"(pass model='file.gguf', or model=None for the default model's file)"
                )
            config.model_path = config.weights_path = path
            return
        if not is_gguf_file(path):
            what = "is not a GGUF file" if os.path.isfile(path) else "does not exist"
            raise FileNotFoundError(f"model {path!r} {what}: pass a model directory or a GGUF file")
    if config.quantization not in (None, "gguf"):
        raise ValueError(
            f"model {path!r} is a GGUF file, which loads with quantization='gguf', "
            f"not {config.quantization!r}"
        )
    config.quantization = "gguf"
    config.weights_path = path
    config.model_path = metadata_dir(path, cache_dir())


def _check_tensor_parallel(config: EngineConfig) -> None:
    """Each rank must hold whole attention heads (KV heads split evenly, or replicated
    when there are fewer than ranks) and an equal slice of the MLPs."""
    tp = config.tensor_parallel_size
    if tp == 1:
        return
    hf = config.hf_config
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


def _check_kv_connector(name: str) -> None:
    registry = plugins.get_registry("kv_connectors")
    if name not in registry:
        raise ValueError(
            f"kv_transfer_config['kv_connector'] {name!r} is not a registered KV connector; "
            f"registered: {', '.join(registry.names()) or 'none'}{registry.filter_suffix()}"
        )


def _check_pipeline_parallel(config: EngineConfig) -> None:
    """The model must declare pipeline support (``supports_pp``) and have a layer for every
    stage."""
    pp = config.pipeline_parallel_size
    if pp == 1:
        return
    model_cls, arch = ModelRegistry.resolve(getattr(config.hf_config, "architectures", None))
    if not getattr(model_cls, "supports_pp", False):
        raise ValueError(
            f"pipeline_parallel_size={pp}: model {arch} does not support pipeline parallelism "
            f"(its class does not declare supports_pp)"
        )
    check_pp_partition(config.hf_config.num_hidden_layers, pp)


def _check_expert_parallel(config: EngineConfig) -> None:
    """Expert parallelism needs routed experts that split evenly over the expert-parallel
    ranks: a stage's tensor-parallel ranks, times the data-parallel engine cores when there
    are several."""
    if not config.enable_expert_parallel:
        return
    experts = getattr(config.hf_config, "n_routed_experts", None)
    if not experts:
        raise ValueError(
            "enable_expert_parallel: the model has no routed experts (n_routed_experts) to shard"
        )
    ep_size = config.tensor_parallel_size * config.data_parallel_size
    if experts % ep_size:
        raise ValueError(
            f"enable_expert_parallel: the model's {experts} routed experts are not divisible by "
            f"the expert-parallel size {ep_size} (tensor_parallel_size="
            f"{config.tensor_parallel_size} x data_parallel_size={config.data_parallel_size})"
        )


def _check_speculative(config: EngineConfig, spec: SpeculativeConfig) -> None:
    """The method must be a registered proposer; a draft model must share the target's
    vocabulary; ``mtp`` runs the target checkpoint's own MTP layers."""
    registry = plugins.get_registry("proposers")
    if spec.method not in registry:
        raise ValueError(
            f"speculative_config['method'] {spec.method!r} is not a registered proposer; "
            f"registered: {', '.join(registry.names()) or 'none'}{registry.filter_suffix()}"
        )
    if spec.method == "mtp":
        if spec.model is not None and os.path.realpath(spec.model) != os.path.realpath(config.model_path):
            raise ValueError(
                f"speculative_config['model'] {spec.model!r}: method 'mtp' runs the MTP "
                f"layers of the target checkpoint {config.model_path!r}; leave 'model' out"
            )
        if not getattr(config.hf_config, "num_nextn_predict_layers", 0):
            raise ValueError(
                "speculative_config['method'] 'mtp' needs a target with MTP layers "
                "(num_nextn_predict_layers > 0 in its config.json)"
            )
        config.draft_hf_config = config.hf_config
        return
    if spec.model is not None:
        config.draft_hf_config = load_hf_config(spec.model)
        draft_vocab = config.draft_hf_config.vocab_size
        if draft_vocab != config.hf_config.vocab_size:
            raise ValueError(
                f"speculative_config['model'] {spec.model!r} has a vocabulary of "
                f"{draft_vocab} tokens, the target {config.hf_config.vocab_size}: a draft "
                f"model must share the target's tokenizer"
            )


def _check_quantization(config: EngineConfig) -> None:
    """Take the checkpoint's ``quant_method`` when ``quantization`` is None, then refuse a
    method that is not registered, that the platform does not run (its
    ``supported_quantization``, when not empty), that does not compute in the dtype, that
    refuses the checkpoint, or that does not load with tensor parallelism when asked to."""
    checkpoint = getattr(config.hf_config, "quantization_config", None) or {}
    stored = checkpoint.get("quant_method")
    if config.quantization is not None and stored is not None and config.quantization != stored:
        raise ValueError(
            f"the checkpoint is quantized with {stored!r}; quantization={config.quantization!r} "
            f"cannot load it (leave quantization unset or pass {stored!r})"
        )
    config.quantization = config.quantization or stored
    if config.quantization is None:
        return
    registry = plugins.get_registry("quantization_methods")
    if not registry.names():
        raise ValueError(
            f"quantization={config.quantization!r}: no quantization method is registered"
            f"{registry.filter_suffix()}"
        )
    if config.quantization not in registry:
        what = (
            f"the checkpoint's quantization_config names quantization method "
            f"{config.quantization!r}, which is not registered"
            if stored
            else f"quantization method {config.quantization!r} is not registered"
        )
        raise ValueError(f"{what}; registered: {', '.join(registry.names())}{registry.filter_suffix()}")
    supported = config.platform_cls.supported_quantization
    if supported and config.quantization not in supported:
        raise ValueError(
            f"platform {config.platform_cls.name!r} does not run quantization "
            f"{config.quantization!r}; it runs: {', '.join(supported)}"
        )
    act_dtypes = registry.load(config.quantization).supported_act_dtypes()
    if config.torch_dtype not in act_dtypes:
        raise ValueError(
            f"quantization {config.quantization!r} computes in "
            f"{', '.join(map(str, act_dtypes))}, not {config.torch_dtype}"
        )
    method = quantization_method(config)
    if config.tensor_parallel_size > 1 and not method.tensor_parallel:
        what = "the checkpoint's quantization" if stored else "quantization"
        raise ValueError(
            f"{what} {config.quantization!r} does not load sharded over tensor-parallel ranks: "
            f"tensor_parallel_size={config.tensor_parallel_size} is not supported with it "
            f"(use tensor_parallel_size=1)"
        )


def quantization_method(config: EngineConfig) -> QuantizationMethod | None:
    """The registered ``quantization`` method built from the checkpoint's
    ``quantization_config`` (None without quantization); raises ``ValueError`` for a
    checkpoint variant the method refuses."""
    if config.quantization is None:
        return None
    method_cls = plugins.get_registry("quantization_methods").load(config.quantization)
    return method_cls.from_config(getattr(config.hf_config, "quantization_config", None) or {})


def _resolve_dtype(config: EngineConfig) -> torch.dtype:
    stored = getattr(config.hf_config, "dtype", None) or getattr(config.hf_config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = DTYPES.get(stored, torch.float32)
    if not isinstance(stored, torch.dtype):
        stored = torch.float32
    if config.dtype == "auto":
        return config.platform_cls.default_dtype(stored)
    dtype = DTYPES[config.dtype]
    if dtype not in config.platform_cls.supported_dtypes:
        raise ValueError(f"dtype {config.dtype} is not supported on platform {config.platform_cls.name!r}")
    return dtype


def _model_max_len(hf_config: Any) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048
