"""DeepSeek-V2 and V3 for tokenmill, after vLLM's ``deepseek_v2.py``: multi-head latent
attention over a latent KV cache and mixture-of-experts MLPs.

Checkpoints load as transformers writes them (per-expert ``mlp.experts.{e}.*_proj`` tensors
stacked into :class:`FusedMoE`'s weights) and as DeepSeek ships them (the same names; V3's
multi-token-prediction layers at index ``num_hidden_layers`` are skipped here and served by
:mod:`tokenmill.models.deepseek_mtp`).
"""

from __future__ import annotations

import copy
import re
from collections import defaultdict
from collections.abc import Iterable
from functools import partial
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.parallel_state import (
    get_tensor_model_parallel_world_size,
    is_first_pp_rank,
    is_last_pp_rank,
)
from tokenmill.layers.fused_moe import FusedMoE
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from tokenmill.layers.mla_attention import MLAAttention
from tokenmill.layers.pipeline import (
    IntermediateTensors,
    PPMissingLayer,
    make_layers,
    missing_prefixes,
)
from tokenmill.layers.rotary_embedding import get_rope, rope_config, yarn_get_mscale
from tokenmill.layers.vocab_embedding import VocabParallelEmbedding
from tokenmill.model_loader.weights import default_weight_loader, find_param
from tokenmill.layers.kv_cache_quant import load_kv_scale
from tokenmill.models.llama import (
    CausalLM,
    LlamaMLP,
    PreNormDecoderLayer,
    maybe_prefix,
    stage_weight_name,
)


def softmax_scale(config: Any) -> float:
    """``qk_head_dim**-0.5``, times ``mscale(factor, mscale_all_dim)²`` under YaRN scaling."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    _, scaling = rope_config(config)
    if scaling is not None:
        mscale_all_dim = scaling.get("mscale_all_dim") or 0
        if mscale_all_dim:
            mscale = yarn_get_mscale(scaling["factor"], mscale_all_dim)
            scale *= mscale * mscale
    return scale


def rope_is_interleaved(config: Any) -> bool:
    """DeepSeek rotates interleaved pairs (V2 always; V3 unless ``rope_interleave`` is off)."""
    return config.model_type == "deepseek_v2" or bool(getattr(config, "rope_interleave", True))


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    """Layers from ``first_k_dense_replace`` on are MoE, every ``moe_layer_freq``-th."""
    return (
        getattr(config, "n_routed_experts", None) is not None
        and layer_idx >= config.first_k_dense_replace
        and layer_idx % getattr(config, "moe_layer_freq", 1) == 0
    )


class DeepseekV2MLAAttention(nn.Module):
    """Query (direct or through the ``q_lora_rank`` bottleneck), the joint latent
    ``kv_a_proj_with_mqa`` → ``kv_c`` (normalised) + ``k_pe`` (rotated), MLA over the latent
    cache, then ``o_proj``. Under tensor parallelism each rank holds its share of the heads
    (query, ``kv_b_proj`` and ``o_proj`` rows split by head) and the whole latent."""

    def __init__(self, config: Any, prefix: str = "") -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        self.num_heads = total_heads // get_tensor_model_parallel_world_size()
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        bias = bool(getattr(config, "attention_bias", False))
        q_out = total_heads * self.qk_head_dim
        if self.q_lora_rank is not None:
            self.q_a_proj = ReplicatedLinear(
                hidden, self.q_lora_rank, bias=bias, prefix=f"{prefix}.q_a_proj"
            )
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(
                self.q_lora_rank, q_out, bias=False, prefix=f"{prefix}.q_b_proj"
            )
        else:
            self.q_proj = ColumnParallelLinear(
                hidden, q_out, bias=False, prefix=f"{prefix}.q_proj"
            )
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias,
            prefix=f"{prefix}.kv_a_proj_with_mqa",
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, total_heads * (self.qk_nope_head_dim + self.v_head_dim),
            bias=False, prefix=f"{prefix}.kv_b_proj",
        )
        self.o_proj = RowParallelLinear(
            total_heads * self.v_head_dim, hidden, bias=bias, prefix=f"{prefix}.o_proj"
        )
        rope_theta, rope_scaling = rope_config(config)
        self.rotary_emb = get_rope(
            self.qk_rope_head_dim,
            self.qk_rope_head_dim,
            config.max_position_embeddings,
            rope_theta,
            rope_scaling,
            is_neox_style=not rope_is_interleaved(config),
        )
        self.mla_attn = MLAAttention(
            self.num_heads,
            softmax_scale(config),
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
            self.kv_lora_rank,
            self.kv_b_proj,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        else:
            q = self.q_proj(hidden_states)
        q = q.view(-1, self.num_heads, self.qk_head_dim)
        latent = self.kv_a_proj_with_mqa(hidden_states)
        kv_c, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c.contiguous())
        q_pe, k_pe = self.rotary_emb(
            positions,
            q[..., self.qk_nope_head_dim :].reshape(q.shape[0], -1),
            k_pe.contiguous(),
        )
        q_pe = q_pe.view(q.shape[0], self.num_heads, -1)
        q = torch.cat((q[..., : self.qk_nope_head_dim], q_pe), dim=-1)
        return self.o_proj(self.mla_attn(q.reshape(q.shape[0], -1), kv_c, k_pe))


class DeepseekV2MoE(nn.Module):
    """Router (float32 logits), routed experts in :class:`FusedMoE` and the shared experts.
    V2 scores with softmax (group-limited when ``topk_method`` says so); V3 with sigmoid,
    ``e_score_correction_bias`` and groups; a config's ``scoring_func``/``topk_method``
    (DeepSeek's own names) override the defaults."""

    def __init__(self, config: Any, prefix: str = "", *, v3: bool) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(
                f"{prefix}: unsupported hidden_act {config.hidden_act!r}; only silu is"
            )
        scoring = getattr(config, "scoring_func", None) or ("sigmoid" if v3 else "softmax")
        topk_method = getattr(config, "topk_method", None) or ("noaux_tc" if v3 else "greedy")
        grouped = topk_method in ("group_limited_greedy", "noaux_tc")
        self.gate = ReplicatedLinear(
            config.hidden_size, config.n_routed_experts, bias=False, prefix=f"{prefix}.gate", quantize=False
        )
        shared = None
        if getattr(config, "n_shared_experts", None):
            shared = LlamaMLP(
                config.hidden_size,
                config.moe_intermediate_size * config.n_shared_experts,
                config.hidden_act,
                prefix=f"{prefix}.shared_experts",
                reduce_results=False,
            )
        self.experts = FusedMoE(
            config.n_routed_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            scoring_func=scoring,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            num_expert_group=config.n_group if grouped else None,
            topk_group=config.topk_group if grouped else None,
            use_correction_bias=topk_method == "noaux_tc",
            routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0)),
            shared_experts=shared,
            prefix=f"{prefix}.experts",
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits = F.linear(hidden_states.float(), self.gate.weight.float())
        return self.experts(hidden_states, router_logits)


