"""EAGLE-3 draft head for Llama-family targets, after vLLM's ``llama_eagle3.py``.

The target's residual stream at a low, a middle and a high layer (``[T, 3·hidden]``) is fused
by ``fc`` into one state; one decoder layer then attends over ``[input_norm(embed(x_{t+1})) ‖
hidden_norm(h_t)]`` (its QKV projection takes ``2·hidden``). A final norm and an LM head over a
reduced draft vocabulary give logits; ``d2t`` maps draft id ``i`` to target id ``i + d2t[i]``.
Later draft steps feed the layer's pre-norm output back in place of the fused state.

Checkpoint layout as the EAGLE authors publish it (``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``):
``fc.weight``, ``midlayer.*`` (the decoder layer, HF Llama names plus ``hidden_norm``),
``norm.weight``, ``lm_head.weight`` ``[draft_vocab_size, hidden]``, ``d2t`` (int64), ``t2d``
(unused); ``embed_tokens.weight`` is optional (shared with the target when absent). The config
gives ``draft_vocab_size`` and, when it differs from ``hidden_size``, ``target_hidden_size``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.linear import QKVParallelLinear, ReplicatedLinear
from tokenmill.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.models.llama import LlamaDecoderLayer
from tokenmill.models.llama_eagle import EagleHead


class Eagle3DecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer over ``[embeds ‖ hidden]``; the residual is the hidden state."""

    def __init__(self, config: Any, prefix: str = "", *, layer_idx: int) -> None:
        super().__init__(config, prefix, layer_idx=layer_idx)
        attn = self.self_attn
        attn.qkv_proj = QKVParallelLinear(
            2 * config.hidden_size,
            attn.head_dim,
            config.num_attention_heads,
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            bias=False,
            prefix=f"{prefix}.self_attn.qkv_proj",
        )
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(  # type: ignore[override]
        self, positions: torch.Tensor, embeds: torch.Tensor, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden_states
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden_states)), dim=-1)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3LlamaForCausalLM(EagleHead):
    """EAGLE-3 head; ``combine_hidden_states`` fuses the target's three layers' states."""

    def __init__(self, config: Any, prefix: str = "") -> None:
        if getattr(config, "norm_before_residual", False):
            raise ValueError("EAGLE-3 heads with norm_before_residual are not supported")
        super().__init__(config)
        h = config.hidden_size
        target_hidden = getattr(config, "target_hidden_size", None) or h
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h, prefix="embed_tokens")
        self.fc = ReplicatedLinear(3 * target_hidden, h, bias=False, prefix="fc")
        self.layers = nn.ModuleList([Eagle3DecoderLayer(config, prefix="layers.0", layer_idx=0)])
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, h, prefix="lm_head")

    def combine_hidden_states(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc(aux_hidden_states)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.layers[0](positions, self.embed_tokens(input_ids), hidden_states)
        return self.norm(hidden, residual)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return self._load((name.replace("midlayer.", "layers.0.", 1), tensor) for name, tensor in weights)
