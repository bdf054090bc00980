"""Tiny random DeepSeek-V2/V3 checkpoints written by transformers (shared by the DeepSeek
tests)."""

from __future__ import annotations

import torch
import transformers
from safetensors.torch import load_file, save_file

from tokenmill.testing.checkpoints import TINY_CONFIG

COMMON = dict(
    TINY_CONFIG,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=1024,
)

CONFIGS = {
    # V2-Lite-like: softmax top-k, no q_lora, every layer MoE, shared experts, plain RoPE.
    "v2": (
        "DeepseekV2",
        dict(
            q_lora_rank=None,
            n_shared_experts=2,
            first_k_dense_replace=0,
            topk_method="greedy",
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
        ),
    ),
    # V3-like: sigmoid grouped top-k with correction bias, q_lora, YaRN with mscale, one dense
    # first layer, shared expert, untied head.
    "v3": (
        "DeepseekV3",
        dict(
            q_lora_rank=24,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 256,
                "mscale": 0.9,
                "mscale_all_dim": 1.0,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        ),
    ),
}


def make_deepseek(version: str, **overrides) -> transformers.PreTrainedModel:
    """A float32 random HF DeepSeek model of ``version`` ("v2" or "v3"); V3's router bias is
    random so that it changes the choice."""
    prefix, extra = CONFIGS[version]
    config = getattr(transformers, f"{prefix}Config")(**{**COMMON, **extra, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).to(torch.float32).eval()
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.normal_(std=0.1)
    return model


def save_deepseek(path, version: str, **overrides) -> tuple[str, transformers.PreTrainedModel]:
    """Save :func:`make_deepseek`'s model under ``path``; returns the dir and the model."""
    model = make_deepseek(version, **overrides)
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path), model


def write_mtp_checkpoint(path):
    """A tiny V3 checkpoint plus random MTP weights at layer ``num_hidden_layers``; returns
    the HF model and the MTP block as a transformers decoder layer holding the same weights,
    and the MTP layer's extra tensors."""
    hf = make_deepseek("v3")
    hf.save_pretrained(str(path), safe_serialization=True)
    config = hf.config
    k = config.num_hidden_layers
    config._attn_implementation = "sdpa"
    torch.manual_seed(1)
    block = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer(config, k).float().eval()
    for name, p in block.named_parameters():
        p.data.normal_(std=0.2) if "norm" not in name else p.data.uniform_(0.5, 1.5)
    block.mlp.gate.e_score_correction_bias.normal_(std=0.1)
    h = config.hidden_size
    extra = {
        "enorm.weight": torch.rand(h) + 0.5,
        "hnorm.weight": torch.rand(h) + 0.5,
        "eh_proj.weight": torch.randn(h, 2 * h) * 0.1,
        "shared_head.norm.weight": torch.rand(h) + 0.5,
        "shared_head.head.weight": torch.randn(config.vocab_size, h) * 0.2,
        "embed_tokens.weight": hf.model.embed_tokens.weight.detach().clone(),
    }
    # transformers holds experts stacked; DeepSeek checkpoints name them one by one
    tensors = {}
    for name, tensor in block.state_dict().items():
        if name == "mlp.experts.gate_up_proj":
            for e in range(tensor.shape[0]):
                gate, up = tensor[e].chunk(2)
                tensors[f"mlp.experts.{e}.gate_proj.weight"] = gate
                tensors[f"mlp.experts.{e}.up_proj.weight"] = up
        elif name == "mlp.experts.down_proj":
            for e in range(tensor.shape[0]):
                tensors[f"mlp.experts.{e}.down_proj.weight"] = tensor[e]
        else:
            tensors[name] = tensor
    tensors.update(extra)
    weights = load_file(str(path / "model.safetensors"))
    weights.update({f"model.layers.{k}.{n}": t.contiguous() for n, t in tensors.items()})
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return hf, block, extra
