"""Building a registered model from a HF checkpoint directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from tokenmill.plugins import ModelRegistry
from tokenmill.layers.build_context import BuildContext, model_build_context
from tokenmill.model_loader.gguf_file import is_gguf_file, iter_gguf_weights
from tokenmill.model_loader.weights import iter_weights


def load_hf_config(model_dir: str | Path) -> PretrainedConfig:
    """The checkpoint's ``config.json`` as a transformers config."""
    root = Path(model_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist")
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} has no config.json")
    return AutoConfig.from_pretrained(root)


def load_generation_config(model_dir: str | Path, hf_config: PretrainedConfig) -> dict[str, Any]:
    """The checkpoint's ``generation_config.json``; without one, the ``eos_token_id`` of
    ``config.json`` (as transformers and vLLM fall back)."""
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        return json.loads(path.read_text())
    eos = getattr(hf_config, "eos_token_id", None)
    return {} if eos is None else {"eos_token_id": eos}


def load_model(
    model_dir: str | Path,
    hf_config: PretrainedConfig,
    build_ctx: BuildContext,
    device: torch.device | str,
) -> nn.Module:
    """Build the registered class for ``hf_config.architectures`` on ``device`` in
    ``build_ctx.dtype``, load the checkpoint (``model_dir``, or a GGUF file for the ``gguf``
    method) into it and return it in eval mode.

    A model whose ``load_weights`` returns the set of parameter names it loaded is checked
    for parameters the checkpoint left uninitialised. Then every module that has a
    ``process_weights_after_loading()`` method gets it called (linear layers and LM heads hand
    it to their linear method, MoE layers to their MoE method: repacking, quantizing).
    """
    model_cls, arch = ModelRegistry.resolve(getattr(hf_config, "architectures", None))
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(build_ctx.dtype)
    try:
        with model_build_context(build_ctx), torch.device(device):
            model = model_cls(hf_config, prefix="")
    finally:
        torch.set_default_dtype(previous_dtype)

    # Quantization methods get checkpoint tensors as stored (scales keep their precision).
    dtype = build_ctx.dtype if build_ctx.quant_method is None else None
    if is_gguf_file(model_dir):
        weights = iter_gguf_weights(model_dir, use_tqdm=True)
    else:
        weights = iter_weights(model_dir, dtype, use_tqdm=True)
    with torch.no_grad():
        loaded = model.load_weights(weights)
        if isinstance(loaded, set):
            missing = sorted(set(dict(model.named_parameters())) - loaded)
            if missing:
                raise ValueError(f"{arch} checkpoint in {model_dir} lacks weights: {missing}")
        for module in model.modules():
            if callable(hook := getattr(module, "process_weights_after_loading", None)):
                hook()
    return model.eval()


def decode_weight_bytes(model: nn.Module) -> int:
    """The bytes of weights one decode token reads: every parameter as loaded (quantized ones
    at their packed size), a tensor shared by two modules once; an input embedding table not
    shared with the LM head reads one row, counted as none; buffers such as RoPE tables are
    read a row at a time, counted as none."""
    seen = {p.data_ptr(): p.nbytes for p in model.parameters()}
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) or name.endswith("embed_tokens"):
            weight = getattr(module, "weight", None)
            if weight is not None and (head is None or head.data_ptr() != weight.data_ptr()):
                seen.pop(weight.data_ptr(), None)
    return sum(seen.values())
