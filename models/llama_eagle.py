"""EAGLE-1 draft head for Llama-family targets, after vLLM's ``llama_eagle.py``.

The head predicts the target's next feature (its final, normalised hidden state) from the
current one and the embedding of the token that follows it:
``h' = layers(fc([embed(x_{t+1}) ‖ h_t]))``; the first layer has no input norm and the stack no
final norm, as in the authors' ``cnets.py``. Checkpoints as the EAGLE authors publish them
(``yuhuili/EAGLE-LLaMA3-Instruct-8B``): ``fc.weight``, ``layers.{i}.*`` in HF Llama names, and
usually no ``embed_tokens``/``lm_head``, which the head then shares with the target. A head may
instead carry an LM head over a reduced draft vocabulary, as EAGLE-3 heads do (the config's
``draft_vocab_size``, ``lm_head.weight`` of that many rows, and ``d2t``): each draft step then
multiplies by those rows only, not by the target's whole vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenmill.layers.linear import ReplicatedLinear
from tokenmill.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.models.llama import LlamaDecoderLayer, LlamaForCausalLM

SHAREABLE = ("embed_tokens.weight", "lm_head.weight")
"""Parameters a head may leave to the target (its input embedding and LM head)."""


class EagleHead(nn.Module):
    """What the EAGLE heads have in common: their ``forward(input_ids, positions,
    hidden_states)`` returns the states to take logits of and the states to feed the next
    draft step; ``shares_target`` names the ``SHAREABLE`` parameters the checkpoint left to
    the target, which ``share_target`` then takes from it. Logits are over the draft
    vocabulary (``draft_vocab_size``, the config's, else the target's whole vocabulary);
    ``draft_to_target`` maps its ids to the target's by the checkpoint's ``d2t``."""

    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.shares_target: set[str] = set()
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.register_buffer(
            "draft_id_to_target_id", torch.zeros(self.draft_vocab_size, dtype=torch.int64)
        )

    def share_target(self, target: nn.Module) -> None:
        """Take the target's embedding and LM head where the checkpoint has none."""
        if "embed_tokens.weight" in self.shares_target:
            self.embed_tokens = target.model.embed_tokens
        if "lm_head.weight" in self.shares_target:
            self.lm_head = target.lm_head

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target vocabulary ids of draft vocabulary ids."""
        return draft_ids + self.draft_id_to_target_id[draft_ids]

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF Llama names (q/k/v and gate/up fused) and ``d2t`` (``t2d`` is not needed);
        returns the loaded names plus the shareable ones the checkpoint lacks (recorded in
        ``shares_target``)."""
        has_d2t = False

        def llama_names() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal has_d2t
            for name, tensor in weights:
                if name == "d2t":
                    self.draft_id_to_target_id.copy_(tensor.to(torch.int64))
                    has_d2t = True
                elif name != "t2d":
                    yield name, tensor

        loaded = LlamaForCausalLM.load_weights(self, llama_names())  # type: ignore[arg-type]
        self.shares_target = {name for name in SHAREABLE if name not in loaded}
        if self.draft_vocab_size != self.config.vocab_size:
            if not has_d2t:
                raise ValueError(
                    f"{type(self).__name__} head with draft_vocab_size {self.draft_vocab_size} < "
                    f"vocab_size {self.config.vocab_size} lacks its d2t mapping"
                )
            if "lm_head.weight" in self.shares_target:
                raise ValueError(
                    f"{type(self).__name__} head with draft_vocab_size {self.draft_vocab_size} "
                    f"lacks its own lm_head (the target's covers the whole vocabulary)"
                )
        return loaded | self.shares_target

    @property
    def tie_word_embeddings(self) -> bool:
        return False


class EagleLlamaForCausalLM(EagleHead):
    """EAGLE-1: ``fc`` over ``[embedding ‖ hidden]`` then ``num_hidden_layers`` Llama decoder
    layers; logits through the (shared, or draft-vocabulary) LM head without a final norm."""

    def __init__(self, config: Any, prefix: str = "") -> None:
        super().__init__(config)
        h = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h, prefix="embed_tokens")
        self.fc = ReplicatedLinear(2 * h, h, bias=False, prefix="fc")
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, prefix=f"layers.{i}", layer_idx=i)
            for i in range(config.num_hidden_layers)
        )
        self.layers[0].input_layernorm = nn.Identity()
        self.lm_head = ParallelLMHead(self.draft_vocab_size, h, prefix="lm_head")

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.fc(torch.cat((self.embed_tokens(input_ids), hidden_states), dim=-1))
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden = hidden + residual
        return hidden, hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return self._load(weights)
