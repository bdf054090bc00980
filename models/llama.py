"""Llama (and Mistral) for tokenmill, after vLLM's ``llama.py``.

The model runs on a flat batch: ``input_ids`` and ``positions`` are [T] for all scheduled
tokens of all requests; attention finds its paging data in the forward context.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from functools import partial
from typing import Any, ClassVar

import torch
from torch import nn

from tokenmill.distributed.parallel_state import (
    get_tensor_model_parallel_world_size,
    is_first_pp_rank,
    is_last_pp_rank,
)
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.attention import Attention
from tokenmill.layers.layernorm import ResidualSum, RMSNorm
from tokenmill.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tokenmill.layers.pipeline import (
    IntermediateTensors,
    PPMissingLayer,
    make_layers,
    missing_prefixes,
)
from tokenmill.layers.rotary_embedding import get_rope, rope_config
from tokenmill.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.model_loader.weights import default_weight_loader, find_param
from tokenmill.layers.kv_cache_quant import load_kv_scale


def maybe_prefix(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` at the root."""
    return f"{prefix}.{name}" if prefix else name


class LlamaMLP(nn.Module):
    """SwiGLU MLP with gate and up fused into one GEMM. ``reduce_results=False`` leaves each
    tensor-parallel rank's partial sum for the caller to all-reduce."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        bias: bool = False,
        prefix: str = "",
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"{prefix}: unsupported hidden_act {hidden_act!r}; only silu is")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias=bias,
            reduce_results=reduce_results,
            prefix=f"{prefix}.down_proj",
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with a fused QKV projection and RoPE."""

    def __init__(
        self,
        config: Any,
        qkv_bias: bool = False,
        o_proj_bias: bool = False,
        prefix: str = "",
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        hidden_size = config.hidden_size
        total_num_heads = config.num_attention_heads
        total_num_kv_heads = getattr(config, "num_key_value_heads", None) or total_num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden_size // total_num_heads
        self.num_heads = total_num_heads // tp_size
        self.num_kv_heads = max(1, total_num_kv_heads // tp_size)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim

        self.qkv_proj = QKVParallelLinear(
            hidden_size,
            self.head_dim,
            total_num_heads,
            total_num_kv_heads,
            bias=qkv_bias,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            total_num_heads * self.head_dim,
            hidden_size,
            bias=o_proj_bias,
            prefix=f"{prefix}.o_proj",
        )
        rope_theta, rope_scaling = rope_config(config)
        self.rotary_emb = get_rope(
            self.head_dim,
            self.head_dim,
            config.max_position_embeddings,
            rope_theta,
            rope_scaling,
        )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            prefix=f"{prefix}.attn",
            sliding_window=sliding_window,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        # split_with_sizes skips Tensor.split's Python wrapper, as costly as the split itself.
        q, k, v = qkv.split_with_sizes([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class PreNormDecoderLayer(nn.Module):
    """Pre-norm attention + MLP block; the residual stream is carried through the fused add in
    each RMSNorm. Subclasses build ``self_attn`` (``(positions, hidden) -> hidden``), ``mlp``,
    ``input_layernorm`` and ``post_attention_layernorm``."""

    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaDecoderLayer(PreNormDecoderLayer):
    """Llama's decoder block: QKV attention and the SwiGLU MLP."""

    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        """Whether the QKV and output projections have biases."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    @staticmethod
    def sliding_window(config: Any, layer_idx: int) -> int | None:
        """The window of layer ``layer_idx``'s attention, None for full attention: Mistral's
        ``sliding_window`` applies to every layer, as in HF (Llama configs have none)."""
        return getattr(config, "sliding_window", None)

    def __init__(self, config: Any, prefix: str = "", *, layer_idx: int) -> None:
        super().__init__()
        qkv_bias, o_proj_bias = self.attention_biases(config)
        self.self_attn = LlamaAttention(
            config,
            qkv_bias,
            o_proj_bias,
            prefix=f"{prefix}.self_attn",
            sliding_window=self.sliding_window(config, layer_idx),
        )
        self.mlp = LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            bias=bool(getattr(config, "mlp_bias", False)),
            prefix=f"{prefix}.mlp",
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    """Embedding, decoder stack and final norm; under pipeline parallelism, this stage's
    part of them (the embedding on the first stage, the norm on the last)."""

    def __init__(
        self,
        config: Any,
        prefix: str = "",
        layer_type: type[LlamaDecoderLayer] = LlamaDecoderLayer,
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens: nn.Module = PPMissingLayer()
        if is_first_pp_rank():
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "embed_tokens")
            )
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda i: layer_type(config, prefix=maybe_prefix(prefix, f"layers.{i}"), layer_idx=i),
        )
        self.norm: nn.Module = PPMissingLayer()
        if is_last_pp_rank():
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.residual_sum = ResidualSum()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | IntermediateTensors:
        """Final normalised hidden states; with ``aux_hidden_state_layers`` set, also the
        residual stream entering each of those layers, concatenated ([T, n·hidden]). A stage
        after the first starts from ``intermediate_tensors``; a stage before the last returns
        its residual stream instead."""
        if intermediate_tensors is None:
            hidden_states, residual = self.embed_tokens(input_ids), None
        else:
            hidden_states, residual = intermediate_tensors.hidden_states, intermediate_tensors.residual
        aux_layers = self.aux_hidden_state_layers
        size = hidden_states.shape[-1]
        aux = hidden_states.new_empty(hidden_states.shape[0], len(aux_layers) * size) if aux_layers else None
        for idx in range(self.start_layer, self.end_layer):
            for slot, aux_idx in enumerate(aux_layers):
                if aux_idx == idx:
                    self.residual_sum(hidden_states, residual, aux[:, slot * size : (slot + 1) * size])
            hidden_states, residual = self.layers[idx](positions, hidden_states, residual)
        if not is_last_pp_rank():
            return IntermediateTensors(hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states if aux is None else (hidden_states, aux)


def stage_weight_name(model: nn.Module, name: str, skip: tuple[str, ...]) -> str | None:
    """The name checkpoint weight ``name`` loads under in ``model`` on this pipeline stage,
    None when another stage holds it (under a ``skip`` prefix): a tied LM head without the
    embedding on its stage loads the embedding's weight."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if (
        getattr(model, "tie_word_embeddings", False)
        and name == "model.embed_tokens.weight"
        and isinstance(embed, PPMissingLayer)
        and not isinstance(getattr(model, "lm_head", None), PPMissingLayer)
    ):
        return "lm_head.weight"
    return None if name.startswith(skip) else name


class CausalLM(nn.Module):
    """A decoder stack ``model`` (with ``embed_tokens``) under an LM head, tied to the
    embedding when the config says so: ``forward`` returns the stack's last-layer hidden
    states [T, hidden]; ``compute_logits`` turns the rows the sampler needs into float32
    logits. Under pipeline parallelism only the last stage holds the LM head; a tied head on
    a stage without the embedding loads the embedding's checkpoint weight itself."""

    supports_pp: ClassVar[bool] = True
    """The stack runs split into pipeline stages (``tokenmill.layers.pipeline``)."""

    def __init__(self, config: Any, model: nn.Module, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head: nn.Module = PPMissingLayer()
        if is_last_pp_rank():
            self.lm_head = ParallelLMHead(
                config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head")
            )
            if self.tie_word_embeddings and is_first_pp_rank():
                self.lm_head.tie_weights(self.model.embed_tokens)

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> Any:
        return self.model(input_ids, positions, intermediate_tensors)


    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)


class LlamaForCausalLM(CausalLM):
    """Llama causal LM; with ``set_aux_hidden_state_layers``, ``forward`` also returns the
    residual stream EAGLE-3 heads read."""

    layer_type: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer

    stacked_params_mapping: ClassVar[list[tuple[str, str, str | int]]] = [
        # (fused parameter, checkpoint name, shard id)
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    def __init__(self, config: Any, prefix: str = "") -> None:
        model = LlamaModel(config, prefix=maybe_prefix(prefix, "model"), layer_type=self.layer_type)
        super().__init__(config, model, prefix)

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        """Make ``forward`` also return the residual stream entering ``layers`` (what an
        EAGLE-3 head reads)."""
        n = len(self.model.layers)
        if not all(0 <= i < n for i in layers):
            raise ValueError(f"auxiliary hidden-state layers {layers} out of range for {n} layers")
        self.model.aux_hidden_state_layers = layers

    def get_eagle3_aux_hidden_state_layers(self) -> tuple[int, ...]:
        """The low, middle and high layers EAGLE-3 heads are trained on, as vLLM picks them."""
        n = len(self.model.layers)
        return (2, n // 2, n - 3)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors, fusing q/k/v and gate/up into their stacked parameters.
        Returns the names of the parameters fully loaded (a fused one once all its shards are)."""
        params = dict(self.named_parameters())
        all_shards: dict[str, set] = defaultdict(set)
        for fused, _, shard_id in self.stacked_params_mapping:
            all_shards[fused].add(shard_id)
        shards_seen: dict[str, set] = defaultdict(set)
        loaded: set[str] = set()
        skip = missing_prefixes(self)
        for name, tensor in weights:
            name = stage_weight_name(self, name, skip)
            if name is None or "rotary_emb.inv_freq" in name:
                continue
            if self.tie_word_embeddings and name.startswith("lm_head.") and name not in params:
                continue
            if load_kv_scale(self, name, tensor):
                continue
            for fused, original, shard_id in self.stacked_params_mapping:
                if original in name:
                    name = name.replace(original, fused)
                    param = find_param(self, params, name, tensor)
                    if param is None:
                        break
                    param.weight_loader(param, tensor, shard_id)
                    shards_seen[name].add(shard_id)
                    if shards_seen[name] == all_shards[fused]:
                        loaded.add(name)
                    break
            else:
                param = find_param(self, params, name, tensor)
                if param is None:
                    continue
                getattr(param, "weight_loader", partial(default_weight_loader, name=name))(param, tensor)
                loaded.add(name)
        return loaded


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the Llama architecture plus sliding-window attention in every layer when
    ``config.sliding_window`` is set."""