class DeepseekV2DecoderLayer(PreNormDecoderLayer):
    """Pre-norm MLA + (MoE or dense SwiGLU) block."""

    def __init__(self, config: Any, prefix: str = "", *, layer_idx: int, v3: bool) -> None:
        super().__init__()
        self.self_attn = DeepseekV2MLAAttention(config, prefix=f"{prefix}.self_attn")
        if is_moe_layer(config, layer_idx):
            self.mlp: nn.Module = DeepseekV2MoE(config, prefix=f"{prefix}.mlp", v3=v3)
        else:
            self.mlp = LlamaMLP(
                config.hidden_size,
                config.intermediate_size,
                config.hidden_act,
                prefix=f"{prefix}.mlp",
            )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV2Model(nn.Module):
    """Embedding, decoder stack and final norm; under pipeline parallelism, this stage's
    part of them (the embedding on the first stage, the norm on the last)."""

    def __init__(self, config: Any, prefix: str = "", *, v3: bool) -> None:
        super().__init__()
        self.embed_tokens: nn.Module = PPMissingLayer()
        if is_first_pp_rank():
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "embed_tokens")
            )
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda i: DeepseekV2DecoderLayer(
                config, prefix=maybe_prefix(prefix, f"layers.{i}"), layer_idx=i, v3=v3
            ),
        )
        self.norm: nn.Module = PPMissingLayer()
        if is_last_pp_rank():
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if intermediate_tensors is None:
            hidden_states, residual = self.embed_tokens(input_ids), None
        else:
            hidden_states, residual = intermediate_tensors.hidden_states, intermediate_tensors.residual
        for idx in range(self.start_layer, self.end_layer):
            hidden_states, residual = self.layers[idx](positions, hidden_states, residual)
        if not is_last_pp_rank():
            return IntermediateTensors(hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


MTP_ARCHITECTURE = "DeepSeekMTPModel"
"""The architecture of the MTP layers as a model of their own (``models/deepseek_mtp.py``)."""

def mtp_hf_config(hf_config: Any) -> Any:
    """A copy of a DeepSeek-V3 config whose architecture is the MTP model."""
    if not getattr(hf_config, "num_nextn_predict_layers", 0):
        raise ValueError("the checkpoint has no MTP layers (num_nextn_predict_layers is 0)")
    config = copy.deepcopy(hf_config)
    config.architectures = [MTP_ARCHITECTURE]
    return config


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
_ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")
_GATE_UP_MAPPING = ((".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))


def load_deepseek_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], num_experts: int,
    skip: Any = None,
) -> set[str]:
    """Load HF/DeepSeek-named tensors into ``model``: gate/up into ``gate_up_proj``, per-expert
    projections stacked into the experts' ``w13_weight``/``w2_weight``, the router's
    correction bias and the shared experts into their :class:`FusedMoE`. ``skip(name)`` drops
    names this module does not own. Returns the fully loaded parameter names."""
    params = dict(model.named_parameters())
    expert_mapping = FusedMoE.make_expert_params_mapping(num_experts)
    seen: dict[str, set] = defaultdict(set)
    loaded: set[str] = set()

    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name or (skip is not None and skip(name)):
            continue
        if load_kv_scale(model, name, tensor):
            continue
        if name.endswith("mlp.gate.e_score_correction_bias"):
            name = name.replace("mlp.gate.", "mlp.experts.")
        name = name.replace("mlp.shared_experts.", "mlp.experts.shared_experts.")
        for fused, original, shard in _GATE_UP_MAPPING:
            if original in name and not _ROUTED_EXPERT.search(name):
                name = name.replace(original, fused)
                p = find_param(model, params, name, tensor)
                if p is None:
                    break
                p.weight_loader(p, tensor, shard)
                seen[name].add(shard)
                if len(seen[name]) == 2:
                    loaded.add(name)
                break
        else:
            for param_prefix, ckpt_prefix, expert, shard in expert_mapping:
                if ckpt_prefix in name:
                    name = name.replace(ckpt_prefix, param_prefix)
                    p = find_param(model, params, name, tensor)
                    if p is None:
                        break
                    p.weight_loader(p, tensor, expert, shard)
                    seen[name].add((expert, shard))
                    if len(seen[name]) == num_experts * (2 if param_prefix.endswith("w13_") else 1):
                        loaded.add(name)
                    break
            else:
                p = find_param(model, params, name, tensor)
                if p is None:
                    continue
                getattr(p, "weight_loader", partial(default_weight_loader, name=name))(p, tensor)
                loaded.add(name)
    return loaded


class DeepseekV2ForCausalLM(CausalLM):
    """DeepSeek-V2 (softmax routing)."""

    is_v3: ClassVar[bool] = False

    def __init__(self, config: Any, prefix: str = "") -> None:
        model = DeepseekV2Model(config, prefix=maybe_prefix(prefix, "model"), v3=self.is_v3)
        super().__init__(config, model, prefix)

    def mtp_config(self) -> Any:
        """``SupportsMTP``: :func:`mtp_hf_config` of this model's config."""
        return mtp_hf_config(self.config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the decoder stack; MTP layers (index ≥ ``num_hidden_layers``) are skipped."""
        num_layers = self.config.num_hidden_layers
        other_stages = missing_prefixes(self)
        tied_here = self.tie_word_embeddings and not isinstance(self.model.embed_tokens, PPMissingLayer)

        def skip(name: str) -> bool:
            match = _LAYER_INDEX.match(name)
            if match is not None and int(match.group(1)) >= num_layers:
                return True
            return tied_here and name.startswith("lm_head.")

        stage_weights = (
            (stage_name, tensor)
            for name, tensor in weights
            if (stage_name := stage_weight_name(self, name, other_stages)) is not None
        )
        return load_deepseek_weights(
            self, stage_weights, getattr(self.config, "n_routed_experts", None) or 0, skip
        )


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3: sigmoid routing with ``e_score_correction_bias`` and group-limited top-k."""

    is_v3 = True
