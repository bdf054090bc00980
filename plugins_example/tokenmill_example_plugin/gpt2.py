"""GPT-2 on tokenmill's layers (after vLLM's ``gpt2.py``).

Learned absolute positions, pre-LayerNorm blocks, a fused QKV projection for multi-head
attention, a GELU MLP and an LM head tied to the token embedding. Real HF checkpoints store
the projections as ``Conv1D`` weights (``[in, out]``); they are transposed on load. Checkpoint
names may or may not start with ``transformer.``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenmill.layers.activation import get_act_fn
from tokenmill.layers.attention import Attention
from tokenmill.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tokenmill.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

CONV1D_WEIGHTS = ("c_attn.weight", "c_proj.weight", "c_fc.weight")
ATTENTION_MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")


class GPT2Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, prefix: str = "") -> None:
        super().__init__()
        hidden_size = config.hidden_size
        total_heads = config.num_attention_heads
        self.head_dim = hidden_size // total_heads
        self.c_attn = QKVParallelLinear(
            hidden_size, self.head_dim, total_heads, bias=True, prefix=f"{prefix}.c_attn"
        )
        self.c_proj = RowParallelLinear(
            hidden_size, hidden_size, bias=True, prefix=f"{prefix}.c_proj"
        )
        self.q_size = self.c_attn.num_heads * self.head_dim
        scale = self.head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= layer_idx + 1
        self.attn = Attention(self.c_attn.num_heads, self.head_dim, scale, prefix=f"{prefix}.attn")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(hidden_states).split(self.q_size, dim=-1)
        return self.c_proj(self.attn(q, k, v))


class GPT2MLP(nn.Module):
    def __init__(self, config: Any, prefix: str = "") -> None:
        super().__init__()
        hidden_size = config.hidden_size
        inner_size = config.n_inner or 4 * hidden_size
        self.c_fc = ColumnParallelLinear(
            hidden_size, inner_size, bias=True, prefix=f"{prefix}.c_fc"
        )
        self.c_proj = RowParallelLinear(
            inner_size, hidden_size, bias=True, prefix=f"{prefix}.c_proj"
        )
        self.act = get_act_fn(config.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: Any, layer_idx: int, prefix: str = "") -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.attn = GPT2Attention(config, layer_idx, prefix=f"{prefix}.attn")
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = GPT2MLP(config, prefix=f"{prefix}.mlp")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states))
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class GPT2Model(nn.Module):
    def __init__(self, config: Any, prefix: str = "") -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}.wte"
        )
        self.wpe = VocabParallelEmbedding(
            config.max_position_embeddings, config.hidden_size, prefix=f"{prefix}.wpe"
        )
        self.h = nn.ModuleList(
            GPT2Block(config, i, prefix=f"{prefix}.h.{i}") for i in range(config.num_hidden_layers)
        )
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            hidden_states = block(hidden_states)
        return self.ln_f(hidden_states)


class GPT2LMHeadModel(nn.Module):
    """GPT-2 causal LM: ``forward`` returns final hidden states [T, hidden];
    ``compute_logits`` projects them onto the vocabulary in float32."""

    def __init__(self, config: Any, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        root = f"{prefix}." if prefix else ""
        self.transformer = GPT2Model(config, prefix=f"{root}transformer")
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, prefix=f"{root}lm_head"
        )
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.transformer.wte)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.transformer(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF GPT-2 tensors; returns the names of the parameters loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(ATTENTION_MASK_BUFFERS):
                continue
            if name.startswith("lm_head."):
                if self.tie_word_embeddings:
                    continue
            elif not name.startswith("transformer."):
                name = f"transformer.{name}"
            if name.endswith(CONV1D_WEIGHTS):
                tensor = tensor.t()
            if name not in params:
                raise ValueError(f"checkpoint weight {name!r} has no matching parameter in GPT-2")
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                _copy_whole(param, tensor, name)
            else:
                loader(param, tensor)
            loaded.add(name)
        return loaded


def _copy_whole(param: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(
            f"{name}: checkpoint tensor has shape {tuple(tensor.shape)}, "
            f"expected {tuple(param.shape)}"
        )
    param.data.copy_(tensor)
