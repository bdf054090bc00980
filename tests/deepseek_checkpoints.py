"""Tiny random DeepSeek-V2/V3 checkpoints written by transformers (shared by the DeepSeek
tests)."""

from __future__ import annotations

import torch
import transformers

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=1024,
    initializer_range=0.2,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
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
