"""DeepSeek-V3 multi-token prediction (MTP) layers as a model of their own, after vLLM's
``deepseek_mtp.py``: the draft model an ``mtp`` speculative proposer runs.

A V3 checkpoint stores ``num_nextn_predict_layers`` MTP layers after the decoder stack, at
layer indices ``num_hidden_layers + i``: ``enorm`` and ``hnorm`` (RMSNorms of the next token's
embedding and of the previous depth's hidden state), ``eh_proj`` ([hidden, 2·hidden], applied to
their concatenation), one decoder block (MLA + MoE) and ``shared_head`` (``norm`` and ``head``).
The embedding is the main model's (``model.embed_tokens``). Build it with
``load_model(model_dir, target.mtp_config(), ...)`` (``DeepseekV2ForCausalLM.mtp_config``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.linear import ReplicatedLinear
from tokenmill.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.models.deepseek_v2 import DeepseekV2DecoderLayer, load_deepseek_weights
from tokenmill.models.llama import maybe_prefix

class SharedHead(nn.Module):
    """The MTP layer's output norm and vocabulary head."""

    def __init__(self, config: Any, prefix: str = "") -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=f"{prefix}.head")


class DeepSeekMultiTokenPredictorLayer(nn.Module):
    """``h = block(eh_proj([enorm(embed(x_{t+1})), hnorm(h_t)]))``; the embedding of position
    0 is zeroed, as in vLLM (no token precedes it)."""

    def __init__(self, config: Any, prefix: str, layer_idx: int) -> None:
        super().__init__()
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(
            2 * config.hidden_size, config.hidden_size, bias=False, prefix=f"{prefix}.eh_proj"
        )
        self.shared_head = SharedHead(config, prefix=f"{prefix}.shared_head")
        self.mtp_block = DeepseekV2DecoderLayer(config, prefix, layer_idx=layer_idx, v3=True)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        inputs_embeds = inputs_embeds.masked_fill((positions == 0).unsqueeze(-1), 0)
        hidden = self.eh_proj(
            torch.cat((self.enorm(inputs_embeds), self.hnorm(previous_hidden_states)), dim=-1)
        )
        hidden, residual = self.mtp_block(positions, hidden, None)
        return hidden + residual


class DeepSeekMTP(nn.Module):
    """The MTP layers of a DeepSeek-V3 checkpoint. ``forward(input_ids, positions,
    previous_hidden_states, spec_step_idx)`` runs MTP layer ``spec_step_idx`` (modulo their
    number) on the next tokens ``input_ids`` and the hidden states the previous depth (the
    target model's final, normalised hidden states for step 0) produced at the same positions;
    ``compute_logits(hidden, spec_step_idx)`` applies that layer's shared head."""

    def __init__(self, config: Any, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.first_layer = config.num_hidden_layers
        self.num_mtp_layers = config.num_nextn_predict_layers
        model_prefix = maybe_prefix(prefix, "model")
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=f"{model_prefix}.embed_tokens"
        )
        self.layers = nn.ModuleDict(
            {
                str(i): DeepSeekMultiTokenPredictorLayer(
                    config, f"{model_prefix}.layers.{i}", layer_idx=i
                )
                for i in range(self.first_layer, self.first_layer + self.num_mtp_layers)
            }
        )

    def _layer(self, spec_step_idx: int) -> DeepSeekMultiTokenPredictorLayer:
        return self.layers[str(self.first_layer + spec_step_idx % self.num_mtp_layers)]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden_states: torch.Tensor,
        spec_step_idx: int = 0,
    ) -> torch.Tensor:
        return self._layer(spec_step_idx)(
            self.embed_tokens(input_ids), positions, previous_hidden_states
        )

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        head = self._layer(spec_step_idx).shared_head
        return head.head.compute_logits(head.norm(hidden_states))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load ``model.embed_tokens`` and the MTP layers; the decoder stack and ``lm_head``
        are skipped. The MTP layers' own ``embed_tokens`` copies are the main embedding and
        are skipped too. Names: ``model.layers.{k}.{enorm,hnorm,eh_proj,shared_head}.*``
        stay, the decoder block's move under ``mtp_block``."""
        block_parts = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")
        mtp_layers = range(self.first_layer, self.first_layer + self.num_mtp_layers)

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name == "model.embed_tokens.weight":
                    yield "embed_tokens.weight", tensor
                    continue
                parts = name.split(".", 3)
                if len(parts) < 4 or parts[:2] != ["model", "layers"]:
                    continue
                if int(parts[2]) not in mtp_layers:
                    continue
                rest = parts[3]
                if rest.startswith("embed_tokens."):
                    continue
                if rest.startswith(block_parts):
                    rest = f"mtp_block.{rest}"
                yield f"layers.{parts[2]}.{rest}", tensor

        return load_deepseek_weights(self, renamed(), self.config.n_routed_experts)
