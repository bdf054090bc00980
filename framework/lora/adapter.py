"""Reading a PEFT LoRA checkpoint (``adapter_config.json`` + ``adapter_model.safetensors``) and
checking it against the base model: everything is checked before anything is kept, so an
adapter is refused whole (``ValueError`` naming the adapter and the field or tensor) or loaded
whole."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from tokenmill.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
"""The Llama-family projections an adapter may target (as PEFT names them)."""

_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])\.weight$")
_MODULE = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)$")
_REFUSED_FLAGS = (
    ("use_dora", "DoRA adapters are not supported"),
    ("fan_in_fan_out", "fan_in_fan_out adapters are not supported"),
)
_REFUSED_NONEMPTY = (
    ("modules_to_save", "fully trained modules (modules_to_save) are not supported"),
    ("rank_pattern", "per-module ranks (rank_pattern) are not supported"),
    ("alpha_pattern", "per-module alphas (alpha_pattern) are not supported"),
    ("layer_replication", "layer_replication is not supported"),
)


@dataclass
class LoRAWeights:
    """An adapter read into memory: per PEFT module path (``model.layers.3.self_attn.q_proj``)
    its ``A`` ``[r, in]`` and its ``B`` ``[out, r]`` with the scaling folded in (float32)."""

    request: LoRARequest
    rank: int
    scaling: float
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]


def module_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each supported projection of the base model."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def read_adapter_config(request: LoRARequest, max_lora_rank: int) -> tuple[int, float]:
    """The adapter's rank and scaling (``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with
    rsLoRA) from its ``adapter_config.json``; ``ValueError`` for what is not supported."""
    name = request.lora_name
    path = Path(request.lora_path) / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {request.lora_path!r}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type is {peft_type!r}; only LORA is supported")
    for field, why in _REFUSED_FLAGS:
        if config.get(field):
            raise ValueError(f"LoRA adapter {name!r}: {field}=true: {why}")
    for field, why in _REFUSED_NONEMPTY:
        if config.get(field):
            raise ValueError(f"LoRA adapter {name!r}: {field}={config[field]!r}: {why}")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: bias={config['bias']!r}: only bias='none' is supported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {name!r}: r={rank} is above max_lora_rank={max_lora_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"LoRA adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scaling


def load_adapter(request: LoRARequest, hf_config: Any, max_lora_rank: int) -> LoRAWeights:
    """Read and check ``request``'s adapter against the base model of ``hf_config``."""
    name = request.lora_name
    rank, scaling = read_adapter_config(request, max_lora_rank)
    path = Path(request.lora_path) / WEIGHTS_FILE
    if not path.is_file():
        raise ValueError(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {request.lora_path!r}")
    try:
        tensors = load_file(str(path))
    except Exception as e:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {path}: {e}") from None
    shapes = module_shapes(hf_config)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, which = _module_of(name, key, hf_config.num_hidden_layers)
        parts.setdefault(module, {})[which] = tensor
    if not parts:
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    modules = {}
    for module, pair in parts.items():
        if set(pair) != {"A", "B"}:
            missing = "B" if "A" in pair else "A"
            raise ValueError(f"LoRA adapter {name!r}: {module} has no lora_{missing} weight")
        in_features, out_features = shapes[module.rsplit(".", 1)[1]]
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise ValueError(
                f"LoRA adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}; r={rank} on this model needs ({rank}, {in_features}) and "
                f"({out_features}, {rank})"
            )
        modules[module] = (a.float().contiguous(), (b.float() * scaling).contiguous())
    return LoRAWeights(request, rank, scaling, modules)


def _module_of(name: str, key: str, num_layers: int) -> tuple[str, str]:
    """The PEFT module path and ``"A"``/``"B"`` of a checkpoint key; ``ValueError`` for keys of
    modules the base model lacks or that are not supported."""
    match = _KEY.match(key)
    if match is None:
        if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
            raise ValueError(
                f"LoRA adapter {name!r}: {key}: adapters on the embeddings or the LM head are "
                f"not supported"
            )
        raise ValueError(f"LoRA adapter {name!r}: {key} is not a LoRA weight this engine loads")
    module, which = match.groups()
    found = _MODULE.match(module)
    if found is None:
        if "embed_tokens" in module or "lm_head" in module:
            raise ValueError(
                f"LoRA adapter {name!r}: {key}: adapters on the embeddings or the LM head are "
                f"not supported"
            )
        raise ValueError(
            f"LoRA adapter {name!r}: {key}: the base model has no module {module!r} an adapter "
            f"can target (supported: {', '.join(SUPPORTED_MODULES)})"
        )
    layer, block, proj = int(found[1]), found[2], found[3]
    expected = ATTENTION_MODULES if block == "self_attn" else MLP_MODULES
    if proj not in expected or layer >= num_layers:
        raise ValueError(
            f"LoRA adapter {name!r}: {key}: the base model has no module {module!r} "
            f"({num_layers} layers; {block} holds {', '.join(expected)})"
        )
    return module, which
