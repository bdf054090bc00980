"""Qwen2: the Llama architecture with biases on the query/key/value projections."""

from __future__ import annotations

from typing import Any

from tokenmill.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen2DecoderLayer(LlamaDecoderLayer):
    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        return True, False

    @staticmethod
    def sliding_window(config: Any, layer_idx: int) -> int | None:
        """``config.sliding_window`` in the layers ``config.layer_types`` marks
        ``"sliding_attention"``, as in HF; transformers derives them from ``use_sliding_window``
        and ``max_window_layers`` (older versions, without ``layer_types``, from those)."""
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None:
            sliding = layer_types[layer_idx] == "sliding_attention"
        else:
            sliding = bool(getattr(config, "use_sliding_window", False))
            sliding = sliding and layer_idx >= config.max_window_layers
        return config.sliding_window if sliding else None


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 causal LM; sliding-window attention in the layers its config says slide."""

    layer_type = Qwen2DecoderLayer
