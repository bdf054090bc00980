"""Qwen2: the Llama architecture with biases on the query/key/value projections."""

from __future__ import annotations

from typing import Any

from tokenmill.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen2DecoderLayer(LlamaDecoderLayer):
    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        return True, False


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 causal LM. Sliding-window layers (``use_sliding_window``) are not implemented:
    attention is full causal attention, exact while sequences fit in the window."""

    layer_type = Qwen2DecoderLayer
